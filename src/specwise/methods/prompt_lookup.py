"""``pld``: prompt lookup / n-gram drafting (Saxena 2023; docs/algorithms.md §6).

The last n committed tokens are searched for earlier in the context (prompt and generated text);
the tokens that followed the match are proposed. n runs from ``max_ngram_size`` down to
``min_ngram_size``; proposals are deterministic, so verification uses the "delta" rule.

The n tried by default depend on the sampling regime
(:func:`specwise.drafters.ngram_lookup.ngram_sizes`): under greedy decoding what followed a short
recurring suffix is often what the target says again, while a sampled text leaves such a copy
within a token or two, and only a long recurring suffix (a passage the target is repeating)
predicts what it samples next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from specwise.drafters.base import Drafter, DraftingConfig, register_drafter
from specwise.drafters.ngram_lookup import check_ngram_sizes, find_continuation, ngram_sizes
from specwise.engine.types import DraftContext, Proposal
from specwise.errors import ConfigError


@dataclass(frozen=True)
class PromptLookupConfig(DraftingConfig):
    """Options of ``pld``."""

    num_draft_tokens: int = 10  # tokens copied after a match (K)
    # the suffix lengths tried, longest first; None = by the sampling regime (GREEDY_NGRAMS, SAMPLED_NGRAMS)
    max_ngram_size: int | None = None
    min_ngram_size: int | None = None
    match: Literal["earliest", "latest"] = "latest"  # which occurrence to copy from: "earliest" (the references) or "latest"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ngram_sizes("min_ngram_size", self.min_ngram_size, "max_ngram_size", self.max_ngram_size)
        if self.match not in ("earliest", "latest"):
            raise ConfigError(f"match must be 'earliest' or 'latest', got {self.match!r}.")


# not among auto's default candidates: suffix decoding drafts from this context as prompt lookup
# does and from earlier requests' outputs too, which auto's measurement on built-in texts cannot
# show (there prompt lookup measured faster; on held-out prompts suffix decoding ran faster in
# every greedy run, within a few per cent of it sampled, docs/benchmarks/auto-floor-report.md)
@register_drafter("pld", PromptLookupConfig,
                  "prompt lookup: copy what followed the last n-gram earlier in the context", order=10,
                  auto_candidate=False)
class PromptLookupDrafter(Drafter):
    """Drafts by n-gram matching against the context; no model."""

    def __init__(self, target, config: PromptLookupConfig) -> None:
        self.config = config
        self.target = target
        self.eos_token_ids = torch.tensor(sorted(target.eos_token_ids), dtype=torch.long)

    def propose(self, state, ctx: DraftContext) -> Proposal:
        budget = min(self.config.num_draft_tokens, ctx.max_draft_tokens)
        ids = ctx.token_ids
        if budget <= 0:
            return Proposal.empty(ids.device)
        low, high = ngram_sizes(self.config.min_ngram_size, self.config.max_ngram_size, ctx.sampling.is_greedy)
        drafts = find_continuation(ids, budget, high, low, self.config.match == "latest", self.eos_token_ids)
        return Proposal.empty(ids.device) if drafts is None else Proposal(drafts)
