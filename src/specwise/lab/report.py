"""Rendering :class:`SpecStats` for people (rich tables). The library itself never prints."""

from __future__ import annotations

from typing import Sequence

from rich.table import Table

from specwise.engine.types import SpecStats


def stats_table(runs: Sequence[SpecStats], baseline: SpecStats | None = None, title: str | None = None) -> Table:
    """A table with one row per run; with ``baseline``, a speedup column (tokens/s ratio)."""
    table = Table(title=title)
    for name in ("method", "new tokens", "forwards", "τ", "accept rate", "tok/s"):
        table.add_column(name, justify="right" if name != "method" else "left")
    if baseline is not None:
        table.add_column("speedup", justify="right")
    for s in runs:
        row = [s.method, str(s.new_tokens), str(s.target_forwards), f"{s.mean_accepted_length:.2f}",
               f"{s.acceptance_rate:.2f}", f"{s.tokens_per_second:.1f}"]
        if baseline is not None:
            row.append(f"{s.tokens_per_second / baseline.tokens_per_second:.2f}x" if baseline.tokens_per_second else "-")
        table.add_row(*row)
    return table
