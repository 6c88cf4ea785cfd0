"""Suffix decoding: the index's matches, the voted draft tree, greedy equivalence with the index
filled by other requests, scopes and memory bounds, and sampling losslessness."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
from specwise.errors import ConfigError
from specwise.methods.suffix.drafter import SuffixConfig, SuffixDrafter, draft_tree, shared_index
from specwise.methods.suffix.index import SharedSuffixIndex, SuffixIndex
from test_sampling_e2e import PROMPT, V, exact_joint


def brute_longest(texts: list[list[int]], context: list[int], low: int, high: int, depth: int):
    """Every occurrence of each suffix of ``context`` (2..high tokens) with a continuation, the
    longest kept, most recent first: ``(length, continuations)`` or ``None``."""
    best, hits = max(low, 2) - 1, []
    for n in range(max(low, 2), min(high, len(context)) + 1):
        found = [text[end + 1: end + 1 + depth]
                 for text in reversed(texts) for end in range(len(text) - 2, n - 2, -1)
                 if text[end - n + 1: end + 1] == context[-n:]]
        if found:
            best, hits = n, found
    return (best, hits) if hits else None


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=4),
       context=st.lists(st.integers(0, 3), min_size=2, max_size=8), low=st.integers(1, 4), high=st.integers(2, 6),
       depth=st.integers(1, 4))
def test_the_longest_match_is_every_occurrence_of_the_longest_recurring_suffix(texts, context, low, high, depth):
    index = SuffixIndex(capacity=1000)
    for text in texts:
        index.add(text)
    match = index.longest_match(context, low, high, depth)
    expected = brute_longest(texts, context, low, high, depth)
    assert (None if match is None else (match.length, match.continuations)) == expected


def test_the_index_keeps_the_newest_tokens_within_its_capacity():
    index = SuffixIndex(capacity=10)
    index.add([1, 2, 3, 4])
    index.add([5, 6, 7, 8])  # 9 slots: a separator between the two texts
    assert index.longest_match([9, 1, 2], 2, 8, 4).continuations == [[3, 4]]
    index.add([1, 2, 9, 9])  # 14 slots written: the first text's first four are overwritten
    assert index.size == 10
    assert index.longest_match([9, 1, 2], 2, 8, 4).continuations == [[9, 9]]
    assert index.longest_match([5, 6], 2, 8, 4).continuations == [[7, 8]]
    index.add(list(range(20, 40)))  # longer than the capacity: its last 10 tokens are kept
    assert index.size == 10 and index.longest_match([1, 2], 2, 8, 4) is None
    assert index.longest_match([30, 31], 2, 8, 4).continuations == [[32, 33, 34, 35]]
    assert index.longest_match([29, 30], 2, 8, 4) is None  # 29 was overwritten


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=6),
       context=st.lists(st.integers(0, 3), min_size=2, max_size=8), capacity=st.integers(1, 30),
       grown=st.lists(st.integers(0, 3), max_size=8), depth=st.integers(1, 4))
def test_a_full_index_matches_exactly_what_its_newest_slots_hold(texts, context, capacity, grown, depth):
    """Past its capacity the index answers as an index of the last ``capacity`` slots would: the
    texts joined by separators, the last one grown by :meth:`extend`, cut to the newest slots."""
    index = SuffixIndex(capacity)
    for text in texts:
        index.add(text)
    index.extend(grown)
    slots = []
    for text in texts[:-1]:
        slots += text + [-1]
    slots = (slots + texts[-1] + grown)[-capacity:]
    window = [[]]
    for token in slots:
        window.append([]) if token == -1 else window[-1].append(token)
    match = index.longest_match(context, 2, 6, depth)
    expected = brute_longest([text for text in window if text], context, 2, 6, depth)
    assert (None if match is None else (match.length, match.continuations)) == expected


def test_scopes_are_kept_apart_and_bounded():
    shared = SharedSuffixIndex(capacity=100, max_scopes=2)
    shared.add("a", [1, 2, 3])
    assert shared.longest_match("a", [1, 2], 2, 8, 4).continuations == [[3]]
    assert shared.longest_match("b", [1, 2], 2, 8, 4) is None
    shared.add("b", [1, 2, 4])
    shared.add("c", [5, 6, 7])  # a third scope: the least recently used one ("a") goes
    assert shared.longest_match("a", [1, 2], 2, 8, 4) is None
    assert shared.longest_match("b", [1, 2], 2, 8, 4).continuations == [[4]]
    assert shared.tokens() == 6 and shared.tokens("c") == 3


def test_the_tree_is_grown_most_probable_path_first():
    votes = [[1, 2, 3], [1, 2, 4], [1, 5], [7]]
    # 1: 3/4, then 1-2: 1/2, then 7, 1-5, 1-2-3, 1-2-4: 1/4 each (ties in the order they were found)
    assert draft_tree(votes, 10, 5, 0.1) == ([1, 2, 7, 5, 3, 4], [0, 1, 0, 1, 2, 2], [0.75, 0.5] + [0.25] * 4)
    assert draft_tree(votes, 3, 5, 0.1)[:2] == ([1, 2, 7], [0, 1, 0])
    assert draft_tree(votes, 10, 1, 0.1)[:2] == ([1, 7], [0, 0])
    assert draft_tree(votes, 10, 5, 0.5)[:2] == ([1, 2], [0, 1])
    assert draft_tree(votes, 10, 5, 0.5).expected_accepted == 1.25
    assert draft_tree([[4, 5, 6]], 10, 2, 0.1) == ([4, 5], [0, 1], [1.0, 1.0])
    assert draft_tree([], 10, 5, 0.1).tokens == [] and draft_tree(votes, 0, 5, 0.1).tokens == []


@pytest.mark.parametrize("options", [
    dict(num_draft_tokens=0), dict(min_match=0), dict(min_match=5, max_match=4), dict(spec_factor=0),
    dict(min_probability=0), dict(min_probability=1.5), dict(across_requests="yes"), dict(index_tokens=0),
    dict(scope=3),
])
def test_bad_options_are_refused(options):
    with pytest.raises(ConfigError):
        SuffixConfig(**options)


CONFIGS = [dict(), dict(num_draft_tokens=3, spec_factor=0.5), dict(min_match=3, min_probability=0.3),
           dict(across_requests=False)]


@pytest.mark.parametrize("options", CONFIGS)
@pytest.mark.parametrize("prompt_kind", ["repetitive", "random"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_equals_plain_decoding_whatever_the_index_holds(arch, prompt_kind, options):
    """Other requests fill the index first (their outputs, and texts that share this prompt's
    stretches but go on differently); the output is still plain greedy decoding's."""
    target = make_target(arch, eos=())
    prompt = repetitive_prompt(30) if prompt_kind == "repetitive" else random_prompt(30, seed=2)
    max_new_tokens = 32
    truth = reference_greedy(target.model, prompt, max_new_tokens)
    config = SuffixConfig(**options)
    for seed in (5, 6):
        specwise.generate(target, random_prompt(20, seed=seed), drafter=SuffixDrafter(target, config), max_new_tokens=24)
    if config.across_requests:
        decoys = prompt.tolist()[-6:]
        shared_index(target, config.index_tokens).add("", decoys + [(t + 1) % 50 for t in truth[:20]])
        shared_index(target, config.index_tokens).add("", decoys + truth[:3] + [(t + 7) % 50 for t in truth[3:20]])
    drafter = recording(SuffixDrafter)(target, config)
    result = specwise.generate(target, prompt, drafter=drafter, max_new_tokens=max_new_tokens)
    assert result.token_ids == truth
    check_tree_loop_records(drafter, prompt.tolist(), result.token_ids, max_new_tokens, truth)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_repeated_request_drafts_from_the_first_ones_output(arch):
    target = make_target(arch, eos=())
    prompt = random_prompt(24, seed=9)
    first = specwise.generate(target, prompt, method="suffix", max_new_tokens=40)
    again = specwise.generate(target, prompt, method="suffix", max_new_tokens=40)
    alone = specwise.generate(target, prompt, method="suffix", across_requests=False, max_new_tokens=40)
    assert again.token_ids == first.token_ids == alone.token_ids
    assert again.stats.target_forwards <= 10 < alone.stats.target_forwards


def test_one_scope_never_drafts_from_another_scopes_outputs():
    target = make_target("llama", eos=())
    prompt = random_prompt(24, seed=9)
    specwise.generate(target, prompt, method="suffix", scope="tenant-a", max_new_tokens=40)
    other = specwise.generate(target, prompt, method="suffix", scope="tenant-b", max_new_tokens=40)
    same = specwise.generate(target, prompt, method="suffix", scope="tenant-a", max_new_tokens=40)
    assert other.token_ids == same.token_ids
    assert same.stats.target_forwards < other.stats.target_forwards
    assert shared_index(target, SuffixConfig().index_tokens).tokens("tenant-b") > 0


def test_the_shared_index_stays_within_its_capacity():
    target = make_target("llama", eos=())
    for seed in range(8):
        specwise.generate(target, random_prompt(10, seed=seed), method="suffix", index_tokens=100, max_new_tokens=30)
    assert 60 <= shared_index(target, 100).tokens() <= 100


def test_sampled_sequences_follow_the_target_distribution():
    """20,000 draws of 4 tokens at T = 0.9 with an index holding texts that continue this prompt in
    several ways (so trees of several branches are drafted and some are refused)."""
    target = make_target("llama", 0, vocab_size=V, eos=())
    sampling = dict(temperature=0.9, top_k=6)
    exact = exact_joint(target.model, PROMPT, 4, **sampling)
    config = SuffixConfig(min_match=2, min_probability=0.05)
    index = shared_index(target, config.index_tokens)
    for tail in ([5, 3, 4], [6, 1, 2], [5, 7, 7], [0, 3, 4], [5, 3, 1]):
        index.add("", PROMPT[-3:] + tail)
    trees = []

    class Counting(SuffixDrafter):
        def propose(self, state, ctx):
            proposal = super().propose(state, ctx)
            trees.append(proposal.parents is not None)
            return proposal

    drafter = Counting(target, SuffixConfig(min_match=2, min_probability=0.05, across_requests=False))
    drafter.shared = index  # the filled index, left unchanged by these draws
    counts = np.zeros([V] * 4, np.int64)
    drafted = accepted = 0
    for seed in range(20_000):
        result = specwise.generate(target, PROMPT, drafter=drafter, max_new_tokens=4, seed=seed, **sampling)
        counts[tuple(result.token_ids)] += 1
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    assert 0 < accepted < drafted, "both acceptance and rejection must be exercised"
    assert sum(trees) > 1000, "trees of several branches must be drafted"
    assert_distribution(counts, exact, "suffix sequences")


def test_every_auto_generation_feeds_the_index_whichever_candidate_ran():
    target = make_target("llama", eos=())
    auto = specwise.build_drafter(target, "auto", candidates="pld,suffix", remember=False)
    result = specwise.generate(target, random_prompt(12, seed=3), drafter=auto, max_new_tokens=20)
    held = shared_index(target, SuffixConfig().index_tokens)
    assert held.tokens() == min(12, SuffixConfig().max_match) + 20
    assert held.longest_match("", result.token_ids[:6], 2, 32, 4).continuations[0] == result.token_ids[6:10]


def test_the_tree_more_likely_accepted_is_drafted_then_the_longer_matchs():
    """This context's match votes one chain; the index's votes are split or unanimous: the tree
    whose path probabilities sum higher is proposed, on a tie the longer match's."""
    import torch

    from specwise.engine.sampling import SamplingConfig
    from specwise.engine.types import DraftContext

    target = make_target("llama", eos=())
    drafter = SuffixDrafter(target, SuffixConfig(num_draft_tokens=4))
    context = torch.tensor([7, 8, 9, 20, 21, 1, 2, 30, 31, 1, 2])  # (1, 2) recurs once here, followed by 30 31

    def proposed():
        state = drafter.start(DraftContext(context, 0, SamplingConfig(), None, len(context) - 1))
        proposal = drafter.propose(state, DraftContext(context, 4, SamplingConfig(), None, len(context) - 1))
        return proposal.tokens.tolist(), proposal.parents

    assert proposed() == ([30, 31, 1, 2], None)  # only this context: its chain
    drafter.shared.add("", [9, 1, 2, 40, 41])
    drafter.shared.add("", [8, 1, 2, 42, 43])
    assert proposed() == ([30, 31, 1, 2], None)  # the index's votes are split: this context's wins
    for _ in range(3):
        drafter.shared.add("", [31, 1, 2, 44, 45, 46, 47])
    assert proposed() == ([44, 45, 46, 47], None)  # as likely, from a longer match: the index's
