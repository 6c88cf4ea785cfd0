"""``bigram``'s export format, ``bigram-json``: the table's nonzero entries as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specwise.interop.formats import CONFIG_NAME, Exported, Format, prepare_out, read_json

from .network import BigramTable

FORMATS = ("bigram-json",)


def recognize(config: dict[str, Any]) -> Format | None:
    """Our JSON export when its config says ``bigram_json``."""
    return Format("bigram-json", "bigram", "bigram JSON") if "bigram_json" in config else None


def export(network, target, out: str | Path, fmt: str, *, dtype: torch.dtype, **options) -> Exported:
    """Write the table's nonzero entries to ``out/config.json``."""
    path = prepare_out(out)
    entries = [[int(a), int(b), float(network.table[a, b])] for a, b in network.table.nonzero().tolist()]
    (path / CONFIG_NAME).write_text(json.dumps({"bigram_json": 1, "vocab_size": target.vocab_size,
                                                "entries": entries}))
    return Exported(path)


def read_bigram_json(path: str | Path, target):
    """The table an export at ``path`` holds."""
    config = read_json(Path(path) / CONFIG_NAME)
    table = BigramTable(target.vocab_size)
    for a, b, score in config["entries"]:
        table.table.data[a, b] = score
    return table
