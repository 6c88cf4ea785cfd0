"""Lookahead decoding: window layout, n-gram pool, trie, greedy equivalence and sampling losslessness."""

from __future__ import annotations

import numpy as np
import pytest

import specwise
from conftest import (
    ARCHS,
    assert_distribution,
    check_tree_loop_records,
    make_target,
    random_prompt,
    recording,
    reference_greedy,
    repetitive_prompt,
)
from specwise.engine.tree import merge_paths
from specwise.errors import ConfigError
from specwise.methods.lookahead import LookaheadConfig, LookaheadDrafter, NgramPool, window_layout
from test_sampling_e2e import PROMPT, V, exact_joint


def test_window_layout_matches_the_jacobi_trajectories():
    levels, width = 3, 4
    positions, visible = window_layout(levels, width)
    for a in range(levels * width):
        la, ia = divmod(a, width)
        assert positions[a] == 1 + ia + la
        for b in range(levels * width):
            lb, ib = divmod(b, width)
            expected = (lb == 0 and ib <= ia) or (ib == ia and 1 <= lb <= la)
            assert bool(visible[a, b]) == expected, (a, b)
        # what token a sees is exactly one consecutive run of positions 1 .. 1 + ia + la
        seen_positions = sorted(int(positions[b]) for b in range(levels * width) if visible[a, b])
        assert seen_positions == list(range(1, 2 + ia + la))


def test_ngram_pool_keeps_the_most_recent_continuations():
    pool = NgramPool(capacity=2)
    pool.add(5, (1, 2))
    pool.add(5, (3, 4))
    pool.add(5, (1, 2))  # refreshed: now the most recent
    pool.add(5, (7, 8))  # evicts (3, 4), the least recently used
    assert pool.lookup(5) == [(7, 8), (1, 2)]
    assert pool.lookup(6) == []
    pool.add_sequence([1, 2, 3, 4], 3)
    assert pool.lookup(1) == [(2, 3)] and pool.lookup(2) == [(3, 4)]


def test_merge_paths_builds_a_trie_with_common_prefixes():
    tokens, parents = merge_paths([], [], [(1, 2, 3), (1, 2, 4), (5,), (1, 6)])
    assert tokens == [1, 2, 3, 4, 5, 6]
    assert parents == [0, 1, 2, 2, 0, 1]


@pytest.mark.parametrize("options", [
    dict(window_size=0), dict(ngram_size=1), dict(max_candidates=0), dict(context_match_tokens=-1),
])
def test_bad_options_are_refused(options):
    with pytest.raises(ConfigError):
        LookaheadConfig(**options)


CONFIGS = [
    dict(),
    dict(window_size=1, ngram_size=2, max_candidates=1, context_match_tokens=0),
    dict(window_size=5, ngram_size=5, max_candidates=8),
    dict(window_size=3, ngram_size=3, max_candidates=3, pool_from_prompt=False, pool_from_output=False),
]


@pytest.mark.parametrize("options", CONFIGS)
@pytest.mark.parametrize("prompt_kind", ["repetitive", "random"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_equals_plain_decoding(arch, prompt_kind, options):
    target = make_target(arch, eos=())
    prompt = repetitive_prompt(30) if prompt_kind == "repetitive" else random_prompt(30, seed=2)
    max_new_tokens = 32
    truth = reference_greedy(target.model, prompt, max_new_tokens)
    drafter = recording(LookaheadDrafter)(target, LookaheadConfig(**options))
    result = specwise.generate(target, prompt, drafter=drafter, max_new_tokens=max_new_tokens)
    assert result.token_ids == truth
    check_tree_loop_records(drafter, prompt.tolist(), result.token_ids, max_new_tokens, truth)


def test_repetitive_text_gets_accepted_drafts():
    target = make_target("llama", eos=())
    result = specwise.generate(target, repetitive_prompt(30), method="lookahead", max_new_tokens=32)
    assert result.stats.accepted_tokens > 0 and result.stats.mean_accepted_length > 1.2


def test_sampled_sequences_follow_the_target_distribution():
    target = make_target("llama", 0, vocab_size=V, eos=())
    sampling = dict(temperature=0.9, top_k=6)
    exact = exact_joint(target.model, PROMPT, 3, **sampling)
    drafter = LookaheadDrafter(target, LookaheadConfig(window_size=2, ngram_size=3, max_candidates=3))
    counts = np.zeros([V] * 3, np.int64)
    drafted = accepted = 0
    for seed in range(1500):
        result = specwise.generate(target, PROMPT, drafter=drafter, max_new_tokens=3, seed=seed, **sampling)
        counts[tuple(result.token_ids)] += 1
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    assert 0 < accepted < drafted, "both acceptance and rejection must be exercised"
    assert_distribution(counts, exact, "lookahead sequences")


@pytest.mark.parametrize("arch", ARCHS)
def test_the_window_never_sits_past_the_context(arch, monkeypatch):
    """A request that fills the context exactly: in the last steps the window would get positions
    past ``max_context``; it is left out, and the output is still the greedy one."""
    target = make_target(arch)
    prompt = repetitive_prompt(500)
    max_new_tokens = target.max_context - prompt.numel()
    farthest = []
    forward = target.forward

    def spy(input_ids, cache, **kwargs):
        layout = kwargs.get("layout")
        farthest.append(int(layout.positions.max()) if layout is not None else cache.length + input_ids.numel() - 1)
        return forward(input_ids, cache, **kwargs)

    monkeypatch.setattr(target, "forward", spy)
    config = LookaheadConfig(window_size=4, ngram_size=4)
    result = specwise.generate(target, prompt, drafter=LookaheadDrafter(target, config), max_new_tokens=max_new_tokens)
    assert max(farthest) < target.max_context
    assert result.token_ids == reference_greedy(target.model, prompt, max_new_tokens)[: len(result.token_ids)]
