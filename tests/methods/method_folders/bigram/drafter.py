"""``bigram``'s drafter: a chain of the table's best next tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specwise.checks import check_int
from specwise.drafters.base import Drafter, MethodConfig, loaded_once, on_disk, register_drafter
from specwise.drafters.checkpoint import load_checkpoint
from specwise.engine.types import DraftContext, Proposal
from specwise.errors import ConfigError
from specwise.interop.formats import detect

from .interop import read_bigram_json
from .network import BigramTable


@dataclass(frozen=True)
class BigramConfig(MethodConfig):
    """``drafter_path``: a trained table (a specwise checkpoint or its JSON export);
    ``num_draft_tokens``: the chain's length."""

    drafter_path: str | None = None
    num_draft_tokens: int = 3

    def __post_init__(self) -> None:
        if self.drafter_path is None:
            raise ConfigError("bigram needs drafter_path: train one with `specwise train bigram`.")
        check_int("num_draft_tokens", self.num_draft_tokens, 1)


def load_network(path, target) -> BigramTable:
    """The table at ``path``, from our checkpoint or from the JSON export."""
    found = detect(path)
    if found is not None and found.name == "bigram-json":
        return read_bigram_json(path, target)
    checkpoint = load_checkpoint(path, target, "bigram")
    table = BigramTable(target.vocab_size)
    table.table.data.copy_(checkpoint.tensors["table"].float())
    return table


@register_drafter("bigram", BigramConfig, "a bigram table (test-only trained method)", auto_candidate=False)
class BigramDrafter(Drafter):
    """Drafts from a :class:`BigramTable`, which is loaded once per target and path."""

    def __init__(self, target, config: BigramConfig) -> None:
        self.config = config
        self.target = target
        self.table = loaded_once(target, ("bigram", *on_disk(config.drafter_path)),
                                 lambda: load_network(config.drafter_path, target))

    def propose(self, state, ctx: DraftContext) -> Proposal:
        tokens = self.table.chain(int(ctx.token_ids[-1]), self.config.num_draft_tokens)
        return Proposal(torch.tensor(tokens, dtype=torch.long, device=ctx.token_ids.device))
