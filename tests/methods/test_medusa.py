"""Medusa heads (issue #5): head modules, the calibrated static tree, greedy equivalence, the lossy
typical rule, checkpoints and the recipe, on tiny float64 models.

Sampling losslessness of the exact rule, and the demonstration that the typical rule is lossy, are
in ``test_sampling_e2e.py``.
"""

from __future__ import annotations

import pytest
import torch

import specwise
from conftest import ARCHS, Started, make_target, random_prompt, reference_greedy
from specwise.api import load_drafter
from specwise.drafters.checkpoint import DrafterCheckpoint, save_checkpoint, target_fingerprint
from specwise.engine.acceptance import EXACT
from specwise.engine.loop import speculative_generate
from specwise.engine.lossy import typical_tree_accept
from specwise.engine.sampling import SamplingConfig
from specwise.engine.types import DraftContext
from specwise.errors import ConfigError, DrafterError
from specwise.methods.medusa.drafter import MedusaDrafter, MedusaDrafterConfig, MedusaTree, load_medusa_heads
from specwise.methods.medusa.network import MedusaConfig, MedusaHeads
from specwise.methods.medusa.tree import expected_accepted, rank_paths, tree_from_paths

VOCAB_D = 96


def make_heads(target, num_heads: int = 4, num_layers: int = 1, seed: int = 0) -> MedusaHeads:
    """Random heads (blocks not zero, so they differ from the target's own head), float64."""
    torch.manual_seed(seed)
    vocab = torch.randperm(target.vocab_size)[:VOCAB_D]
    heads = MedusaHeads(target, MedusaConfig(num_heads=num_heads, num_layers=num_layers, draft_vocab_size=VOCAB_D),
                        vocab).double()
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(std=0.3)
        heads.scale.uniform_(0.5, 2.0)
    return heads.eval().requires_grad_(False)


def wide_tree(num_heads: int, width: int) -> MedusaTree:
    """Every path of ranks < width up to num_heads deep, breadth first (ancestor-closed)."""
    paths, level = [], [()]
    for _ in range(num_heads):
        level = [p + (r,) for p in level for r in range(width)]
        paths += level
    return MedusaTree(tuple(paths), len(paths))


# ---------------------------------------------------------------------------------------- heads


def test_heads_are_distinct_modules_and_start_as_the_targets_head():
    target = make_target("gemma3")
    torch.manual_seed(0)
    vocab = torch.arange(VOCAB_D)
    heads = MedusaHeads(target, MedusaConfig(num_heads=3, num_layers=2, draft_vocab_size=VOCAB_D), vocab)
    blocks = [block for head in heads.heads for block in head]
    assert len({id(b) for b in blocks}) == 6  # no block object is shared (the reference code's bug)
    assert len({b.linear.weight.data_ptr() for b in blocks}) == 6
    assert heads.config.hidden_layer == 2  # the tiny target's final (normed) hidden state
    # zero-initialised blocks: every head reproduces the target's next-token logits on the draft vocabulary
    out = target.model(input_ids=random_prompt(6)[None], output_hidden_states=True)
    final = out.hidden_states[heads.config.hidden_layer][0]
    heads.set_scale(final)
    torch.testing.assert_close(heads(final.float()), out.logits[0][:, vocab].float().expand(3, -1, -1),
                               rtol=1e-4, atol=1e-4)


def test_config_and_vocabulary_are_validated():
    target = make_target("llama")
    with pytest.raises(ConfigError, match="num_heads"):
        MedusaConfig(num_heads=0)
    with pytest.raises(DrafterError, match="draft vocabulary has 5 ids"):
        MedusaHeads(target, MedusaConfig(draft_vocab_size=6), torch.arange(5))
    with pytest.raises(DrafterError, match="final hidden state"):
        MedusaHeads(target, MedusaConfig(draft_vocab_size=5, hidden_layer=1), torch.arange(5))
    with pytest.raises(ConfigError, match="acceptance"):
        MedusaDrafterConfig(acceptance="typical")
    with pytest.raises(ConfigError, match="tree_nodes"):
        MedusaDrafter(target, MedusaDrafterConfig(tree_nodes=100), heads=make_heads(target),
                      tree=wide_tree(2, 2))


# ---------------------------------------------------------------------------------------- the tree


def test_rank_paths_orders_paths_by_joint_frequency_and_stays_a_tree():
    ranks = torch.tensor([[0, 0, 1], [0, 0, -1], [0, 1, 0], [1, 0, 0], [-1, 0, 0], [0, 0, 1]])
    ranked = rank_paths(ranks)
    paths = [p for p, _ in ranked]
    assert ranked[0] == ((0,), 4 / 6) and ranked[1] == ((0, 0), 3 / 6)
    assert ranked[2] == ((0, 0, 1), 2 / 6)
    assert paths[3:] == [(1,), (0, 1), (1, 0), (0, 1, 0), (1, 0, 0)]  # ties: shorter, then lexicographic
    for i, path in enumerate(paths):  # every prefix of the order is a tree
        assert path[:-1] == () or paths.index(path[:-1]) < i
    assert expected_accepted([p for _, p in ranked], [1, 2]) == {1: pytest.approx(4 / 6), 2: pytest.approx(7 / 6)}
    depths, node_ranks, parents = tree_from_paths(paths)
    for i, path in enumerate(paths):
        assert depths[i] == len(path) and node_ranks[i] == path[-1]
        assert parents[i] == (0 if len(path) == 1 else paths.index(path[:-1]) + 1)
    with pytest.raises(ValueError, match="before its parent"):
        tree_from_paths([(0, 0), (0,)])


def test_proposal_takes_each_depths_tokens_from_its_heads_ranking():
    target = make_target("llama")
    heads = make_heads(target)
    tree = MedusaTree(((0,), (1,), (0, 0), (0, 2), (1, 0), (0, 0, 3)), 6)
    drafter = MedusaDrafter(target, MedusaDrafterConfig(lookup_tokens=0, min_path_prob=0.0), heads=heads, tree=tree)
    ids = random_prompt(8)
    out = target.model(input_ids=ids[None], output_hidden_states=True)
    hidden = {2: out.hidden_states[2][0]}
    started = Started(drafter, DraftContext(ids, 0, SamplingConfig(), None, 7, hidden))
    proposal = started.propose(DraftContext(ids, 10, SamplingConfig(), None, 7))
    order = heads(hidden[2][-1]).argsort(dim=-1, descending=True)  # [K, Vd]
    want = [order[len(p) - 1, p[-1]] for p in tree.paths]
    assert proposal.tokens.tolist() == heads.vocab[torch.stack(want)].tolist()
    assert proposal.parents.tolist() == [0, 0, 1, 1, 2, 3]
    assert proposal.acceptance is EXACT


def test_min_path_prob_drops_the_nodes_whose_path_probability_is_below_it():
    """Path probability = the product of each head's probability of the node's token down the path;
    the kept nodes keep their order, and their parents are renumbered to the kept nodes."""
    target = make_target("llama")
    heads = make_heads(target)
    tree = MedusaTree(((0,), (1,), (0, 0), (0, 2), (1, 0), (0, 0, 3)), 6)
    ids = random_prompt(8)
    out = target.model(input_ids=ids[None], output_hidden_states=True)
    hidden = {2: out.hidden_states[2][0]}
    probs = torch.softmax(heads(hidden[2][-1]), dim=-1).sort(dim=-1, descending=True).values  # [K, Vd]
    full_parents = [0, 0, 1, 1, 2, 3]
    path = []
    for node, (p, parent) in enumerate(zip(tree.paths, full_parents)):
        path.append(float(probs[len(p) - 1, p[-1]]) * (path[parent - 1] if parent else 1.0))
    # halfway (in log space) between the third and fourth least likely nodes: drops the 3 least likely,
    # with a margin far above the drafter's float32 rounding of its log path probabilities
    cut = (sorted(path)[2] * sorted(path)[3]) ** 0.5
    drafter = MedusaDrafter(target, MedusaDrafterConfig(lookup_tokens=0, min_path_prob=cut), heads=heads, tree=tree)
    drafter = Started(drafter, DraftContext(ids, 0, SamplingConfig(), None, 7, hidden))
    whole = MedusaDrafter(target, MedusaDrafterConfig(lookup_tokens=0, min_path_prob=0.0), heads=heads, tree=tree)
    whole = Started(whole, DraftContext(ids, 0, SamplingConfig(), None, 7, hidden))
    ctx = DraftContext(ids, 10, SamplingConfig(), None, 7)
    kept = [i for i in range(6) if path[i] >= cut]
    proposal, full = drafter.propose(ctx), whole.propose(ctx)
    assert len(kept) == 3 and proposal.tokens.tolist() == full.tokens[kept].tolist()
    renumber = {0: 0, **{i + 1: n + 1 for n, i in enumerate(kept)}}
    assert proposal.parents.tolist() == [renumber[full_parents[i]] for i in kept]
    everything = MedusaDrafter(target, MedusaDrafterConfig(lookup_tokens=0, min_path_prob=0.999), heads=heads, tree=tree)
    everything = Started(everything, DraftContext(ids, 0, SamplingConfig(), None, 7, hidden))
    assert everything.propose(ctx).tokens.numel() == 0
    with pytest.raises(ConfigError, match="min_path_prob"):
        MedusaDrafterConfig(min_path_prob=-0.5)


# ---------------------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("heads_width", [(1, 1), (3, 2), (4, 3), (2, 8)])
def test_greedy_equals_plain_decoding(arch, heads_width):
    num_heads, width = heads_width
    target = make_target(arch, eos=(), attn_implementation="sdpa")
    heads = make_heads(target, num_heads=num_heads, num_layers=2)
    prompt = random_prompt(20, seed=2)
    drafter = MedusaDrafter(target, MedusaDrafterConfig(lookup_tokens=0, min_path_prob=0.0), heads=heads, tree=wide_tree(num_heads, width))
    out = speculative_generate(target, drafter, prompt, max_new_tokens=30, sampling=SamplingConfig())
    tokens, stats = out.token_ids, out.stats
    assert tokens == reference_greedy(target.model, prompt, 30)
    assert stats.drafted_tokens > 0 and max(len(stats.drafted_by_position), 1) <= num_heads


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("min_path_prob", [0.002, 0.02, 0.5])
def test_greedy_with_a_dynamic_budget_equals_plain_decoding(arch, min_path_prob):
    target = make_target(arch, eos=(), attn_implementation="sdpa")
    heads = make_heads(target, num_heads=3, num_layers=2)
    prompt = random_prompt(20, seed=2)
    drafter = MedusaDrafter(target, MedusaDrafterConfig(lookup_tokens=0, min_path_prob=min_path_prob), heads=heads,
                            tree=wide_tree(3, 4))
    out = speculative_generate(target, drafter, prompt, max_new_tokens=30, sampling=SamplingConfig())
    tokens = out.token_ids
    assert tokens == reference_greedy(target.model, prompt, 30)


def test_greedy_accepts_drafts_when_heads_predict_well():
    """Heads that copy the target's own next-token head: head 1 predicts x_{t+1} again, so a
    repetitive target accepts; mainly checks acceptance is exercised on the real path."""
    target = make_target("gemma3", eos=(), attn_implementation="sdpa")
    heads = MedusaHeads(target, MedusaConfig(num_heads=2, draft_vocab_size=target.vocab_size),
                        torch.arange(target.vocab_size)).double().eval()
    prompt = random_prompt(12, seed=5)
    drafter = MedusaDrafter(target, MedusaDrafterConfig(lookup_tokens=0, min_path_prob=0.0), heads=heads, tree=wide_tree(2, 4))
    out = speculative_generate(target, drafter, prompt, max_new_tokens=40, sampling=SamplingConfig())
    tokens, stats = out.token_ids, out.stats
    assert tokens == reference_greedy(target.model, prompt, 40)
    assert stats.drafted_tokens > 0


def test_public_api_runs_medusa_with_a_given_drafter(tmp_path):
    target = make_target("gemma3", eos=())
    path = _save(target, make_heads(target), tmp_path / "medusa", wide_tree(3, 2))
    prompt = random_prompt(10, seed=4)
    result = specwise.generate(target, prompt, method="medusa", drafter_path=str(path), max_new_tokens=12, tree_nodes=6)
    assert result.token_ids == reference_greedy(target.model, prompt, 12)
    typical = specwise.generate(target, prompt, method="medusa", drafter_path=str(path), max_new_tokens=12,
                                acceptance="typical-lossy")  # greedy stays exact under either rule
    assert typical.token_ids == result.token_ids


def test_typical_rule_accepts_by_threshold_and_prefers_deep_likely_paths():
    # root -> a(1), b(2); a -> c(3); b -> d(4)
    parents, tokens = [-1, 0, 0, 1, 2], [9, 1, 2, 3, 4]
    probs = torch.full((5, 6), 0.0)
    probs[0, [1, 2, 5]] = torch.tensor([0.5, 0.4, 0.1])  # both children pass a low bar
    probs[1, [3, 5]] = torch.tensor([0.2, 0.8])
    probs[2, [4, 5]] = torch.tensor([0.3, 0.7])
    probs[3, 5] = probs[4, 5] = 1.0
    gen = torch.Generator().manual_seed(0)
    path, nxt = typical_tree_accept(parents, tokens, probs, posterior_threshold=0.1, posterior_alpha=0.3, generator=gen)
    # both depth-2 paths pass (bars: min(0.1, 0.3 exp(-H))); b-d has the larger product, 0.12 > 0.10
    assert path == [2, 4] and nxt == 5
    # a bar of 0.35 everywhere: only depth 1 passes; a (0.5) beats b (0.4); the next root comes from a's p
    path, nxt = typical_tree_accept(parents, tokens, probs, posterior_threshold=0.35, posterior_alpha=10.0, generator=gen)
    assert path == [1] and nxt in (3, 5)
    path, nxt = typical_tree_accept(parents, tokens, probs, posterior_threshold=0.6, posterior_alpha=10.0, generator=gen)
    assert path == [] and nxt in (1, 2, 5)


# ---------------------------------------------------------------------------------------- checkpoints


def _save(target, heads: MedusaHeads, path, tree: MedusaTree):
    tensors = {**heads.trainable_state_dict(), "draft_vocab": heads.vocab.to(torch.int32)}
    arch = {**heads.architecture(), "tree": tree.as_dict()}
    ckpt = DrafterCheckpoint("medusa", arch, target.name, target_fingerprint(target), tensors)
    return save_checkpoint(ckpt, path)


def test_checkpoint_round_trip(tmp_path):
    target = make_target("llama")
    heads = make_heads(target, num_layers=2)
    tree = wide_tree(2, 3)
    path = _save(target, heads, tmp_path / "medusa", tree)
    loaded, loaded_tree = load_medusa_heads(path, target)
    assert loaded_tree == MedusaTree(tree.paths, tree.default_nodes, ())
    assert torch.equal(loaded.vocab, heads.vocab)
    rounded = {k: v.to(torch.bfloat16).double() for k, v in heads.state_dict().items()}
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, rounded[name], rtol=0, atol=0)
    drafter = load_drafter(path, target, tree_nodes=5)
    assert isinstance(drafter, MedusaDrafter) and drafter.target_hidden_layers == (2,)
    assert drafter._parents.numel() == 5


def test_heads_for_another_target_are_refused(tmp_path):
    llama, gemma = make_target("llama"), make_target("gemma3")
    path = _save(llama, make_heads(llama), tmp_path / "medusa", wide_tree(2, 2))
    with pytest.raises(DrafterError, match="trained for target 'tiny-llama-0'.*tiny-gemma3-0"):
        load_drafter(path, gemma)
    with pytest.raises(DrafterError, match="needs Medusa heads"):
        MedusaDrafter(llama, MedusaDrafterConfig())
    with pytest.raises(DrafterError, match="are torch.float32"):
        MedusaDrafter(llama, MedusaDrafterConfig(), heads=make_heads(llama).float())


# ---------------------------------------------------------------------------------------- training


def test_medusa_recipe_learns_calibrates_and_validates(tmp_path):
    from specwise.methods.medusa.recipe import MedusaRecipe, MedusaRecipeConfig
    from specwise.training.corpus import CorpusConfig, build_corpus
    from specwise.training.features import (
        FeatureConfig,
        draft_vocabulary,
        extract_features,
        iter_labelled,
        token_frequencies,
    )
    from specwise.training.recipes.distill import is_validation
    from specwise.training.trainer import TrainConfig, train
    from test_training import _records

    target = make_target("llama")
    corpus = tmp_path / "corpus"
    build_corpus(target, _records(), corpus, CorpusConfig(new_tokens=10, batch_size=4, sampled_fraction=0.5,
                                                          text_only_prompts=2, seed=1))
    vocab = draft_vocabulary(token_frequencies(corpus, 128), VOCAB_D, always=(1,))
    plain = extract_features(target, corpus, vocab, FeatureConfig(top_k=4, batch_tokens=64),
                             features_dir=corpus / "features-plain")
    with pytest.raises(ConfigError, match="no hidden states of layer 2"):
        MedusaRecipe(corpus, vocab, 2, 3, features_dir=plain)
    features = extract_features(target, corpus, vocab, FeatureConfig(top_k=4, hidden_layers=(2,), batch_tokens=64),
                                features_dir=corpus / "features-medusa-2")
    recipe = MedusaRecipe(corpus, vocab, 2, 3, MedusaRecipeConfig(batch_tokens=32, validation_every=3, rank_limit=4),
                          features_dir=features)
    heads = MedusaHeads(target, MedusaConfig(num_heads=3, draft_vocab_size=VOCAB_D), vocab).float()
    heads.set_scale(recipe.scale_sample())
    result = train(heads, recipe, TrainConfig(steps=40, lr=3e-3, warmup_steps=5, log_every=5), tmp_path / "t",
                   progress=False)
    losses = [row["loss"] for row in result.curve]
    assert losses[-1] < losses[0]
    validation = result.validation
    assert len(validation["head_top1"]) == 3 and len(validation["acceptance_by_position"]) == 3
    assert all(a <= b for a, b in zip(validation["head_top1"], validation["head_top4"]))
    assert validation["mean_accepted_length"] >= 1.0
    ranks = recipe.calibration_ranks(heads)
    assert ranks.shape[1] == 3 and int(ranks.max()) < 4
    # loss_on="generated" trains on positions whose next token the target wrote
    assert recipe.config.loss_on == "all"
    every, recipe = recipe, MedusaRecipe(corpus, vocab, 2, 3, MedusaRecipeConfig(batch_tokens=32, validation_every=3,
                                                                                  loss_on="generated"),
                                         features_dir=features)
    assert set(recipe.positions.tolist()) < set(every.positions.tolist())
    starts = {}  # corpus row of each training sequence's first token, and its prompt length
    row = 0
    for seq in iter_labelled(corpus, vocab, (2,), features):
        if not is_validation(seq.id, 3):
            starts[row] = seq.prompt_length
            row += seq.tokens.numel()
    first = sorted(starts)
    for position in recipe.positions.tolist():
        begin = max(r for r in first if r <= position)
        assert position - begin >= starts[begin] - 1
    with pytest.raises(ConfigError, match="loss_on"):
        MedusaRecipeConfig(loss_on="prompt")


def test_tree_size_maximizes_expected_tokens_per_second():
    from specwise.methods.medusa.calibration import choose_tree_nodes

    probabilities = [0.6, 0.3, 0.2, 0.1, 0.05, 0.05, 0.01, 0.01]
    assert choose_tree_nodes(probabilities, {1: 1.0, 2: 1.0, 5: 1.0, 9: 2.0}, 0.0) == (4, pytest.approx(2.2))
    # drafting cost makes a flat verification curve favour... the same size; a steep one favours 1 node
    assert choose_tree_nodes(probabilities, {2: 1.0, 3: 1.5, 5: 2.5}, 0.1)[0] == 1
    assert choose_tree_nodes([], {1: 1.0, 2: 1.0}, 0.0) == (0, 1.0)
