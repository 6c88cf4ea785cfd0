"""``pld``: prompt lookup / n-gram drafting (Saxena 2023; docs/algorithms.md §6).

The last n committed tokens are searched for earlier in the context (prompt and generated text);
the tokens that followed the match are proposed. n runs from ``max_ngram_size`` down to
``min_ngram_size``; proposals are deterministic, so verification uses the "delta" rule.

The n tried by default depend on the sampling regime (:func:`ngram_sizes`): under greedy decoding
what followed a short recurring suffix is often what the target says again, while a sampled text
leaves such a copy within a token or two, and only a long recurring suffix (a passage the target
is repeating) predicts what it samples next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from specwise.drafters.base import Drafter, DraftingConfig, check_int, register_drafter
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


#: the suffix lengths ``(shortest, longest)`` prompt lookup tries by default under greedy decoding
#: and when sampling (module docstring; measured in docs/benchmarks/pld-ngrams-greedy-report.md and
#: pld-ngrams-t0.7-report.md)
GREEDY_NGRAMS = (1, 3)
SAMPLED_NGRAMS = (8, 12)


def check_ngram_sizes(min_name: str, min_size: int | None, max_name: str, max_size: int | None) -> None:
    """Refuse suffix lengths that are not integers >= 1, or a shortest above the longest (when both
    are given; ``None`` = the regime's default).

    Raises:
        ConfigError: one sentence naming the option.
    """
    check_int(min_name, min_size, optional=True)
    check_int(max_name, max_size, optional=True)
    if min_size is not None and max_size is not None and min_size > max_size:
        raise ConfigError(f"need {min_name} <= {max_name}, got {min_size} and {max_size}.")


def ngram_sizes(min_size: int | None, max_size: int | None, greedy: bool) -> tuple[int, int]:
    """The suffix lengths ``(shortest, longest)`` to try: those given, the rest from the regime's
    default (:data:`GREEDY_NGRAMS`, :data:`SAMPLED_NGRAMS`), a default bound moved to meet a given one.

    Args:
        min_size, max_size: as configured (``None`` = default).
        greedy: whether the generation decodes greedily.
    """
    low, high = GREEDY_NGRAMS if greedy else SAMPLED_NGRAMS
    if max_size is not None:
        high = max_size
        low = min(low, high) if min_size is None else min_size
    elif min_size is not None:
        low, high = min_size, max(high, min_size)
    return low, high


@register_drafter("pld", PromptLookupConfig,
                  "prompt lookup: copy what followed the last n-gram earlier in the context", order=10)
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


def find_continuation(token_ids: torch.Tensor, num_tokens: int, max_ngram: int, min_ngram: int,
                      latest: bool, eos_token_ids: torch.Tensor) -> torch.Tensor | None:
    """Prompt lookup's draft: what followed the context's longest recurring suffix of ``max_ngram``
    down to ``min_ngram`` tokens (the most recent earlier occurrence, or the first), cut after its first EOS.

    Args:
        token_ids: ``[L]`` long context.
        num_tokens: at most this many tokens are returned (>= 1).
        max_ngram, min_ngram: suffix lengths tried, longest first.
        latest: copy from the most recent earlier occurrence instead of the first one.
        eos_token_ids: ``[E]`` long.

    Returns:
        ``[1..num_tokens]`` long, or ``None`` when no suffix recurs.
    """
    length = token_ids.numel()
    high = min(max_ngram, length - 1)
    if high < min_ngram:
        return None
    # one pass instead of one search per n: every earlier position holding the last token ends a
    # match, whose length is how far back the tokens before it agree with the suffix's; the longest
    # match wins, then the latest (or earliest) position among those that long
    ends = (token_ids[: length - 1] == token_ids[-1]).nonzero().flatten()  # shape: [k]
    if ends.numel() == 0:
        return None
    back = torch.arange(high, device=token_ids.device)
    index = ends[:, None] - back  # shape: [k, high]
    same = (index >= 0) & (token_ids[index.clamp(min=0)] == token_ids[length - 1 - back])
    matched = same.int().cumprod(dim=1).sum(dim=1)  # shape: [k]
    n = int(matched.max())
    if n < min_ngram:
        return None
    at = ends[matched >= n]
    start = int(at[-1] if latest else at[0]) + 1
    return cut_after_eos(token_ids[start: start + num_tokens], eos_token_ids.to(token_ids.device))


def cut_after_eos(tokens: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """Drop every token after the first EOS (nothing past an EOS is ever emitted)."""
    is_eos = torch.isin(tokens, eos_ids)
    if bool(is_eos.any()):
        return tokens[: int(is_eos.nonzero()[0]) + 1]
    return tokens
