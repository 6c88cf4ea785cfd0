"""N-gram lookup in a token sequence, which several drafters share: the context's longest recurring
suffix and what followed it (:func:`find_continuation`; Saxena 2023, docs/algorithms.md §6), the
suffix lengths tried in each sampling regime (:func:`ngram_sizes`), and a draft cut at its first EOS.

Prompt lookup (``pld``), Lookahead's pool fallback, the suffix index, the lookup graft of the trained
drafters and Predicted Outputs all copy what followed a recurring suffix; this module is the one rule.
"""

from __future__ import annotations

import torch

from specwise.checks import check_int
from specwise.errors import ConfigError

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
