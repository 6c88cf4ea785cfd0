"""Exactness at the edges: non-finite distributions, tiny acceptance probabilities, custom proposals.

A distribution that is not finite must stop generation with a clear error, never emit a token; a
draft whose target probability is below float32's resolution must still be accepted with that
probability; a custom proposal whose sibling rule would give infinite or undefined ratios must be
refused when it is built.
"""

from __future__ import annotations

import pytest
import torch

from specwise.engine.sampling import NonFiniteDistributionError, SamplingConfig, sample_token
from specwise.engine.step import verify_chain, verify_tree
from specwise.engine.tree import DraftTree
from specwise.errors import SpecwiseError

V = 8
SAMPLED = SamplingConfig(temperature=0.7)
GREEDY = SamplingConfig()


# ------------------------------------------------------------------------------------------
# non-finite distributions


@pytest.mark.parametrize("bad", ["nan", "inf", "zero"])
def test_sample_token_refuses_a_distribution_without_finite_mass(bad):
    probs = torch.full((V,), 1.0 / V)
    if bad == "zero":
        probs.zero_()
    else:
        probs[3] = float(bad)
    with pytest.raises(NonFiniteDistributionError, match="not finite"):
        sample_token(probs, torch.Generator().manual_seed(0))


def _overflowed_logits(rows: int) -> torch.Tensor:
    """``[rows, V]`` float16 logits where the forward overflowed: inf and NaN."""
    logits = torch.randn(rows, V).to(torch.float16)
    logits[:, 2] = float("inf")
    logits[:, 5] = float("nan")
    return logits


@pytest.mark.parametrize("sampling", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
@pytest.mark.parametrize("num_drafts", [0, 2])
def test_verify_chain_refuses_overflowed_logits_naming_the_dtype(sampling, num_drafts):
    logits = _overflowed_logits(num_drafts + 1)
    drafts = torch.arange(num_drafts)
    with pytest.raises(NonFiniteDistributionError, match="float16") as raised:
        verify_chain(logits, drafts, None, torch.tensor([1]), sampling, torch.Generator().manual_seed(0))
    assert isinstance(raised.value, SpecwiseError)
    assert "\n" not in str(raised.value)


def test_verify_chain_refuses_a_non_finite_row_after_accepted_drafts():
    # rows 0 and 1 are fine and pick the drafts; row 2 (the bonus position) overflowed
    logits = torch.full((3, V), -10.0, dtype=torch.bfloat16)
    logits[0, 4] = logits[1, 6] = 10.0
    logits[2] = float("nan")
    with pytest.raises(NonFiniteDistributionError, match="bfloat16"):
        verify_chain(logits, torch.tensor([4, 6]), None, torch.tensor([1]), GREEDY, None)


@pytest.mark.parametrize("sampling", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_verify_tree_refuses_overflowed_logits_naming_the_dtype(sampling):
    tree = DraftTree.build(torch.tensor(1), torch.tensor([3, 4]), torch.tensor([0, 0]))
    with pytest.raises(NonFiniteDistributionError, match="float16"):
        verify_tree(_overflowed_logits(3), tree, None, "delta", torch.tensor([1]), sampling,
                    torch.Generator().manual_seed(0))

