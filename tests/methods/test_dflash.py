"""DFlash (issue #7): block mask and KV injection against a reference, the drafter's cache after
partial acceptance, greedy equivalence, EOS inside a block, checkpoints and the recipe, on tiny
float64 models. Sampling losslessness is in ``test_sampling_e2e.py``.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import specwise
from conftest import ARCHS, keeping, make_target, random_prompt, reference_greedy
from specwise.api import load_drafter
from specwise.drafters import base
from specwise.drafters.checkpoint import DrafterCheckpoint, save_checkpoint, target_fingerprint
from specwise.engine.loop import speculative_generate
from specwise.engine.sampling import SamplingConfig
from specwise.engine.types import DraftContext
from specwise.errors import ConfigError, DrafterError
from specwise.methods.dflash.drafter import DFlashDrafter, DFlashDrafterConfig, load_dflash
from specwise.methods.dflash.network import DFlashConfig, DFlashModel
from specwise.models.common import rotary

LAYERS = (0, 1, 2)
VOCAB_D = 96


def make_dflash(target, block_size: int = 4, window: int = 64, seed: int = 0) -> DFlashModel:
    """A random drafter (residual outputs not zero, so every part matters), float64."""
    torch.manual_seed(seed)
    vocab = torch.randperm(target.vocab_size)[:VOCAB_D]
    config = DFlashConfig(feature_layers=LAYERS, draft_vocab_size=VOCAB_D, block_size=block_size, num_layers=2,
                          num_heads=2, head_dim=16, intermediate_size=64, window=window)
    model = DFlashModel(target, config, vocab).double()
    with torch.no_grad():
        for layer in model.layers:
            layer.o_proj.weight.normal_(std=0.2)
            layer.down_proj.weight.normal_(std=0.2)
    return model.eval().requires_grad_(False)


def target_features(target, ids: torch.Tensor) -> torch.Tensor:
    """``[T, F*H]`` concatenated feature taps of a full forward over ``ids``."""
    out = target.model(input_ids=ids[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in LAYERS], dim=-1)


def reference_block(model: DFlashModel, features: torch.Tensor, anchor_token: int, anchor: int) -> torch.Tensor:
    """Logits ``[B-1, Vd]`` of one block computed naively: context vectors of indices
    ``anchor - window .. anchor - 1``, then each layer with plain softmax attention over
    ``[context keys; block keys]``, no mask."""
    cfg = model.config
    begin = max(0, anchor - cfg.window)
    context = model.fuse(features[begin:anchor])
    ctx_pos = torch.arange(begin, anchor)
    x = model.block_input(torch.tensor(anchor_token))
    pos = torch.arange(anchor, anchor + cfg.block_size)
    for layer in model.layers:
        h = layer.input_norm(x)
        q = rotary(layer.q_norm(layer._heads(layer.q_proj(h))), pos, cfg.rope_theta)
        kb = rotary(layer.k_norm(layer._heads(layer.k_proj(h))), pos, cfg.rope_theta)
        kc = rotary(layer.k_norm(layer._heads(layer.k_proj(context))), ctx_pos, cfg.rope_theta)
        keys = torch.cat([kc, kb])
        values = torch.cat([layer._heads(layer.v_proj(context)), layer._heads(layer.v_proj(h))])
        scores = torch.einsum("nhd,mhd->hnm", q, keys) / cfg.head_dim ** 0.5
        attended = torch.einsum("hnm,mhd->nhd", scores.softmax(-1), values).flatten(1)
        x = x + layer.o_proj(attended)
        y = layer.mlp_norm(x)
        x = x + layer.down_proj(torch.nn.functional.gelu(layer.gate_proj(y), approximate="tanh") * layer.up_proj(y))
    return model.logits(x[1:])


# ---------------------------------------------------------------------------------------- the network


def test_config_is_validated():
    with pytest.raises(ConfigError, match="block_size"):
        DFlashConfig(block_size=1)
    with pytest.raises(ConfigError, match="feature layer"):
        DFlashConfig(feature_layers=())
    target = make_target("llama")
    with pytest.raises(ConfigError, match="outside the target's hidden states"):
        DFlashModel(target, DFlashConfig(feature_layers=(9,), draft_vocab_size=4), torch.arange(4))
    with pytest.raises(ConfigError, match="depth=9"):
        DFlashDrafter(target, DFlashDrafterConfig(depth=9), model=make_dflash(target, 4))


@pytest.mark.parametrize("window", [64, 5])
def test_block_mask_and_kv_injection_match_the_reference(window):
    """Many blocks in one training forward (block mask, context window) equal each block run alone."""
    target = make_target("gemma3", attn_implementation="sdpa")
    model = make_dflash(target, block_size=4, window=window)
    ids = random_prompt(24, seed=1)
    features = target_features(target, ids)
    anchors = torch.tensor([1, 5, 6, 13, 20])
    logits = model(features[None], ids[None], anchors[None])[0]  # [N, B-1, Vd]
    for b, anchor in enumerate(anchors.tolist()):
        torch.testing.assert_close(logits[b], reference_block(model, features, int(ids[anchor]), anchor),
                                   rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("arch", ARCHS)
def test_drafting_equals_the_training_forward_and_the_cache_follows_the_accepted_prefix(arch):
    target = make_target(arch, eos=(), attn_implementation="sdpa")
    model = make_dflash(target, block_size=5, window=6)
    prompt = random_prompt(9, seed=3)
    drafter = keeping(DFlashDrafter)(target, DFlashDrafterConfig(lookup_tokens=0, min_path_prob=0.0), model=model)
    out = speculative_generate(target, drafter, prompt, max_new_tokens=25, sampling=SamplingConfig())
    tokens, stats = out.token_ids, out.stats
    assert stats.target_forwards > 1
    committed = torch.cat([prompt, torch.tensor(tokens)])
    features = target_features(target, committed)
    # the cache holds exactly the committed positions' context (the last root's features come later)
    state = drafter.kept
    drafter._catch_up(state.model)
    n = state.model.caches[0].length
    fresh = model.context_keys_values(model.fuse(features[:n]), torch.arange(n))
    for cache, (k, v) in zip(state.model.caches, fresh):
        torch.testing.assert_close(cache.keys[:n], k, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(cache.values[:n], v, rtol=1e-10, atol=1e-10)
    # the next proposal equals the training forward's block at the root
    root = n
    ctx = DraftContext(committed[: root + 1], 10, SamplingConfig(), None, root)
    proposal = drafter.propose(state, ctx).tokens
    want = model(features[None, : root + 1], committed[None, : root + 1], torch.tensor([[root]]))[0, 0].argmax(-1)
    assert proposal.tolist() == model.vocab[want].tolist()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size,window", [(2, 64), (4, 8), (8, 64), (16, 3)])
def test_greedy_equals_plain_decoding(arch, block_size, window):
    target = make_target(arch, eos=(), attn_implementation="sdpa")
    drafter = DFlashDrafter(target, DFlashDrafterConfig(lookup_tokens=0, min_path_prob=0.0), model=make_dflash(target, block_size, window))
    prompt = random_prompt(20, seed=2)
    out = speculative_generate(target, drafter, prompt, max_new_tokens=30, sampling=SamplingConfig())
    tokens, stats = out.token_ids, out.stats
    assert tokens == reference_greedy(target.model, prompt, 30)
    assert len(stats.drafted_by_position) <= block_size - 1


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size,tree_top_k,total_tokens", [(4, 2, 4), (8, 3, 8), (6, 4, 16)])
def test_greedy_with_a_draft_tree_equals_plain_decoding(arch, block_size, tree_top_k, total_tokens):
    target = make_target(arch, eos=(), attn_implementation="sdpa")
    config = DFlashDrafterConfig(lookup_tokens=0, min_path_prob=0.0, tree_top_k=tree_top_k, total_tokens=total_tokens)
    drafter = DFlashDrafter(target, config, model=make_dflash(target, block_size, window=8))
    prompt = random_prompt(20, seed=3)
    out = speculative_generate(target, drafter, prompt, max_new_tokens=30, sampling=SamplingConfig())
    tokens, stats = out.token_ids, out.stats
    assert tokens == reference_greedy(target.model, prompt, 30)
    assert stats.drafted_tokens > 0


def test_the_draft_tree_follows_the_block_distributions():
    """Each level offers the top-k tokens of its block position, the first-child path is the argmax
    chain, and scores never rise along a path (which the rerank, tested in test_tree.py, needs)."""
    target = make_target("llama", eos=())
    model = make_dflash(target, block_size=5)
    k, total = 3, 9
    drafter = DFlashDrafter(target, DFlashDrafterConfig(lookup_tokens=0, min_path_prob=0.0, tree_top_k=k, total_tokens=total), model=model)
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB_D, dtype=torch.float64)
    proposal = drafter._tree(logits)
    parents = proposal.parents.tolist()
    assert len(parents) == total and all(p <= i for i, p in enumerate(parents))
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    logp = torch.log_softmax(logits, dim=-1)
    top = logp.topk(k, dim=-1).indices
    tokens = proposal.tokens.tolist()
    for node in range(1, total + 1):  # node i is token i - 1
        assert tokens[node - 1] in model.vocab[top[depth[node] - 1]].tolist()
    # the first-child path is the argmax chain
    node, chain = 0, []
    while True:
        children = [i + 1 for i, p in enumerate(parents) if p == node]
        if not children:
            break
        node = children[0]
        chain.append(tokens[node - 1])
    assert chain == model.vocab[logits[: len(chain)].argmax(-1)].tolist()
    # scores (sums of log-probabilities along the path) never rise from a parent to its child
    score = [0.0]
    for node in range(1, total + 1):
        index = (model.vocab == tokens[node - 1]).nonzero().item()
        score.append(score[parents[node - 1]] + float(logp[depth[node] - 1, index]))
    assert all(score[node] <= score[parents[node - 1]] + 1e-12 for node in range(1, total + 1))
    with pytest.raises(ConfigError, match="tree_top_k"):
        DFlashDrafterConfig(tree_top_k=0)
    with pytest.raises(ConfigError, match="exceeds the drafter's draft vocabulary"):
        DFlashDrafter(target, DFlashDrafterConfig(tree_top_k=VOCAB_D + 1), model=model)


def test_min_path_prob_cuts_the_chain_and_the_tree_where_the_path_probability_falls_below_it():
    target = make_target("llama", eos=())
    model = make_dflash(target, block_size=6)
    torch.manual_seed(1)
    logits = 3 * torch.randn(5, VOCAB_D, dtype=torch.float64)
    path = torch.log_softmax(logits, dim=-1).max(dim=-1).values.cumsum(0).exp()  # argmax chain's path probabilities
    for threshold in (0.0, float(path[1]) * 0.999, float(path[1]) * 1.001, 0.999):
        config = DFlashDrafterConfig(lookup_tokens=0, min_path_prob=threshold)
        chain = DFlashDrafter(target, config, model=model)._chain(logits).tokens
        keep = int((path >= threshold).sum())
        assert chain.tolist() == model.vocab[logits.argmax(-1)][:keep].tolist()
    full = DFlashDrafter(target, DFlashDrafterConfig(lookup_tokens=0, min_path_prob=0.0, tree_top_k=3, total_tokens=9), model=model)._tree(logits)
    cut = DFlashDrafter(target, DFlashDrafterConfig(tree_top_k=3, total_tokens=9, lookup_tokens=0, min_path_prob=float(path[1]) * 0.999),
                        model=model)._tree(logits)
    assert 2 <= cut.tokens.numel() < full.tokens.numel()
    assert full.tokens[: 1].tolist() == cut.tokens[:1].tolist()  # the argmax chain's first node survives
    empty = DFlashDrafter(target, DFlashDrafterConfig(tree_top_k=3, lookup_tokens=0, min_path_prob=0.999), model=model)._tree(logits)
    assert empty.tokens.numel() == 0
    with pytest.raises(ConfigError, match="min_path_prob"):
        DFlashDrafterConfig(min_path_prob=1.0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tree_top_k,min_path_prob", [(1, 0.02), (1, 0.5), (3, 0.005)])
def test_greedy_with_a_dynamic_length_equals_plain_decoding(arch, tree_top_k, min_path_prob):
    target = make_target(arch, eos=(), attn_implementation="sdpa")
    config = DFlashDrafterConfig(tree_top_k=tree_top_k, total_tokens=8, lookup_tokens=0, min_path_prob=min_path_prob)
    drafter = DFlashDrafter(target, config, model=make_dflash(target, block_size=6, window=8))
    prompt = random_prompt(20, seed=3)
    out = speculative_generate(target, drafter, prompt, max_new_tokens=30, sampling=SamplingConfig())
    tokens = out.token_ids
    assert tokens == reference_greedy(target.model, prompt, 30)


def test_greedy_accepts_when_the_drafter_guesses_right(monkeypatch):
    """Drafts that are the target's own continuation are all accepted, and the cache still ends with
    one entry per committed position before the root."""
    target = make_target("llama", eos=(), attn_implementation="sdpa")
    model = make_dflash(target, block_size=6)
    prompt = random_prompt(10, seed=6)
    truth = reference_greedy(target.model, prompt, 40)
    drafter = keeping(DFlashDrafter)(target, DFlashDrafterConfig(lookup_tokens=0, min_path_prob=0.0), model=model)
    real_propose = drafter.propose

    def oracle(state, ctx):
        real_propose(state, ctx)  # keep the cache bookkeeping
        done = ctx.token_ids.numel() - prompt.numel()
        from specwise.engine.types import Proposal
        return Proposal(torch.tensor(truth[done: done + min(5, ctx.max_draft_tokens)], dtype=torch.long))

    monkeypatch.setattr(drafter, "propose", oracle)
    out = speculative_generate(target, drafter, prompt, max_new_tokens=40, sampling=SamplingConfig())
    tokens, stats = out.token_ids, out.stats
    assert tokens == truth and stats.mean_accepted_length == 40 / 8  # prefill, then 7 steps of 5 drafts + 1
    drafter._catch_up(drafter.kept.model)
    assert drafter.kept.model.caches[0].length == prompt.numel() + 40 - 1


def test_eos_inside_a_block_stops_generation_there():
    target = make_target("llama", eos=(), attn_implementation="sdpa")
    prompt = random_prompt(10, seed=7)
    truth = reference_greedy(target.model, prompt, 30)
    eos = truth[6]  # a token the target emits at index 6: make it the EOS
    target.eos_token_ids = frozenset({eos})
    stop = truth.index(eos)
    model = make_dflash(target, block_size=8)
    drafter = DFlashDrafter(target, DFlashDrafterConfig(lookup_tokens=0, min_path_prob=0.0), model=model)
    result = specwise.generate(target, prompt, drafter=drafter, max_new_tokens=30)
    assert result.token_ids == truth[: stop + 1] and result.stop_reason == "eos"


def test_public_api_runs_dflash_with_a_given_drafter(tmp_path):
    target = make_target("gemma3", eos=())
    path = _save(target, make_dflash(target), tmp_path / "dflash")
    prompt = random_prompt(10, seed=4)
    result = specwise.generate(target, prompt, method="dflash", drafter_path=str(path), max_new_tokens=12, depth=2)
    assert result.token_ids == reference_greedy(target.model, prompt, 12)
    assert len(result.stats.drafted_by_position) <= 2


def test_the_old_spellings_of_depth_and_drafter_path_still_work_and_warn_once(tmp_path, monkeypatch):
    monkeypatch.setattr(base, "_WARNED", set())
    target = make_target("gemma3", eos=())
    path = _save(target, make_dflash(target), tmp_path / "dflash")
    prompt = random_prompt(10, seed=4)
    new = specwise.generate(target, prompt, method="dflash", drafter_path=str(path), max_new_tokens=12, depth=2)
    with pytest.warns(DeprecationWarning) as caught:
        old = specwise.generate(target, prompt, method="dflash", drafter=str(path), max_new_tokens=12,
                                num_draft_tokens=2)
    assert old.token_ids == new.token_ids and old.stats.drafted_by_position == new.stats.drafted_by_position
    said = " ".join(str(w.message) for w in caught)
    assert "'num_draft_tokens' is deprecated, use 'depth'" in said and "drafter_path" in said
    spec = specwise.METHODS.get("dflash")
    assert spec.make_config(num_draft_tokens=3) == spec.make_config(depth=3)
    with pytest.warns(DeprecationWarning, match="'drafter' is deprecated, use 'drafter_path'"):
        assert DFlashDrafterConfig(drafter=str(path)).drafter_path == str(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: no second warning
        assert spec.make_config(num_draft_tokens=3).num_draft_tokens == 3
    with pytest.raises(ConfigError, match="not both"):
        spec.make_config(num_draft_tokens=3, depth=3)
    with pytest.raises(ConfigError, match="depth=9"):
        DFlashDrafter(target, DFlashDrafterConfig(num_draft_tokens=9), model=make_dflash(target, 4))


# ---------------------------------------------------------------------------------------- checkpoints


def _save(target, model: DFlashModel, path):
    tensors = {**model.trainable_state_dict(), "draft_vocab": model.vocab.to(torch.int32)}
    ckpt = DrafterCheckpoint("dflash", model.architecture(), target.name, target_fingerprint(target), tensors)
    return save_checkpoint(ckpt, path)


def test_checkpoint_round_trip(tmp_path):
    target = make_target("llama")
    model = make_dflash(target)
    path = _save(target, model, tmp_path / "dflash")
    assert json.loads((path / "config.json").read_text())["architecture"]["feature_layers"] == list(LAYERS)
    loaded = load_dflash(path, target)
    assert torch.equal(loaded.vocab, model.vocab)
    rounded = {k: v.to(torch.bfloat16).double() for k, v in model.state_dict().items()}
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, rounded[name], rtol=0, atol=0)
    drafter = load_drafter(path, target)
    assert isinstance(drafter, DFlashDrafter) and drafter.target_hidden_layers == LAYERS
    assert drafter.depth == 3  # all B-1 drafts unless a tuned default is recorded
    config = json.loads((path / "config.json").read_text())
    config["architecture"]["default_draft_tokens"] = 2
    (path / "config.json").write_text(json.dumps(config))
    assert load_drafter(path, target).depth == 2
    assert load_drafter(path, target, depth=3).depth == 3


def test_a_drafter_for_another_target_is_refused(tmp_path):
    llama, gemma = make_target("llama"), make_target("gemma3")
    path = _save(llama, make_dflash(llama), tmp_path / "dflash")
    with pytest.raises(DrafterError, match="trained for target 'tiny-llama-0'.*tiny-gemma3-0"):
        load_drafter(path, gemma)
    with pytest.raises(DrafterError, match="needs a DFlash drafter"):
        DFlashDrafter(llama, DFlashDrafterConfig())
    with pytest.raises(DrafterError, match="is torch.float32"):
        DFlashDrafter(llama, DFlashDrafterConfig(), model=make_dflash(llama).float())


# ---------------------------------------------------------------------------------------- training


def test_dflash_recipe_learns_and_validates_on_a_tiny_corpus(tmp_path):
    from specwise.methods.dflash.recipe import DFlashRecipe, DFlashRecipeConfig
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
                                features_dir=corpus / "features-taps")
    recipe = DFlashRecipe(corpus, vocab, LAYERS, DFlashRecipeConfig(batch_tokens=64, validation_every=3, block_size=4,
                                                                    loss_on="generated"), features_dir=features)
    assert recipe.batches(0, 0) == recipe.batches(0, 0) and recipe.batches(0, 0) != recipe.batches(1, 0)
    model = DFlashModel(target, DFlashConfig(feature_layers=LAYERS, draft_vocab_size=VOCAB_D, block_size=4,
                                               num_layers=1, num_heads=2, head_dim=16, intermediate_size=64),
                          vocab).float()
    result = train(model, recipe, TrainConfig(steps=40, lr=3e-3, warmup_steps=5, log_every=5), tmp_path / "t",
                   progress=False)
    losses = [row["loss"] for row in result.curve]
    assert losses[-1] < losses[0]
    validation = result.validation
    assert validation["num_draft_tokens"] == 3 and validation["mean_accepted_length"] >= 1.0
    assert len(validation["acceptance_by_position"]) == 3
    # loss_on="generated": anchors (decoding's roots) only on tokens the target wrote
    for group, blocks in recipe.batches(0, 0):
        for (i, start, _), anchors in zip(group, blocks):
            assert anchors and min(anchors) + start >= recipe.train_examples[i].prompt_length
    every = DFlashRecipe(corpus, vocab, LAYERS, DFlashRecipeConfig(batch_tokens=64, validation_every=3, block_size=4,
                                                                   loss_on="all"), features_dir=features)
    assert len(every.windows) > len(recipe.windows)
    assert any(min(a) + w[1] < every.train_examples[w[0]].prompt_length
               for group, blocks in every.batches(0, 0) for w, a in zip(group, blocks))
