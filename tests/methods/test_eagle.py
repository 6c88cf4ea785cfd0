"""EAGLE-3 head with EAGLE-2 dynamic trees, on tiny random float64 models.

The head's building blocks (projection, attention, MLP) are trusted; what is tested is everything
built from them: which entries each query sees, at which rotary positions, with which features, in
the dynamic tree, in the cache after partial acceptance and in the training-time-test unroll. The
references recompute each output from scratch along one explicit path.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import specwise
from conftest import ARCHS, Started, keeping, make_target, random_prompt, reference_greedy
from specwise.api import load_drafter
from specwise.drafters.checkpoint import DrafterCheckpoint, save_checkpoint, target_fingerprint
from specwise.engine.loop import speculative_generate
from specwise.engine.sampling import SamplingConfig
from specwise.engine.types import DraftContext
from specwise.errors import ConfigError, DrafterError
from specwise.methods.eagle.drafter import EagleDrafter, EagleDrafterConfig, load_eagle_head
from specwise.methods.eagle.network import EagleConfig, EagleHead
from specwise.models.common import default_feature_layers

LAYERS = (0, 1, 2)
VOCAB_D = 96


def make_head(target, seed: int = 0, window: int = 64, vocab: torch.Tensor | None = None) -> EagleHead:
    """A random head (residual branches not zero, so every part matters), float64."""
    torch.manual_seed(seed)
    vocab = torch.randperm(target.vocab_size)[:VOCAB_D] if vocab is None else vocab
    config = EagleConfig(feature_layers=LAYERS, draft_vocab_size=vocab.numel(), num_heads=2, head_dim=16,
                         intermediate_size=64, window=window)
    head = EagleHead(target, config, vocab).double()
    with torch.no_grad():
        for p in (head.o_proj.weight, head.down_proj.weight):
            p.normal_(std=0.2)
    return head.eval().requires_grad_(False)


def target_features(target, ids: torch.Tensor) -> torch.Tensor:
    """``[T, F*H]`` fused-feature input of a full forward over ``ids``."""
    out = target.model(input_ids=ids[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in LAYERS], dim=-1)


def reference_output(head: EagleHead, features: torch.Tensor, next_ids: torch.Tensor, path: list[int]) -> torch.Tensor:
    """The head's output after the committed entries and a chain of draft steps, from scratch.

    Entries i < L: fused target feature i, token ``next_ids[i]``, position i, causal within the window.
    Chain step j (1-based): the previous output as feature, token ``path[j-1]``, position L-1+j; it
    sees the last ``window`` committed entries and the chain so far.
    """
    length = features.shape[0]
    fused = head.fuse(features)
    q, k, v = head.project(fused, head.embed(next_ids), torch.arange(length))
    window = head.config.window
    t = length - 1
    allowed = torch.tensor([[s <= t and s > t - window for s in range(length)]])
    h = head.finish(fused[t:], head.attend(q[t:], k, v, allowed))[0]
    keys, values = k[max(0, length - window):], v[max(0, length - window):]
    for j, token in enumerate(path, start=1):
        qj, kj, vj = head.project(h[None], head.embed(torch.tensor([token])), torch.tensor([t + j]))
        keys, values = torch.cat([keys, kj]), torch.cat([values, vj])
        h = head.finish(h[None], head.attend(qj, keys, values, torch.ones(1, keys.shape[0], dtype=torch.bool)))[0]
    return h


def reference_tree(head: EagleHead, features, next_ids, depth: int, k: int, total: int):
    """EAGLE-2 tree building by the definition, each node's distribution recomputed along its path."""
    vocab = head.vocab.tolist()
    nodes = []  # (score, draft index, parent creation index, path of target ids)

    def children(path: list[int], score: float, parent: int):
        h = reference_output(head, features, next_ids, path)
        logp = torch.log_softmax(head.logits(h).float(), dim=-1).clamp_max(0.0)
        values, index = logp.topk(k)
        return [(score + float(v), int(i), parent, path + [vocab[int(i)]]) for v, i in zip(values, index)]

    nodes += children([], 0.0, -1)
    frontier = list(range(k))
    for _ in range(1, depth):
        start = len(nodes)
        for f in frontier:
            nodes += children(nodes[f][3], nodes[f][0], f)
        level = list(range(start, len(nodes)))
        frontier = sorted(level, key=lambda i: -nodes[i][0])[:k]
    chosen = sorted(sorted(range(len(nodes)), key=lambda i: -nodes[i][0])[:total])
    where = {c: n for n, c in enumerate(chosen, start=1)}
    tokens = [vocab[nodes[c][1]] for c in chosen]
    parents = [0 if nodes[c][2] < 0 else where[nodes[c][2]] for c in chosen]
    return tokens, parents


def _prefilled(target, head, ids: torch.Tensor, drafter_cls=None, **options) -> Started:
    """A drafter started on the committed tokens ``ids`` (the last one is the root); a fixed budget
    unless ``min_path_prob`` is given."""
    config = EagleDrafterConfig(**{"min_path_prob": 0.0, "lookup_tokens": 0, **options})
    drafter = (drafter_cls or EagleDrafter)(target, config, head=head)
    out = target.model(input_ids=ids[None, :-1], output_hidden_states=True)
    hidden = {i: out.hidden_states[i][0] for i in LAYERS}
    return Started(drafter, DraftContext(ids, 0, SamplingConfig(), None, ids.numel() - 1, hidden))


# ---------------------------------------------------------------------------------------- model


def test_default_feature_layers_follow_eagle3():
    assert default_feature_layers(18) == (2, 9, 15)
    assert default_feature_layers(32) == (2, 16, 29)
    assert default_feature_layers(2) == (0, 1, 2)


def test_config_and_vocabulary_are_validated():
    target = make_target("llama")
    with pytest.raises(ConfigError, match="head_dim must be even"):
        EagleConfig(head_dim=15)
    with pytest.raises(ConfigError, match="outside the target's hidden states"):
        EagleHead(target, EagleConfig(feature_layers=(0, 5), draft_vocab_size=4), torch.arange(4))
    with pytest.raises(DrafterError, match="outside the target's 128 tokens"):
        EagleHead(target, EagleConfig(feature_layers=(0, 1), draft_vocab_size=2), torch.tensor([3, 500]))
    with pytest.raises(ConfigError, match="tree_top_k"):
        EagleDrafterConfig(tree_top_k=0)
    for bad in (-0.1, 1.0, "0.2", True):
        with pytest.raises(ConfigError, match="min_path_prob"):
            EagleDrafterConfig(min_path_prob=bad)
    with pytest.raises(ConfigError, match="exceeds the head's draft vocabulary"):
        EagleDrafter(target, EagleDrafterConfig(tree_top_k=VOCAB_D + 1), head=make_head(target))


def test_no_method_option_shadows_a_generate_argument():
    """``generate(..., top_k=8)`` is the sampling top-k; the tree's own is ``tree_top_k``."""
    from dataclasses import dataclass

    from specwise.drafters.base import METHODS, RESERVED_OPTION_NAMES, MethodConfig, MethodRegistry

    for name in METHODS.names():
        fields = set(METHODS.get(name).config_cls.__dataclass_fields__)
        assert not fields & RESERVED_OPTION_NAMES, name

    @dataclass(frozen=True)
    class Clashing(MethodConfig):
        top_k: int = 4

    with pytest.raises(ValueError, match="named like generate"):
        MethodRegistry().register("x", Clashing, "")(lambda target, config: None)


@pytest.mark.parametrize("arch", ARCHS)
def test_feature_taps_match_the_targets_hidden_states(arch):
    """What the loop hands the drafter (prefill, then each step's kept rows) equals a full forward's
    hidden states at the committed positions."""
    target = make_target(arch, eos=(), attn_implementation="sdpa")
    seen: list[torch.Tensor] = []

    class Tap(EagleDrafter):
        def _queue(self, state, hidden_states, next_tokens):
            seen.append(torch.cat([hidden_states[i] for i in LAYERS], dim=-1))
            super()._queue(state, hidden_states, next_tokens)

    prompt = random_prompt(12, seed=3)
    drafter = Tap(target, EagleDrafterConfig(lookup_tokens=0, min_path_prob=0.0, depth=3, tree_top_k=16, total_tokens=20), head=make_head(target))
    out = speculative_generate(target, drafter, prompt, max_new_tokens=20, sampling=SamplingConfig())
    tokens, stats = out.token_ids, out.stats
    committed = torch.cat([prompt, torch.tensor(tokens)])
    taps = torch.cat(seen)
    assert taps.shape[0] == committed.numel() - 1  # every committed position but the last root, once
    torch.testing.assert_close(taps, target_features(target, committed[:-1]), rtol=0, atol=1e-10)
    assert stats.accepted_tokens > 0


def test_unroll_equals_decoding_along_the_path():
    """The training-time test (step j at index t) computes what decoding computes at tree depth j."""
    target = make_target("gemma3", attn_implementation="sdpa")
    head = make_head(target, window=6)
    ids = random_prompt(14, seed=5)
    features = target_features(target, ids)
    steps = 3
    next_ids = torch.cat([ids[1:], torch.zeros(steps, dtype=torch.long)])
    outputs = head.unroll(features[None, :-1], next_ids[None], steps)
    for t in (0, 4, 9, 12):
        for j in range(steps):
            if t + j + 1 >= ids.numel():
                continue
            h = reference_output(head, features[: t + 1], ids[1: t + 2], ids[t + 2: t + 2 + j].tolist())
            torch.testing.assert_close(outputs[j][0, t], head.logits(h), rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------- tree


@pytest.mark.parametrize("depth,k,total", [(1, 4, 4), (3, 3, 7), (4, 4, 12), (5, 2, 30)])
def test_dynamic_tree_equals_the_brute_force_reference(depth, k, total):
    target = make_target("llama", attn_implementation="sdpa")
    head = make_head(target, window=8)  # the prompt is longer than the window
    ids = random_prompt(15, seed=7)
    drafter = _prefilled(target, head, ids, depth=depth, tree_top_k=k, total_tokens=total)
    proposal = drafter.propose(DraftContext(ids, 50, SamplingConfig(), None, ids.numel() - 1))
    features = target_features(target, ids[:-1])
    tokens, parents = reference_tree(head, features, ids[1:], depth, k, total)
    assert proposal.tokens.tolist() == tokens
    assert proposal.parents.tolist() == parents
    assert all(p <= i for i, p in enumerate(parents))  # ancestor-closed, topological


def test_the_tree_shrinks_to_the_budget():
    target = make_target("llama")
    ids = random_prompt(6, seed=1)
    drafter = _prefilled(target, make_head(target), ids, depth=5, tree_top_k=3, total_tokens=40)
    proposal = drafter.propose(DraftContext(ids, 2, SamplingConfig(), None, ids.numel() - 1))
    from specwise.engine.tree import DraftTree

    tree = DraftTree.build(ids[-1], proposal.tokens, proposal.parents)
    assert int(tree.depth.max()) <= 2 and tree.size - 1 == 2  # the budget's two best nodes
    drafter = _prefilled(target, make_head(target), ids, depth=5, tree_top_k=3, total_tokens=40)
    assert drafter.propose(DraftContext(ids, 0, SamplingConfig(), None, ids.numel() - 1)).tokens.numel() == 0


class _Scored(EagleDrafter):
    """Records the candidates' cumulative scores that the rerank chooses from."""

    def _rerank(self, index, score, parent, min_score, budget):
        self.candidates = (index, score, parent)
        return super()._rerank(index, score, parent, min_score, budget)


@pytest.mark.parametrize("min_path_prob", [0.03, 0.05, 0.1])
def test_min_path_prob_keeps_the_full_trees_nodes_above_it(min_path_prob):
    """The thresholded tree is the unthresholded one without the nodes whose path probability
    (exp of the cumulative score) is below ``min_path_prob``, in the same order with the same
    parents; expansion stops early only where no deeper node could reach it."""
    target = make_target("llama", attn_implementation="sdpa")
    head = make_head(target, window=8)
    ids = random_prompt(15, seed=7)
    options = dict(depth=4, tree_top_k=4, total_tokens=12)
    full = _prefilled(target, head, ids, drafter_cls=_Scored, **options)
    ctx = DraftContext(ids, 50, SamplingConfig(), None, ids.numel() - 1)
    whole = full.propose(ctx)
    index, score, parent = full.drafter.candidates
    from specwise.engine.tree import best_nodes_tree

    chosen, _ = best_nodes_tree(score, parent, options["total_tokens"])
    above = [i for i, c in enumerate(chosen.tolist()) if float(score[c].exp()) >= min_path_prob]
    assert 0 < len(above) < chosen.numel()  # the threshold cuts this tree somewhere
    pruned = _prefilled(target, head, ids, min_path_prob=min_path_prob, **options).propose(ctx)
    assert pruned.tokens.tolist() == whole.tokens[above].tolist()
    # parents: the full tree's, renumbered to the kept nodes (0 = the root)
    renumber = {0: 0, **{node + 1: new + 1 for new, node in enumerate(above)}}
    assert pruned.parents.tolist() == [renumber[int(whole.parents[i])] for i in above]


def test_min_path_prob_above_every_node_proposes_nothing():
    target = make_target("llama", attn_implementation="sdpa")
    ids = random_prompt(15, seed=7)
    drafter = _prefilled(target, make_head(target), ids, depth=4, tree_top_k=4, total_tokens=12,
                         min_path_prob=0.999)
    assert drafter.propose(DraftContext(ids, 50, SamplingConfig(), None, ids.numel() - 1)).tokens.numel() == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_head_cache_after_partial_acceptance_equals_a_fresh_run(arch):
    target = make_target(arch, eos=(), attn_implementation="sdpa")
    head = make_head(target, window=10)
    prompt = random_prompt(9, seed=11)
    drafter = keeping(EagleDrafter)(target, EagleDrafterConfig(lookup_tokens=0, min_path_prob=0.0, depth=4,
                                                                 tree_top_k=24, total_tokens=30), head=head)
    out = speculative_generate(target, drafter, prompt, max_new_tokens=48, sampling=SamplingConfig())
    tokens, stats = out.token_ids, out.stats
    partial = [a for a in stats.accepted_lengths if 0 < a]
    assert partial and stats.accepted_tokens < stats.drafted_tokens  # some accepted, some rejected
    committed = torch.cat([prompt, torch.tensor(tokens)])
    used = drafter.kept.model
    root_h = drafter._catch_up(used)
    fresh = _prefilled(target, head, committed)
    fresh_root_h = fresh.drafter._catch_up(fresh.state.model)
    n = committed.numel() - 1
    new = fresh.state.model.cache
    assert used.cache.length == new.length == n
    torch.testing.assert_close(used.cache.keys[:n], new.keys[:n], rtol=0, atol=1e-10)
    torch.testing.assert_close(used.cache.values[:n], new.values[:n], rtol=0, atol=1e-10)
    torch.testing.assert_close(root_h, fresh_root_h, rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("depth,k,total", [(1, 1, 1), (2, 8, 8), (4, 16, 40), (6, 96, 60)])
def test_greedy_equals_plain_decoding(arch, depth, k, total):
    target = make_target(arch, eos=(), attn_implementation="sdpa")
    head = make_head(target, window=8)  # windowed: the prompt and the generation outrun it
    prompt = random_prompt(20, seed=2)
    drafter = EagleDrafter(target, EagleDrafterConfig(lookup_tokens=0, min_path_prob=0.0, depth=depth, tree_top_k=k, total_tokens=total), head=head)
    out = speculative_generate(target, drafter, prompt, max_new_tokens=30, sampling=SamplingConfig())
    tokens, stats = out.token_ids, out.stats
    assert tokens == reference_greedy(target.model, prompt, 30)
    assert max(len(stats.drafted_by_position), 1) <= depth


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("min_path_prob", [0.005, 0.02, 0.5])
def test_greedy_with_a_dynamic_budget_equals_plain_decoding(arch, min_path_prob):
    """Steps with a thresholded tree, and (0.5: nearly always) with none, stay exact."""
    target = make_target(arch, eos=(), attn_implementation="sdpa")
    head = make_head(target, window=8)
    prompt = random_prompt(20, seed=2)
    config = EagleDrafterConfig(depth=4, tree_top_k=8, total_tokens=16, lookup_tokens=0, min_path_prob=min_path_prob)
    out = speculative_generate(target, EagleDrafter(target, config, head=head), prompt,
                                            max_new_tokens=30, sampling=SamplingConfig())
    tokens, stats = out.token_ids, out.stats
    assert tokens == reference_greedy(target.model, prompt, 30)
    assert stats.drafted_tokens < 16 * len(stats.accepted_lengths)


def test_public_api_runs_eagle_with_a_given_drafter(tmp_path):
    target = make_target("gemma3", eos=())
    path = _save(target, make_head(target), tmp_path / "eagle")
    prompt = random_prompt(10, seed=4)
    text_ids = specwise.generate(target, prompt, method="eagle", drafter_path=str(path), max_new_tokens=12,
                                 depth=3, tree_top_k=8, total_tokens=12).token_ids
    assert text_ids == reference_greedy(target.model, prompt, 12)


# ---------------------------------------------------------------------------------------- checkpoints


def _save(target, head: EagleHead, path):
    tensors = {**head.trainable_state_dict(), "draft_vocab": head.vocab.to(torch.int32)}
    ckpt = DrafterCheckpoint("eagle", head.architecture(), target.name, target_fingerprint(target), tensors)
    return save_checkpoint(ckpt, path)


def test_checkpoint_round_trip_and_vocabulary_mapping(tmp_path):
    target = make_target("llama")
    head = make_head(target)
    path = _save(target, head, tmp_path / "eagle")
    assert json.loads((path / "config.json").read_text())["architecture"]["feature_layers"] == list(LAYERS)
    loaded = load_eagle_head(path, target)
    assert torch.equal(loaded.vocab, head.vocab)  # draft index -> target id survives the round trip
    index_of = {int(t): i for i, t in enumerate(loaded.vocab)}
    assert [index_of[int(loaded.vocab[i])] for i in range(VOCAB_D)] == list(range(VOCAB_D))
    # weights were stored in bf16: the loaded head equals the original rounded to bf16
    rounded = {k: v.to(torch.bfloat16).double() for k, v in head.state_dict().items()}
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, rounded[name], rtol=0, atol=0)
    drafter = load_drafter(path, target, depth=3, tree_top_k=4, total_tokens=8)
    assert isinstance(drafter, EagleDrafter) and drafter.target_hidden_layers == LAYERS
    ids = random_prompt(8, seed=1)
    a = _prefilled(target, loaded, ids, depth=3, tree_top_k=4, total_tokens=8)
    b = _prefilled(target, drafter.head, ids, depth=3, tree_top_k=4, total_tokens=8)
    ctx = DraftContext(ids, 10, SamplingConfig(), None, ids.numel() - 1)
    assert a.propose(ctx).tokens.tolist() == b.propose(ctx).tokens.tolist()


def test_a_head_for_another_target_is_refused(tmp_path):
    llama, gemma = make_target("llama"), make_target("gemma3")
    path = _save(llama, make_head(llama), tmp_path / "eagle")
    with pytest.raises(DrafterError, match="trained for target 'tiny-llama-0'.*tiny-gemma3-0"):
        load_drafter(path, gemma)
    with pytest.raises(DrafterError, match="needs an EAGLE head"):
        EagleDrafter(llama, EagleDrafterConfig())
    with pytest.raises(DrafterError, match="is torch.float32"):
        EagleDrafter(llama, EagleDrafterConfig(), head=make_head(llama).float())


# ---------------------------------------------------------------------------------------- training


def test_replay_by_depth_counts_runs_and_bonus_tokens():
    from specwise.training.acceptance import ChainAcceptance, replay_depths

    # 6 generated tokens; root 0 gets two drafts right, root 3 none, root 4 one (the text then ends)
    matches = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 0, 0], [0, 1, 1], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    stats = replay_depths(matches, ChainAcceptance(3))
    assert stats.steps == 3 and stats.tokens == 5  # 3 tokens, then 1, then 1 (token 5 is the last root)
    assert stats.reached == [3, 1, 1] and stats.accepted == [2, 1, 0]  # root 4: draft 1 has no text to match


def test_eagle_recipe_learns_and_validates_on_a_tiny_corpus(tmp_path):
    from specwise.methods.eagle.recipe import EagleRecipe, EagleRecipeConfig
    from specwise.training.corpus import CorpusConfig, build_corpus
    from specwise.training.features import FeatureConfig, draft_vocabulary, extract_features, token_frequencies
    from specwise.training.trainer import TrainConfig, train
    from test_training import _records

    target = make_target("llama")
    corpus = tmp_path / "corpus"
    build_corpus(target, _records(), corpus, CorpusConfig(new_tokens=10, batch_size=4, sampled_fraction=0.5,
                                                          text_only_prompts=2, seed=1))
    vocab = draft_vocabulary(token_frequencies(corpus, 128), VOCAB_D, always=(1,))
    features = extract_features(target, corpus, vocab, FeatureConfig(top_k=4, hidden_layers=LAYERS, batch_tokens=64),
                                features_dir=corpus / "features-eagle")
    with pytest.raises(ConfigError, match="is missing; run the features pass"):
        EagleRecipe(corpus, vocab, LAYERS, features_dir=corpus / "nothing-here")
    plain = extract_features(target, corpus, vocab, FeatureConfig(top_k=4, batch_tokens=64),
                             features_dir=corpus / "features-plain")
    with pytest.raises(ConfigError, match="no hidden states of layer 0"):
        EagleRecipe(corpus, vocab, LAYERS, features_dir=plain)
    recipe = EagleRecipe(corpus, vocab, LAYERS, EagleRecipeConfig(batch_tokens=64, validation_every=3, ttt_steps=2),
                         features_dir=features)
    head = EagleHead(target, EagleConfig(feature_layers=LAYERS, draft_vocab_size=VOCAB_D, num_heads=2, head_dim=16,
                                         intermediate_size=64), vocab).float()
    result = train(head, recipe, TrainConfig(steps=40, lr=3e-3, warmup_steps=5, log_every=5), tmp_path / "t",
                   progress=False)
    assert result.curve[-1]["loss"] < result.curve[0]["loss"]
    validation = result.validation
    assert len(validation["acceptance_by_position"]) == 6 and validation["mean_accepted_length"] >= 1.0
    check_loss_on_generated(corpus, vocab, features, head)


def check_loss_on_generated(corpus, vocab, features, head) -> None:
    """``loss_on="generated"``: no text-only windows, and the loss ignores the prompts' labels."""
    from specwise.methods.eagle.recipe import EagleRecipe, EagleRecipeConfig

    config = EagleRecipeConfig(batch_tokens=64, validation_every=3, ttt_steps=2)
    assert config.loss_on == "all"
    generated = EagleRecipe(corpus, vocab, LAYERS, replace(config, loss_on="generated"), features_dir=features)
    every = EagleRecipe(corpus, vocab, LAYERS, config, features_dir=features)
    assert any(e.tokens.numel() == e.prompt_length for e in every.train_examples)  # text-only prompts exist
    assert {generated.train_examples[i].prompt_length < generated.train_examples[i].tokens.numel()
            for i, _, _ in generated.windows} == {True}
    assert len(generated.windows) < len(every.windows)
    batch = [w for w in generated.windows if generated.train_examples[w[0]].prompt_length > 3][:2]
    before, _ = generated.loss(head, batch)
    for i, _, _ in batch:  # scramble the labels of tokens the prompt wrote
        ex = generated.train_examples[i]
        ex.top_probs[: ex.prompt_length - 1] = torch.rand_like(ex.top_probs[: ex.prompt_length - 1])
    after, _ = generated.loss(head, batch)
    torch.testing.assert_close(before, after)
    assert not torch.allclose(every.loss(head, batch)[0], generated.loss(head, batch)[0])
    with pytest.raises(ConfigError, match="loss_on"):
        EagleRecipeConfig(loss_on="prompts")


def test_unroll_on_selected_rows_equals_the_full_rows():
    target = make_target("llama")
    head = make_head(target)
    ids = random_prompt(12, seed=2)
    features = target_features(target, ids)[None, :-1]
    next_ids = torch.cat([ids[1:], torch.zeros(2, dtype=torch.long)])[None]
    select = [torch.rand(1, 11, generator=torch.Generator().manual_seed(j)) > 0.5 for j in range(2)]
    full = head.unroll(features, next_ids, 2)
    chosen = head.unroll(features, next_ids, 2, select)
    for j in range(2):
        torch.testing.assert_close(chosen[j], full[j][select[j]], rtol=0, atol=1e-10)


def test_warm_start_loads_a_trained_head_and_refuses_what_does_not_fit(tmp_path):
    from specwise.training.pipeline import warm_start

    target = make_target("llama")
    trained = make_head(target)
    path = _save(target, trained, tmp_path / "eagle")
    fresh = make_head(target, seed=1, vocab=trained.vocab)
    warm_start(fresh, path, "eagle", trained.vocab, target)
    rounded = {k: v.to(torch.bfloat16).to(v.dtype) for k, v in trained.state_dict().items()}
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, rounded[name], rtol=0, atol=0)
    with pytest.raises(DrafterError, match="holds a 'eagle' drafter, not a 'dflash' one"):
        warm_start(fresh, path, "dflash", trained.vocab, target)
    # a checkpoint written before an architecture entry existed loads with its default: it fits too
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    for later in ("hidden_act", "norm_before_residual", "own_embeddings"):
        del config["architecture"][later]
    config_file.write_text(json.dumps(config))
    warm_start(fresh, path, "eagle", trained.vocab, target)
    silu = EagleHead(target, replace(trained.config, hidden_act="silu"), trained.vocab)
    with pytest.raises(DrafterError, match="architecture differs in hidden_act"):
        warm_start(silu, path, "eagle", trained.vocab, target)
    wider = EagleHead(target, replace(trained.config, intermediate_size=trained.config.intermediate_size * 2),
                      trained.vocab)
    with pytest.raises(DrafterError, match="architecture differs in intermediate_size.*trained with .*config.json"):
        warm_start(wider, path, "eagle", trained.vocab, target)
    with pytest.raises(DrafterError, match="draft vocabulary differs"):
        warm_start(fresh, path, "eagle", trained.vocab.flip(0), target)
    with pytest.raises(DrafterError, match="trained for target"):
        warm_start(fresh, path, "eagle", trained.vocab, make_target("gemma3"))
