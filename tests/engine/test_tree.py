"""Tree verification (docs/algorithms.md §2): tree buffers and masks, the tree forward, KV compaction,
greedy tree acceptance through the loop, and the statistics of recursive rejection sampling.

Layers, bottom up:

1. ``DraftTree`` and ``additive_attention_mask`` against naive recursive / looped references, on
   random trees (hypothesis).
2. ``Target.forward`` with a tree layout after a cached prefix: each node's logits equal a fresh,
   cache-free forward over prefix + root + the node's path. The Gemma-3 tiny model slides a window of
   8 over a 30-token prefix, so the windowed mask of its sliding layer matters (and is shown to).
   Exact comparisons (1e-10) use sdpa attention: eager attention takes its softmax in float32, which
   bounds agreement between differently shaped forwards to ~1e-6 (checked at 1e-5).
3. ``KVCache.commit_path`` against a fresh prefill of the committed tokens, key by key.
4. The loop with tree proposals of several shapes, the right token often a non-first sibling,
   equals plain greedy decoding token for token (also with auxiliary tokens riding along, and with
   a repetition penalty), with the accepted nodes and the cache length checked at every step.
5. ``tree_speculative_sample`` on synthetic distributions (V = 6, 20,000 draws), for the three
   sibling rules: the first two emitted tokens follow the target's chain rule. And an end-to-end run
   with a sampled tree drafter over an 8-token model.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specwise
import specwise.targets.hf
from conftest import (
    ARCHS,
    TREE_SHAPES,
    VOCAB,
    RandomTreeDrafter,
    SampledTreeDrafter,
    TreeOracleDrafter,
    assert_distribution,
    assert_rate,
    block_chain_auxiliary,
    check_stats,
    check_tree_loop_records,
    greedy_continuation,
    make_target,
    random_prompt,
    recording,
    repetitive_prompt,
)
from specwise.engine.target import AttentionLayout
from specwise.engine.tree import DraftTree, additive_attention_mask, best_nodes_tree
from specwise.engine.types import AuxiliaryTokens
from specwise.engine.verify import SIBLING_RULES, greedy_tree_accept, tree_speculative_sample
from test_sampling_e2e import PROMPT as SMALL_PROMPT
from test_sampling_e2e import V as SMALL_V
from test_sampling_e2e import exact_joint

# ------------------------------------------------------------------------------------------
# 1. tree buffers and masks against naive references


def parents_strategy(max_drafts: int = 24):
    """Draft-node parents of a random tree: draft i (node i + 1) has a parent in ``0 .. i``."""
    return st.integers(0, max_drafts).flatmap(lambda k: st.tuples(*[st.integers(0, i) for i in range(k)]))


def naive_tree(parents: list[int]) -> tuple[list[set[int]], list[int], list[list[int]]]:
    """(ancestors-or-self, depth, children in order) of every node, by recursion on ``parent``."""
    full = [-1] + list(parents)

    def ancestors(i: int) -> set[int]:
        return {i} if i == 0 else {i} | ancestors(full[i])

    def depth(i: int) -> int:
        return 0 if i == 0 else 1 + depth(full[i])

    n = len(full)
    return ([ancestors(i) for i in range(n)], [depth(i) for i in range(n)],
            [[j for j in range(1, n) if full[j] == i] for i in range(n)])


def naive_mask(prefix_length: int, visible: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
               window: int | None) -> torch.Tensor:
    """``[1, 1, n, T + n]`` by a loop over (query, key): 0 if allowed, ``finfo(dtype).min`` if not."""
    n = positions.numel()
    blocked = torch.finfo(dtype).min
    mask = torch.empty(1, 1, n, prefix_length + n, dtype=dtype)
    for q in range(n):
        for k in range(prefix_length + n):
            key_position = k if k < prefix_length else int(positions[k - prefix_length])
            allowed = k < prefix_length or bool(visible[q, k - prefix_length])
            if window is not None and not key_position > int(positions[q]) - window:
                allowed = False
            mask[0, 0, q, k] = 0.0 if allowed else blocked
    return mask


@settings(max_examples=60, deadline=None)
@given(parents_strategy(), st.integers(3, 127))
def test_draft_tree_matches_naive_recursion(parents, root):
    drafts = torch.randint(0, VOCAB, (len(parents),), generator=torch.Generator().manual_seed(len(parents)))
    tree = DraftTree.build(root, drafts, torch.tensor(parents, dtype=torch.long))
    ancestors, depth, children = naive_tree(list(parents))
    n = len(parents) + 1
    assert tree.size == n
    assert tree.tokens.tolist() == [root] + drafts.tolist()
    assert tree.parents.tolist() == [-1] + list(parents)
    assert tree.depth.tolist() == depth
    assert tree.ancestors.dtype == torch.bool and tree.ancestors.shape == (n, n)
    assert [set(row.nonzero().flatten().tolist()) for row in tree.ancestors] == ancestors
    assert [list(c) for c in tree.children] == children
    assert tree.kept.tolist() == list(range(n))
    for node in range(n):
        assert tree.path_to(node) == sorted(ancestors[node] - {0})  # topological: ancestors come first


def test_draft_tree_chain_and_bad_parents():
    drafts = torch.tensor([5, 6, 7])
    chain = DraftTree.build(4, drafts, None)
    assert chain.parents.tolist() == [-1, 0, 1, 2]
    assert chain.depth.tolist() == [0, 1, 2, 3]
    assert torch.equal(chain.ancestors, torch.ones(4, 4, dtype=torch.bool).tril())
    assert chain.children == ((1,), (2,), (3,), ())
    for bad in ([0, 2, 1], [0, 0, 3], [-1, 0, 1], [1, 0, 0]):
        with pytest.raises(ValueError, match="parent"):
            DraftTree.build(4, drafts, torch.tensor(bad))


@settings(max_examples=60, deadline=None)
@given(parents_strategy(), st.integers(0, 8))
def test_pruned_keeps_exactly_the_shallow_nodes(parents, max_depth):
    drafts = torch.arange(len(parents)) + 10
    tree = DraftTree.build(3, drafts, torch.tensor(parents, dtype=torch.long))
    _, depth, _ = naive_tree(list(parents))
    pruned = tree.pruned(max_depth)
    kept = [i for i, d in enumerate(depth) if d <= max_depth]
    if len(kept) == tree.size:
        assert pruned is tree
    assert pruned.kept.tolist() == kept
    assert pruned.tokens.tolist() == [tree.tokens.tolist()[i] for i in kept]
    full = [-1] + list(parents)
    assert pruned.parents.tolist() == [-1] + [kept.index(full[i]) for i in kept[1:]]
    assert pruned.depth.tolist() == [depth[i] for i in kept]
    index = torch.tensor(kept)
    assert torch.equal(pruned.ancestors, tree.ancestors[index][:, index])
    for new, old in enumerate(kept):  # same path, renumbered
        assert [kept[j] for j in pruned.path_to(new)] == tree.path_to(old)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1, 4, 8, 40])
@pytest.mark.parametrize("prefix_length", [0, 1, 12, 30])
def test_additive_mask_matches_naive_loop_on_trees(prefix_length, window, dtype):
    g = torch.Generator().manual_seed(prefix_length * 100 + (window or 0))
    parents = [int(torch.randint(0, i + 1, (), generator=g)) for i in range(14)]
    tree = DraftTree.build(3, torch.arange(14), torch.tensor(parents))
    positions = prefix_length + tree.depth
    mask = additive_attention_mask(prefix_length, tree.ancestors, positions, dtype, window)
    n = tree.size
    assert mask.shape == (1, 1, n, prefix_length + n)
    assert mask.dtype == dtype
    assert torch.equal(mask, naive_mask(prefix_length, tree.ancestors, positions, dtype, window))
    assert set(mask.unique().tolist()) <= {0.0, torch.finfo(dtype).min}
    if window is None:
        assert (mask[..., :prefix_length] == 0).all(), "the cached prefix is visible to every node"
        assert torch.equal(mask[0, 0, :, prefix_length:] == 0, tree.ancestors)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 10), st.integers(0, 20), st.one_of(st.none(), st.integers(1, 12)), st.data())
def test_additive_mask_matches_naive_loop_on_any_layout(n, prefix_length, window, data):
    """Arbitrary visibility and positions (auxiliary tokens sit at any offset after the root)."""
    visible = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=n, max_size=n)))
    visible |= torch.eye(n, dtype=torch.bool)
    positions = torch.tensor(data.draw(st.lists(st.integers(prefix_length, prefix_length + 12), min_size=n, max_size=n)))
    mask = additive_attention_mask(prefix_length, visible, positions, torch.float64, window)
    assert torch.equal(mask, naive_mask(prefix_length, visible, positions, torch.float64, window))


def test_greedy_tree_accept_by_hand():
    # root 0 -> (1: 5, 2: 6, 3: 6); 2 -> (4: 7); 3 -> (5: 8); 4 -> (6: 9)
    children = ((1, 2, 3), (), (4,), (5,), (6,), (), ())
    tokens = [0, 5, 6, 6, 7, 8, 9]
    assert greedy_tree_accept(children, tokens, [6, 0, 7, 8, 9, 0, 2]) == ([2, 4, 6], 2)
    assert greedy_tree_accept(children, tokens, [6, 0, 3, 8, 9, 0, 2]) == ([2], 3)  # the first 6 wins
    assert greedy_tree_accept(children, tokens, [4, 0, 7, 8, 9, 0, 2]) == ([], 4)
    assert greedy_tree_accept(((),), [0], [11]) == ([], 11)


# ------------------------------------------------------------------------------------------
# 2. the tree forward after a cached prefix

# a 13-draft tree with non-first branches; depth 7 (> the window) along one path
FORWARD_PARENTS = [0, 0, 1, 1, 0, 2, 5, 3, 3, 6, 9, 10, 11]
TOLERANCES = {"sdpa": 1e-10, "eager": 1e-5}


def fresh_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Last-position logits of a cache-free forward over ``ids``."""
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0, -1]


def _tree_forward(target, prefix: torch.Tensor, tree: DraftTree, **kwargs):
    cache = target.new_cache()
    target.forward(prefix, cache)
    start = cache.length
    out = target.forward(tree.tokens, cache, layout=AttentionLayout(tree.ancestors, start + tree.depth), **kwargs)
    return cache, out


def _example_tree(seed: int = 0, parents=FORWARD_PARENTS) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    drafts = torch.randint(3, VOCAB, (len(parents),), generator=g)
    return DraftTree.build(int(torch.randint(3, VOCAB, (), generator=g)), drafts, torch.tensor(parents))


def _node_errors(target, prefix, tree, logits) -> list[float]:
    return [float((logits[i] - fresh_logits(target.model, torch.cat([prefix, tree.tokens[[0] + tree.path_to(i)]])))
                  .abs().max()) for i in range(tree.size)]


@pytest.mark.parametrize("attn", list(TOLERANCES))
@pytest.mark.parametrize("prefix_length", [30, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_forward_matches_fresh_forward_per_node(arch, prefix_length, attn):
    target = make_target(arch, attn_implementation=attn)
    prefix = random_prompt(prefix_length, seed=11)
    tree = _example_tree()
    cache, out = _tree_forward(target, prefix, tree, logit_rows=torch.arange(tree.size), hidden_layers=(1, 2))
    assert out.logits.shape == (tree.size, VOCAB)
    assert cache.length == prefix_length + tree.size
    assert max(_node_errors(target, prefix, tree, out.logits)) < TOLERANCES[attn]
    for i in range(tree.size):  # hidden states too
        ids = torch.cat([prefix, tree.tokens[[0] + tree.path_to(i)]])
        with torch.no_grad():
            reference = target.model(input_ids=ids[None], output_hidden_states=True).hidden_states
        for layer in (1, 2):
            assert float((out.hidden_states[layer][i] - reference[layer][0, -1]).abs().max()) < TOLERANCES[attn]


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_forward_logit_rows_pick_rows(arch):
    target = make_target(arch, attn_implementation="sdpa")
    prefix, tree = random_prompt(30, seed=12), _example_tree(1)
    _, full = _tree_forward(target, prefix, tree, logit_rows=torch.arange(tree.size))
    rows = torch.tensor([7, 0, 13, 4])
    _, picked = _tree_forward(target, prefix, tree, logit_rows=rows)
    assert picked.logits.shape == (4, VOCAB)
    assert float((picked.logits - full.logits[rows]).abs().max()) < 1e-10


def test_tree_forward_is_sensitive_to_the_window_and_the_tree_mask(monkeypatch):
    """The per-node check above has power: a sliding layer without its window, or a causal (chain)
    mask in place of the tree mask, gives logits far from the fresh forwards."""
    target = make_target("gemma3", attn_implementation="sdpa")
    prefix, tree = random_prompt(30, seed=11), _example_tree()
    _, out = _tree_forward(target, prefix, tree, logit_rows=torch.arange(tree.size))
    assert max(_node_errors(target, prefix, tree, out.logits)) < 1e-10

    cache = target.new_cache()
    target.forward(prefix, cache)
    chain = AttentionLayout(torch.ones(tree.size, tree.size, dtype=torch.bool).tril(), 30 + tree.depth)
    causal = target.forward(tree.tokens, cache, logit_rows=torch.arange(tree.size), layout=chain)
    assert max(_node_errors(target, prefix, tree, causal.logits)) > 1e-2

    original = specwise.targets.hf.additive_attention_mask
    monkeypatch.setattr(specwise.targets.hf, "additive_attention_mask",
                        lambda t, visible, positions, dtype, window=None: original(t, visible, positions, dtype, None))
    _, unwindowed = _tree_forward(target, prefix, tree, logit_rows=torch.arange(tree.size))
    errors = _node_errors(target, prefix, tree, unwindowed.logits)
    assert min(errors) > 1e-2, "the window hides most of the 30-token prefix from every node"


# ------------------------------------------------------------------------------------------
# 3. KV compaction

# nodes 1-3 a chain; 4 the root's second child with children 5 and 8; 6 a second child of 1
COMPACT_PARENTS = [0, 1, 2, 0, 4, 1, 6, 4]
COMPACT_PATHS = {
    "root-only": [],
    "chain-prefix": [1, 2],
    "full-chain": [1, 2, 3],
    "second-branch": [4, 8],  # non-first siblings at depths 1 and 2
    "first-then-second": [1, 6, 7],
}


def _aux_layout(tree: DraftTree, aux: AuxiliaryTokens) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, visibility and root offsets of a tree followed by auxiliary tokens (as the loop lays them out)."""
    n, a = tree.size, aux.tokens.numel()
    visible = torch.zeros(n + a, n + a, dtype=torch.bool)
    visible[:n, :n] = tree.ancestors
    visible[n:, 0] = True
    visible[n:, n:] = aux.visible
    return torch.cat([tree.tokens, aux.tokens]), visible, torch.cat([tree.depth, aux.positions])


@pytest.mark.parametrize("with_aux", [False, True], ids=["tree", "tree+aux"])
@pytest.mark.parametrize("path_name", list(COMPACT_PATHS))
@pytest.mark.parametrize("prefix_length", [30, 250])  # 250: the preallocated buffers (256) grow mid-forward
@pytest.mark.parametrize("arch", ARCHS)
def test_commit_path_equals_fresh_prefill(arch, prefix_length, path_name, with_aux):
    target = make_target(arch, attn_implementation="sdpa")
    prefix = random_prompt(prefix_length, seed=13)
    tree = _example_tree(2, COMPACT_PARENTS)
    cache = target.new_cache()
    target.forward(prefix, cache)
    start = cache.length
    tokens, visible, offsets = tree.tokens, tree.ancestors, tree.depth
    if with_aux:
        aux = block_chain_auxiliary((3, 2), [0])(None, torch.Generator().manual_seed(0))
        tokens, visible, offsets = _aux_layout(tree, aux)
    target.forward(tokens, cache, layout=AttentionLayout(visible, start + offsets))
    assert cache.length == start + tokens.numel()

    path = COMPACT_PATHS[path_name]
    cache.commit_path(start, [0] + path)
    committed = torch.cat([prefix, tree.tokens[[0] + path]])
    assert cache.length == committed.numel() == start + 1 + len(path)
    fresh = target.new_cache()
    target.forward(committed, fresh)
    assert len(cache.hf_cache.layers) == len(fresh.hf_cache.layers) == 2
    for mine, theirs in zip(cache.hf_cache.layers, fresh.hf_cache.layers):
        assert mine.keys.shape == theirs.keys.shape
        assert float((mine.keys - theirs.keys).abs().max()) < 1e-10
        assert float((mine.values - theirs.values).abs().max()) < 1e-10

    # the compacted cache decodes on: one plain step, then a tree step
    step = torch.tensor([17])
    logits = target.forward(step, cache).logits[-1]
    assert float((logits - fresh_logits(target.model, torch.cat([committed, step]))).abs().max()) < 1e-10
    committed = torch.cat([committed, step])
    second = _example_tree(3)
    out = target.forward(second.tokens, cache, logit_rows=torch.arange(second.size),
                         layout=AttentionLayout(second.ancestors, committed.numel() + second.depth))
    assert max(_node_errors(target, committed, second, out.logits)) < 1e-10


# ------------------------------------------------------------------------------------------
# 4. greedy decoding through the loop with tree proposals

NEW = 30
PROMPTS = {
    "long": random_prompt(30, seed=1),  # ~4x the sliding window
    "short": random_prompt(5, seed=2),  # crosses the window while generating
    "repetitive": repetitive_prompt(30, period=5, seed=3),
}


def _run_tree(arch: str, prompt_name: str, make_drafter, max_new_tokens: int = NEW, repetition_penalty: float = 1.0,
              **target_options):
    """Generate greedily with a recording tree drafter; check output and per-step records.

    ``make_drafter(prompt, continuation)`` builds the (recording) drafter. Returns (drafter, result).
    """
    prompt = PROMPTS[prompt_name]
    target = make_target(arch, eos=(), **target_options)
    truth = greedy_continuation(arch, 0, tuple(prompt.tolist()), max_new_tokens, repetition_penalty=repetition_penalty)
    drafter = make_drafter(prompt, truth)
    result = specwise.generate(target, prompt, drafter=drafter, max_new_tokens=max_new_tokens,
                               repetition_penalty=repetition_penalty)
    assert result.token_ids == list(truth)
    assert result.stop_reason == "length"
    check_tree_loop_records(drafter, prompt.tolist(), result.token_ids, max_new_tokens, truth)
    check_stats(result.stats, drafter, result.token_ids)
    return drafter, result


def _accepted_non_first_sibling(drafter) -> bool:
    """Whether some accepted node was not its parent's first child."""
    for proposal, step in zip(drafter.proposals, drafter.steps):
        parents = proposal.proposal.parents.tolist()
        for j in step.accepted_nodes:
            if parents.index(parents[j]) != j:
                return True
    return False


@pytest.mark.parametrize("shape", list(TREE_SHAPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_shapes_match_reference(arch, shape):
    drafter, result = _run_tree(arch, "long", lambda prompt, truth: recording(TreeOracleDrafter)(
        truth, len(prompt), TREE_SHAPES[shape], seed=1))
    assert result.stats.accepted_tokens > 0
    if shape in ("wide", "non-first"):
        assert _accepted_non_first_sibling(drafter)
    if shape == "duplicate":  # the first of two equal siblings is taken, its junk child stops the walk
        assert all(step.num_accepted <= 1 for step in drafter.steps)


@pytest.mark.parametrize("mismatch_at", [(2, 9, 17, 25), tuple(range(1, NEW, 3))], ids=["sparse", "every-third"])
@pytest.mark.parametrize("shape", ["deep", "non-first"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_shapes_with_mismatches(arch, shape, mismatch_at):
    _run_tree(arch, "long", lambda prompt, truth: recording(TreeOracleDrafter)(
        truth, len(prompt), TREE_SHAPES[shape], mismatch_at=mismatch_at, seed=2))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("prompt_name", ["long", "short"])
@pytest.mark.parametrize("arch", ARCHS)
def test_random_trees_match_reference(arch, prompt_name, seed):
    drafter, result = _run_tree(arch, prompt_name, lambda prompt, truth: recording(RandomTreeDrafter)(
        truth, len(prompt), max_nodes=14, seed=seed))
    assert result.stats.accepted_tokens > 0


def test_tree_deeper_than_the_budget_is_pruned():
    """Near ``max_new_tokens`` the budget cuts the 8-deep tree: the loop verifies only the nodes within it."""
    drafter, _ = _run_tree("llama", "long", lambda prompt, truth: recording(TreeOracleDrafter)(
        truth, len(prompt), TREE_SHAPES["deep"]), max_new_tokens=12)
    assert any(proposal.max_draft_tokens < 8 for proposal in drafter.proposals)
    assert any(step.num_drafted < len(TREE_SHAPES["deep"]) for step in drafter.steps)


def _aux_references(target, proposal_log, logits: torch.Tensor) -> list[float]:
    """Per requested auxiliary row: max |aux logits - fresh forward over context + its chain|."""
    aux = proposal_log.proposal.auxiliary
    context = torch.tensor(proposal_log.token_ids)  # committed tokens, the root last
    errors = []
    for row, j in enumerate(aux.logit_rows.tolist()):
        chain = sorted(aux.visible[j].nonzero().flatten().tolist(), key=lambda k: int(aux.positions[k]))
        assert [int(aux.positions[k]) for k in chain] == list(range(1, len(chain) + 1))
        expected = fresh_logits(target.model, torch.cat([context, aux.tokens[chain]]))
        errors.append(float((logits[row] - expected).abs().max()))
    return errors


@pytest.mark.parametrize("attn", list(TOLERANCES))
@pytest.mark.parametrize("arch", ARCHS)
def test_auxiliary_tokens_ride_along(arch, attn):
    """Junk auxiliary chains in the verification forward change nothing; their logits come back."""
    rows = [0, 2, 3, 5, 6]
    make_aux = block_chain_auxiliary((3, 2, 1, 4), rows)
    drafter, _ = _run_tree(arch, "long", lambda prompt, truth: recording(TreeOracleDrafter)(
        truth, len(prompt), TREE_SHAPES["non-first"], seed=3, auxiliary=make_aux), attn_implementation=attn)
    target = make_target(arch, attn_implementation=attn)
    assert _accepted_non_first_sibling(drafter)
    for proposal, step in zip(drafter.proposals, drafter.steps):
        assert step.aux_logits is not None and step.aux_logits.shape == (len(rows), VOCAB)
        assert max(_aux_references(target, proposal, step.aux_logits)) < TOLERANCES[attn]


def _scattered_auxiliary(ctx, generator) -> AuxiliaryTokens:
    """Auxiliary tokens at arbitrary offsets with a random (self-including) visibility pattern."""
    a = 7
    visible = (torch.rand(a, a, generator=generator) < 0.4) | torch.eye(a, dtype=torch.bool)
    return AuxiliaryTokens(torch.randint(3, VOCAB, (a,), generator=generator),
                           torch.randint(1, 12, (a,), generator=generator), visible, torch.tensor([6, 1]))


@pytest.mark.parametrize("arch", ARCHS)
def test_scattered_auxiliary_tokens_do_not_change_the_output(arch):
    drafter, _ = _run_tree(arch, "short", lambda prompt, truth: recording(RandomTreeDrafter)(
        truth, len(prompt), max_nodes=10, seed=5, auxiliary=_scattered_auxiliary))
    assert all(step.aux_logits.shape == (2, VOCAB) for step in drafter.steps)


@pytest.mark.parametrize("arch", ARCHS)
def test_auxiliary_tokens_with_a_chain_proposal(arch):
    """A proposal without parents but with auxiliary tokens goes through the tree path as a chain."""
    drafter, _ = _run_tree(arch, "long", lambda prompt, truth: recording(TreeOracleDrafter)(
        truth, len(prompt), TREE_SHAPES["chain"], mismatch_at=(4, 11), auxiliary=block_chain_auxiliary((2,), [1])),
        attn_implementation="sdpa")
    target = make_target(arch, attn_implementation="sdpa")
    for proposal, step in zip(drafter.proposals, drafter.steps):
        assert max(_aux_references(target, proposal, step.aux_logits)) < 1e-10


# 6. repetition penalty: each node is penalised by its own path, not by its siblings' tokens


class FutureJunkDrafter(TreeOracleDrafter):
    """The wrong children of the root carry the token the target wants one level *deeper* (the bonus
    token after the right child): a verifier that penalised a node for its siblings' tokens, not just
    its ancestors', would push that token down."""

    def propose(self, state, ctx):
        proposal = super().propose(state, ctx)
        start = ctx.token_ids.numel() - self.prompt_length
        if start + 1 >= len(self.continuation) or self.continuation[start + 1] == self.continuation[start]:
            return proposal
        tokens = proposal.tokens.clone()
        for i, (parent, truthful) in enumerate(self.template):
            if parent == 0 and not truthful:
                tokens[i] = self.continuation[start + 1]
        return dataclasses.replace(proposal, tokens=tokens)


@pytest.mark.parametrize("drafter_name", ["non-first", "deep", "random", "future-junk"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tree_with_repetition_penalty(arch, drafter_name):
    def make(prompt, truth):
        if drafter_name == "random":
            return recording(RandomTreeDrafter)(truth, len(prompt), max_nodes=14, seed=6)
        if drafter_name == "future-junk":
            return recording(FutureJunkDrafter)(truth, len(prompt), TREE_SHAPES["wide"], seed=6)
        return recording(TreeOracleDrafter)(truth, len(prompt), TREE_SHAPES[drafter_name], seed=6)

    drafter, result = _run_tree(arch, "repetitive", make, repetition_penalty=1.5)
    assert result.stats.accepted_tokens > 0
    unpenalised = greedy_continuation(arch, 0, tuple(PROMPTS["repetitive"].tolist()), NEW)
    assert result.token_ids != list(unpenalised), "the penalty must change the output for the test to mean anything"


# ------------------------------------------------------------------------------------------
# 5. statistics of tree_speculative_sample

V = 6
N = 20_000
BONUS = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25], dtype=torch.float64)
# root -> nodes 1, 2, 3; node 2 -> nodes 4, 5 (the subtree hangs under a non-first child)
STAT_CHILDREN = ((1, 2, 3), (), (4, 5), (), (), ())


def _distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[V]`` first-token distribution and ``[V, V]`` conditionals, with some zeros (3+ tokens kept per row)."""
    g = torch.Generator().manual_seed(seed)
    first = torch.softmax(1.2 * torch.randn(V, generator=g, dtype=torch.float64), -1)
    second = torch.softmax(1.5 * torch.randn(V, V, generator=g, dtype=torch.float64), -1)
    first[int(torch.randint(0, V, (), generator=g))] = 0.0
    for row in second:
        row[torch.randperm(V, generator=g)[:2]] = 0.0
    return first / first.sum(), second / second.sum(-1, keepdim=True)


def _draw_children(q: torch.Tensor, count: int, rule: str, g: torch.Generator) -> list[int]:
    if rule == "delta":  # deterministic distinct candidates: q's most likely tokens
        return torch.argsort(q, descending=True, stable=True)[:count].tolist()
    return torch.multinomial(q, count, replacement=rule == "iid", generator=g).tolist()


def _sample_two_tokens(rule: str, p1, p2, q1, q2, n: int, seed: int = 0, sibling_rule: str | None = None):
    """``n`` times: draft the statistics tree, verify it, and return the first two emitted tokens.

    When the root's children are all rejected only one token is emitted; the second then comes from
    the next step, a one-level tree of two children drawn at the emitted token (as the loop would do).
    Returns (counts ``[V, V]``, accepted first-level node per draw or 0).
    """
    verify_rule = sibling_rule or rule
    g = torch.Generator().manual_seed(seed)
    draft_g = torch.Generator().manual_seed(seed + 1)
    counts = np.zeros((V, V), np.int64)
    first_nodes = np.zeros(n, np.int64)
    for draw in range(n):
        x = _draw_children(q1, 3, rule, draft_g)
        z = _draw_children(q2[x[1]], 2, rule, draft_g)
        tokens = [0] + x + z
        target_probs = torch.stack([p1, p2[x[0]], p2[x[1]], p2[x[2]], BONUS, BONUS])
        draft_probs = None if rule == "delta" else torch.stack([q1, q1, q1, q1, q2[x[1]], q2[x[1]]])
        path, next_token = tree_speculative_sample(STAT_CHILDREN, tokens, target_probs, draft_probs, verify_rule, g)
        if not path:
            y1 = next_token
            w = _draw_children(q2[y1], 2, rule, draft_g)
            draft_probs = None if rule == "delta" else torch.stack([q2[y1], q2[y1], q2[y1]])
            path2, next2 = tree_speculative_sample(((1, 2), (), ()), [y1] + w, torch.stack([p2[y1], BONUS, BONUS]),
                                                   draft_probs, verify_rule, g)
            y2 = w[path2[0] - 1] if path2 else next2
        else:
            first_nodes[draw] = path[0]
            y1 = tokens[path[0]]
            y2 = tokens[path[1]] if len(path) > 1 else next_token
        counts[y1, y2] += 1
    return counts, first_nodes


@pytest.mark.parametrize("rule", SIBLING_RULES)
def test_tree_speculative_sample_follows_the_target(rule):
    p1, p2 = _distributions(3)
    q1, q2 = _distributions(5)  # q1's top 3 all have p1 > 0: the delta rule visits every subtree
    counts, first_nodes = _sample_two_tokens(rule, p1, p2, q1, q2, N)
    exact = p1[:, None] * p2
    assert_distribution(counts.sum(1), p1, f"{rule}: first emitted token")
    assert_distribution(counts, exact, f"{rule}: (first, second) emitted tokens")
    if rule == "delta":  # deterministic distinct children: child k is accepted with probability p(x_k)
        x = _draw_children(q1, 3, rule, None)
        for k in range(3):
            assert_rate(int((first_nodes == k + 1).sum()), N, float(p1[x[k]]), f"child {k + 1} accepted")
    else:  # the first child is a plain one-draft speculative sampling test
        assert_rate(int((first_nodes == 1).sum()), N, float(torch.minimum(p1, q1).sum()), "first child accepted")
    assert (first_nodes == 2).sum() > 0 and (first_nodes == 3).sum() > 0, "later siblings must be accepted too"


def test_statistical_check_detects_a_wrong_sibling_rule():
    """Power check: siblings drawn without replacement but verified with the i.i.d. rule (q not
    restricted to the undrawn tokens) is lossy, and the same test must fail."""
    p1, p2 = _distributions(3)
    q1, q2 = _distributions(5)  # q1's top 3 all have p1 > 0: the delta rule visits every subtree
    counts, _ = _sample_two_tokens("without_replacement", p1, p2, q1, q2, N, sibling_rule="iid")
    with pytest.raises(AssertionError, match="not distributed as expected"):
        assert_distribution(counts, p1[:, None] * p2, "wrong sibling rule")


# ------------------------------------------------------------------------------------------
# 5b. end to end: a sampled tree drafter reproduces the target's distribution

E2E_SEEDS = 1200
E2E_PARENTS = [0, 0, 0, 2, 2]  # the 2-level tree of the statistics above


def _level_probs() -> torch.Tensor:
    g = torch.Generator().manual_seed(9)
    return torch.softmax(torch.randn(2, SMALL_V, generator=g, dtype=torch.float64), -1)


def _sampled_tree_counts(rule: str, seeds: int, sampling: dict) -> tuple[np.ndarray, int, int]:
    target = make_target("llama", 0, vocab_size=SMALL_V, eos=())
    drafter = SampledTreeDrafter(E2E_PARENTS, _level_probs(), rule, seed=1)
    counts = np.zeros([SMALL_V] * 3, np.int64)
    drafted = accepted = 0
    for seed in range(seeds):
        result = specwise.generate(target, SMALL_PROMPT, drafter=drafter, max_new_tokens=4, seed=seed, **sampling)
        assert len(result.token_ids) == 4
        counts[tuple(result.token_ids[:3])] += 1
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    return counts, drafted, accepted


@pytest.mark.parametrize("rule, sampling", [
    ("iid", dict(temperature=0.8)),
    ("without_replacement", dict(temperature=0.8)),
    ("delta", dict(temperature=0.8, repetition_penalty=1.3)),
], ids=["iid", "without-replacement", "delta-penalty"])
def test_sampled_tree_sequences_follow_the_target_distribution(rule, sampling):
    """x1 is the prefill's sample, x2 and x3 come from the first tree step (depth 2 fits the budget)."""
    target = make_target("llama", 0, vocab_size=SMALL_V, eos=())
    exact = exact_joint(target.model, SMALL_PROMPT, 3, **sampling)
    counts, drafted, accepted = _sampled_tree_counts(rule, E2E_SEEDS, sampling)
    assert 0 < accepted < drafted, "both acceptance and rejection must be exercised"
    assert_distribution(counts.sum(0), exact.sum(0), f"{rule}: (x2, x3) from the tree step")
    assert_distribution(counts, exact, f"{rule}: sequences")


def test_end_to_end_check_detects_a_lossy_tree_verifier(monkeypatch):
    """Power check: accepting the first child at every level (a lossy rule) fails the same test."""

    def first_children(children, tokens, probs, draft_probs, rule, generator):
        path, node = [], 0
        while children[node]:
            node = children[node][0]
            path.append(node)
        return path, int(torch.multinomial(probs[node], 1, generator=generator))

    monkeypatch.setattr("specwise.engine.acceptance.tree_speculative_sample", first_children)
    sampling = dict(temperature=0.8)
    target = make_target("llama", 0, vocab_size=SMALL_V, eos=())
    counts, _, _ = _sampled_tree_counts("iid", E2E_SEEDS // 5, sampling)
    with pytest.raises(AssertionError, match="not distributed as expected"):
        assert_distribution(counts, exact_joint(target.model, SMALL_PROMPT, 3, **sampling), "lossy tree verifier")


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 30), st.sampled_from([None, -0.5, -1.0, -2.5]))
def test_best_nodes_tree_keeps_the_best_scores_and_their_ancestors(seed, keep, min_score):
    """Random candidate forests with cumulative scores (ties included): the kept nodes are the
    ``keep`` best by score (ties to the earlier-created) among those scoring at least ``min_score``,
    every kept node's parent is kept, and the returned parents index the kept nodes."""
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 25))
    parent, score = [], []
    for i in range(count):
        p = int(rng.integers(-1, i)) if i else -1
        step = -float(rng.choice([0.0, 0.5, 1.0, rng.random()]))  # zero steps make ties
        parent.append(p)
        score.append((score[p] if p >= 0 else 0.0) + step)
    if min_score is None:
        chosen, parents = best_nodes_tree(torch.tensor(score), torch.tensor(parent), keep)
        eligible = range(count)
    else:
        chosen, parents = best_nodes_tree(torch.tensor(score), torch.tensor(parent), keep, min_score)
        eligible = [i for i in range(count) if score[i] >= min_score]
    expect = sorted(eligible, key=lambda i: (-score[i], i))[:keep]
    assert chosen.tolist() == sorted(expect)
    kept = chosen.tolist()
    for node, (index, p) in enumerate(zip(kept, parents.tolist()), start=1):
        assert p < node
        assert (p == 0) == (parent[index] == -1)
        if p:
            assert kept[p - 1] == parent[index]
