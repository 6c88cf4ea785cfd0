"""Prompt lookup's one-pass search finds what a search per suffix length finds."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specwise.drafters.ngram_lookup import cut_after_eos, find_continuation

EOS = torch.tensor([3])


def lookup_continuation(ids: torch.Tensor, n: int, num: int, latest: bool):
    """What followed an earlier occurrence of the last ``n`` tokens (the latest or the first), by
    comparing every window of ``n`` tokens that ends before the last token; ``None``: none."""
    windows = ids[: ids.numel() - 1].unfold(0, n, 1)  # shape: [L-n, n]
    starts = (windows == ids[ids.numel() - n:]).all(dim=1).nonzero()
    if starts.numel() == 0:
        return None
    start = int(starts[-1 if latest else 0]) + n
    return ids[start: start + num]


def _per_length(ids: torch.Tensor, num: int, high: int, low: int, latest: bool):
    """The definition: the longest recurring suffix from ``high`` down to ``low`` tokens, one search each."""
    for n in range(min(high, ids.numel() - 1), low - 1, -1):
        drafts = lookup_continuation(ids, n, num, latest)
        if drafts is not None:
            return cut_after_eos(drafts, EOS)
    return None


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 4), st.integers(0, 4), st.booleans(),
       st.integers(1, 6))
def test_the_one_pass_search_equals_a_search_per_suffix_length(tokens, low, extra, latest, num):
    ids = torch.tensor(tokens, dtype=torch.long)
    found = find_continuation(ids, num, low + extra, low, latest, EOS)
    expected = _per_length(ids, num, low + extra, low, latest)
    assert (found is None) == (expected is None)
    if found is not None:
        assert found.tolist() == expected.tolist()
