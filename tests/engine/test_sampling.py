"""Logits processing (specwise.engine.sampling) against the by-the-definition reference in conftest."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import reference_scores
from specwise.engine.sampling import (
    NonFiniteDistributionError,
    SamplingConfig,
    nucleus,
    prefix_token_masks,
    probs_from_scores,
    process_logits,
)
from specwise.engine.step import verify_chain

V = 24


@given(st.lists(st.integers(0, 9), min_size=1, max_size=12), st.lists(st.integers(0, 9), max_size=6))
def test_prefix_token_masks_match_naive(context, chain):
    seen = prefix_token_masks(torch.tensor(context), torch.tensor(chain, dtype=torch.long), 10)
    assert seen.shape == (len(chain) + 1, 10) and seen.dtype == torch.bool
    for j in range(len(chain) + 1):
        prefix = set(context) | set(chain[:j])
        assert seen[j].tolist() == [t in prefix for t in range(10)], j


def _chain_case(seed: int):
    """Raw logits ``[5, V]`` for a context and a 4-token chain (with repeats), plus each row's prefix."""
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(5, V, generator=g, dtype=torch.float64)
    context = torch.randint(0, V, (6,), generator=g)
    chain = torch.tensor([int(context[0]), 5, 5, 17])
    prefixes = [context.tolist() + chain[:j].tolist() for j in range(5)]
    return logits, context, chain, prefixes


CONFIGS = [
    dict(temperature=t, top_k=k, top_p=p, repetition_penalty=r)
    for t, k, p, r in itertools.product([0.5, 1.0, 1.7], [0, 1, 3, V + 5], [1.0, 0.9, 0.4], [1.0, 1.3, 0.7])
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "t{temperature}-k{top_k}-p{top_p}-r{repetition_penalty}".format(**c))
def test_process_logits_matches_reference(config):
    for seed in range(3):
        logits, context, chain, prefixes = _chain_case(seed)
        seen = prefix_token_masks(context, chain, V)
        scores = process_logits(logits, SamplingConfig(**config), seen)
        assert scores.shape == logits.shape and scores.dtype == torch.float64
        for j, prefix in enumerate(prefixes):
            expected = reference_scores(logits[j], prefix, **config)
            assert torch.equal(torch.isinf(scores[j]), torch.isinf(expected)), (seed, j)
            torch.testing.assert_close(scores[j], expected)
            assert torch.isfinite(scores[j]).any()


@pytest.mark.parametrize("penalty", [1.0, 1.5])
def test_greedy_configs_only_apply_the_penalty(penalty):
    logits, context, chain, prefixes = _chain_case(0)
    seen = prefix_token_masks(context, chain, V)
    for config in (SamplingConfig(repetition_penalty=penalty),
                   SamplingConfig(temperature=0.7, top_k=1, top_p=0.5, repetition_penalty=penalty)):
        assert config.is_greedy
        scores = process_logits(logits, config, seen)
        for j, prefix in enumerate(prefixes):
            torch.testing.assert_close(scores[j], reference_scores(logits[j], prefix, repetition_penalty=penalty))


def test_top_k_one_is_greedy():
    """top-k = 1 selects the argmax at any temperature: as a greedy config, or, as a distribution, a point mass."""
    logits, context, chain, prefixes = _chain_case(1)
    seen = prefix_token_masks(context, chain, V)
    config = SamplingConfig(temperature=1.3, top_k=1, repetition_penalty=1.2)
    assert config.is_greedy
    argmax = process_logits(logits, config, seen).argmax(-1)
    for j, prefix in enumerate(prefixes):
        assert int(argmax[j]) == int(reference_scores(logits[j], prefix, repetition_penalty=1.2).argmax())
        one_hot = reference_scores(logits[j], prefix, temperature=1.3, top_k=1, repetition_penalty=1.2)
        assert int(one_hot.argmax()) == int(argmax[j])


def test_tiny_top_p_keeps_exactly_the_most_likely_token():
    logits, *_ = _chain_case(2)
    scores = process_logits(logits, SamplingConfig(temperature=1.0, top_p=1e-9))
    assert (torch.isfinite(scores).sum(-1) == 1).all()
    assert torch.equal(scores.argmax(-1), logits.argmax(-1))
    probs = probs_from_scores(scores)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5, dtype=torch.float64))


@pytest.mark.parametrize("dtype, expected", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.float32, torch.float32), (torch.float64, torch.float64)])
def test_output_dtype(dtype, expected):
    logits = torch.randn(3, V).to(dtype)
    for config in (SamplingConfig(), SamplingConfig(temperature=0.9, top_k=5, top_p=0.8)):
        assert process_logits(logits, config).dtype == expected


def test_penalty_without_seen_is_an_error():
    with pytest.raises(ValueError, match="seen"):
        process_logits(torch.randn(2, V), SamplingConfig(temperature=1.0, repetition_penalty=1.2))


def test_verify_chain_penalises_each_position_with_its_own_prefix():
    """Context [0], drafts [1, 2], the same raw logits at every position. Penalty 2: row 0 sees {0}
    and picks 1, row 1 sees {0, 1} and picks 2, row 2 sees {0, 1, 2} and picks 0. Penalising every
    row with the context only (the HF 3-D processor bug) would reject draft 2."""
    logits = torch.tensor([[5.0, 4.9, 4.8, 1.0]] * 3, dtype=torch.float64)
    config = SamplingConfig(repetition_penalty=2.0)
    assert verify_chain(logits, torch.tensor([1, 2]), None, torch.tensor([0]), config, None) == (2, 0)


@pytest.mark.parametrize("first_k", [1, 16, 1024])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_partial_sort_nucleus_equals_the_full_sort(first_k, top_p):
    # flat rows need far more than first_k tokens (the sort grows), peaked rows need a few
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5000, generator=generator, dtype=torch.float64)
    logits[:3] *= torch.tensor([0.1, 3.0, 12.0], dtype=torch.float64)[:, None]
    logits[4, :100] = float("-inf")  # masked by top-k earlier in the pipeline
    kept = nucleus(logits, top_p, first_k=first_k)
    ordered, order = torch.sort(logits, dim=-1, descending=True)
    probs = ordered.softmax(-1)
    expected_sorted = (probs.cumsum(-1) - probs) < top_p
    expected_sorted[:, 0] = True
    expected = torch.zeros_like(kept).scatter(-1, order, expected_sorted)
    assert torch.equal(kept, expected)
    assert kept.sum(-1).min() >= 1


def _nucleus_by_definition(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """``[V]`` scores -> ``[V]`` kept: rank by probability (descending), ties by token id (ascending);
    keep a token iff the mass ranked above it is below ``top_p``."""
    probs = scores.softmax(-1)
    order = sorted(range(probs.numel()), key=lambda i: (-float(probs[i]), i))
    kept = torch.zeros(probs.numel(), dtype=torch.bool)
    above = 0.0
    for i in order:
        if above >= top_p and i != order[0]:
            break
        kept[i] = True
        above += float(probs[i])
    return kept


@given(
    st.lists(st.integers(0, 3), min_size=40, max_size=40),
    st.sampled_from([0.3, 0.5, 0.8, 0.95]),
    st.sampled_from([1, 2, 5]),
    st.sampled_from([torch.float32, torch.float64]),
)
def test_nucleus_of_a_row_does_not_depend_on_the_other_rows(levels, top_p, first_k, dtype):
    # few distinct logits, so ties at the boundary are the rule; a flat row grows the partial sort
    row = torch.tensor(levels, dtype=dtype)
    flat = torch.zeros_like(row)
    alone = nucleus(row[None], top_p, first_k=first_k)[0]
    batched = nucleus(torch.stack([flat, row, flat]), top_p, first_k=first_k)[1]
    assert torch.equal(alone, batched)
    assert torch.equal(alone, _nucleus_by_definition(row, top_p))


def test_nucleus_boundary_is_batch_invariant_for_a_large_bf16_vocabulary():
    # the repro: V = 262,144 bf16-rounded logits, top_p = 0.95, one row alone vs. batched
    # with a flat row; tied logits at the boundary must not swap in and out
    generator = torch.Generator().manual_seed(0)
    row = (torch.randn(262_144, generator=generator) * 4.0).to(torch.bfloat16)
    config = SamplingConfig(temperature=1.0, top_p=0.95)
    alone = process_logits(row[None], config)[0]
    batched = process_logits(torch.stack([torch.zeros_like(row), row]), config)[1]
    assert torch.equal(torch.isfinite(alone), torch.isfinite(batched))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_host_softmax_and_log_softmax_match_torch(dtype):
    """CPU rows are computed by NumPy (no intra-op team on the calling thread): the same values as
    torch's, masked tokens at 0 (or -inf), a row with nothing finite NaN as torch gives it."""
    from specwise.engine.sampling import log_probs_from_scores

    scores = torch.randn(3, 5000, dtype=dtype, generator=torch.Generator().manual_seed(0)) * 8
    scores[1, ::3] = float("-inf")
    scores[2] = float("-inf")
    probs, logp = probs_from_scores(scores), log_probs_from_scores(scores)
    assert probs.dtype == dtype and logp.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(probs[:2], torch.softmax(scores[:2], -1), **tol)
    torch.testing.assert_close(logp[:2], torch.log_softmax(scores[:2], -1), **tol)
    assert (probs[1, ::3] == 0).all() and torch.isinf(logp[1, ::3]).all()
    assert torch.isnan(probs[2]).all() and torch.isnan(torch.softmax(scores[2], -1)).all()
    assert scores[0].isfinite().all()  # the input is not written


def test_temperature_is_applied_on_the_host_without_touching_the_logits():
    logits = torch.randn(2, 4096, generator=torch.Generator().manual_seed(1))
    kept = logits.clone()
    scores = process_logits(logits, SamplingConfig(temperature=0.7))
    torch.testing.assert_close(scores, kept / 0.7)
    assert torch.equal(logits, kept)


def _vocab_row(seed: int, dtype=torch.float32, vocab: int = 5000) -> torch.Tensor:
    """A large-vocabulary row (the fused path needs more than two CDF blocks) whose mass sits on a
    few tokens, so a chi-square over them has power."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.randn(vocab, generator=gen, dtype=torch.float64) - 12.0
    row[torch.arange(0, 40) * 97] = torch.randn(40, generator=gen, dtype=torch.float64) * 1.5
    return row.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_step_without_drafts_samples_the_temperature_softmax(dtype):
    """The fused draw of a step with nothing to verify (:func:`sample_from_logits`) is distributed
    as softmax(x / T), over 20,000 draws; masked tokens are never drawn."""
    from conftest import assert_distribution
    from specwise.engine.sampling import sample_from_logits

    row = _vocab_row(0, dtype)
    row[97] = float("-inf")  # a token a grammar refuses
    config = SamplingConfig(temperature=0.7)
    gen = torch.Generator().manual_seed(1)
    counts = np.bincount([sample_from_logits(row, config, gen) for _ in range(20_000)], minlength=row.numel())
    assert_distribution(counts, torch.softmax(row.double() / 0.7, -1).numpy(), "fused draws")


def test_the_fused_draw_is_the_general_paths_draw():
    """One uniform number drawn alike: the same seed gives the general path's token (the two
    differ only in float rounding, which lands on a CDF boundary almost never)."""
    from specwise.engine.sampling import sample_from_logits, sample_token

    config = SamplingConfig(temperature=0.8)
    for seed in range(100):
        row = _vocab_row(seed)
        general = sample_token(probs_from_scores(process_logits(row[None], config))[0], torch.Generator().manual_seed(seed))
        assert sample_from_logits(row, config, torch.Generator().manual_seed(seed)) == general
    with pytest.raises(NonFiniteDistributionError):
        sample_from_logits(torch.full((5000,), float("-inf")), config, torch.Generator().manual_seed(0))
    truncated = SamplingConfig(temperature=0.8, top_k=5)  # not fused: the general path, top-k kept
    row = _vocab_row(3)
    draws = {sample_from_logits(row, truncated, torch.Generator().manual_seed(s)) for s in range(300)}
    assert draws <= set(torch.topk(row, 5).indices.tolist())
