"""``ar``: plain autoregressive decoding through the speculative loop (the baseline)."""

from __future__ import annotations

from dataclasses import dataclass

from specwise.drafters.base import Drafter, MethodConfig, register_drafter
from specwise.engine.types import DraftContext, Proposal


@dataclass(frozen=True)
class AutoregressiveConfig(MethodConfig):
    """``ar`` has no options."""


@register_drafter("ar", AutoregressiveConfig, "plain decoding, one target forward per token (baseline)", order=0)
class AutoregressiveDrafter(Drafter):
    """Proposes nothing, so every step is one ordinary decoding step."""

    drafts = False

    def __init__(self, target, config: AutoregressiveConfig) -> None:
        self.config = config
        self.target = target

    def propose(self, state, ctx: DraftContext) -> Proposal:
        return Proposal.empty(ctx.token_ids.device)
