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


# ------------------------------------------------------------------------------------------
# acceptance uniforms in float64


def _seed_with_a_tiny_uniform(below: float, chunk: int = 1 << 22) -> tuple[int, float]:
    """``(draws_before, u)``: the first float64 uniform below ``below`` of a generator seeded 0."""
    generator = torch.Generator().manual_seed(0)
    offset = 0
    while True:
        draws = torch.rand(chunk, generator=generator, dtype=torch.float64)
        hits = (draws < below).nonzero()
        if hits.numel():
            index = int(hits[0])
            return offset + index, float(draws[index])
        offset += chunk


def _generator_before(draws_before: int, u: float, chunk: int = 1 << 22) -> torch.Generator:
    generator = torch.Generator().manual_seed(0)
    for size in [chunk] * (draws_before // chunk) + [draws_before % chunk]:
        torch.rand(size, generator=generator, dtype=torch.float64)
    probe = torch.Generator().set_state(generator.get_state())
    assert float(torch.rand((), generator=probe, dtype=torch.float64)) == u  # the stream is sequential
    return generator


@pytest.fixture(scope="module")
def tiny_uniform() -> tuple[int, float]:
    return _seed_with_a_tiny_uniform(2.0**-25)


def _probs_with(token: int, mass: float) -> torch.Tensor:
    probs = torch.full((V,), (1.0 - mass) / (V - 1), dtype=torch.float32)  # as process_logits gives
    probs[token] = mass
    return probs


def test_a_draft_below_float32_resolution_is_accepted_when_the_uniform_is_below_it(tiny_uniform):
    # p(x) = 2u < 2^-24: a float32 uniform (a multiple of 2^-24) is below it only when it is 0
    from specwise.engine.verify import speculative_sample

    draws_before, u = tiny_uniform
    target_probs = torch.stack([_probs_with(3, 2 * u), _probs_with(0, 0.5)])
    generator = _generator_before(draws_before, u)
    num_accepted, _ = speculative_sample(torch.tensor([3]), target_probs, None, generator)
    assert num_accepted == 1


def test_a_tree_draft_below_float32_resolution_is_accepted_when_the_uniform_is_below_it(tiny_uniform):
    from specwise.engine.verify import tree_speculative_sample

    draws_before, u = tiny_uniform
    target_probs = torch.stack([_probs_with(3, 2 * u), _probs_with(0, 0.5)])
    generator = _generator_before(draws_before, u)
    path, _ = tree_speculative_sample(((1,), ()), [1, 3], target_probs, None, "delta", generator)
    assert path == [1]


# ------------------------------------------------------------------------------------------
# custom proposals with stochastic sibling rules


def _q(*masses: tuple[int, float]) -> torch.Tensor:
    row = torch.zeros(V)
    for token, mass in masses:
        row[token] = mass
    return row


@pytest.mark.parametrize("rule, tokens, draft_probs, message", [
    # a drafted token the draft distribution gives no mass: p(x) / q(x) is infinite
    ("iid", (3, 4), (_q((3, 0.5), (5, 0.5)), _q((3, 0.5), (5, 0.5))), "probability 0"),
    # the same token twice among siblings drawn without replacement
    ("without_replacement", (3, 3), (_q((3, 0.5), (5, 0.5)), _q((3, 0.5), (5, 0.5))), "twice"),
    # the first sibling took all of q: nothing is left to draw the second from
    ("without_replacement", (3, 5), (_q((3, 1.0)), _q((3, 1.0))), "probability 0"),
])
def test_a_stochastic_sibling_rule_refuses_an_impossible_proposal(rule, tokens, draft_probs, message):
    from specwise.engine.types import Proposal
    from specwise.errors import DrafterError

    with pytest.raises(DrafterError, match=message):
        Proposal(torch.tensor(tokens), draft_probs=torch.stack(draft_probs), parents=torch.tensor([0, 0]),
                 sibling_rule=rule)


def test_a_stochastic_sibling_rule_needs_draft_probs_and_a_known_name():
    from specwise.engine.types import Proposal
    from specwise.errors import DrafterError

    with pytest.raises(DrafterError, match="draft_probs"):
        Proposal(torch.tensor([3, 4]), parents=torch.tensor([0, 0]), sibling_rule="iid")
    with pytest.raises(DrafterError, match="sibling rule"):
        Proposal(torch.tensor([3, 4]), parents=torch.tensor([0, 0]), sibling_rule="shuffled")


def test_a_possible_stochastic_proposal_is_accepted():
    from specwise.engine.types import Proposal

    q = _q((3, 0.5), (5, 0.5))
    Proposal(torch.tensor([3, 5]), draft_probs=torch.stack([q, q]), parents=torch.tensor([0, 0]),
             sibling_rule="without_replacement")
    Proposal(torch.tensor([3, 3]), draft_probs=torch.stack([q, q]), parents=torch.tensor([0, 0]), sibling_rule="iid")


def test_the_two_level_inverse_cdf_draws_what_one_cumulative_sum_draws():
    """``sample_token``'s blockwise sums pick the token a single float64 cumulative sum picks, for
    every uniform number tried, on peaked and flat rows and a vocabulary that is no multiple of a block."""
    import numpy as np

    from specwise.engine.sampling import CDF_BLOCK, _blockwise_inverse_cdf

    rng = np.random.default_rng(0)
    for size, scale in ((5 * CDF_BLOCK + 17, 1.0), (3 * CDF_BLOCK, 6.0), (2 * CDF_BLOCK + 1, 0.1)):
        probs = np.exp(rng.normal(size=size) * scale).astype(np.float32)
        probs[rng.integers(0, size, size // 10)] = 0.0  # tokens without mass are never drawn
        cdf = np.cumsum(probs.astype(np.float64))
        for u in np.concatenate([rng.random(2000), [0.0, 1 - 1e-16]]):
            index, total = _blockwise_inverse_cdf(probs, float(u))
            expected = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), size - 1)
            assert probs[index] > 0 and abs(total - cdf[-1]) <= 1e-9 * cdf[-1]
            assert index == expected or abs(cdf[index] - u * cdf[-1]) <= 1e-12 * cdf[-1]
