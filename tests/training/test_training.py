"""The training pipeline on tiny random models: corpus, features, trainer (resume, DDP), checkpoints,
the draft-LM route (greedy equivalence), export to a plain HF model, and the CLI end to end."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

import specwise
from conftest import make_target, random_prompt, reference_greedy
from specwise.api import load_drafter
from specwise.cli import build_parser
from specwise.drafters.checkpoint import DrafterCheckpoint, load_checkpoint, save_checkpoint, target_fingerprint
from specwise.errors import ConfigError, DrafterError
from specwise.methods.draft.drafter import DraftModelConfig, DraftModelDrafter, load_draft_lm
from specwise.methods.draft.network import DraftLM, DraftLMConfig
from specwise.prompts import PromptRecord, is_held_out
from specwise.training.acceptance import replay_chain
from specwise.training.cli import options_from_args
from specwise.training.corpus import CorpusConfig, build_corpus, iter_corpus
from specwise.training.distributed import rank0_decides
from specwise.training.features import (
    FeatureConfig,
    draft_vocabulary,
    extract_features,
    read_features,
    token_frequencies,
    vocabulary_coverage,
)
from specwise.training.losses import DistillLoss
from specwise.training.options import TrainOptions, make_options
from specwise.training.recipes import RECIPES, get_recipe, recipe_names
from specwise.training.recipes.base import RecipeRegistry
from specwise.training.recipes.distill import DraftLMRecipe, DraftRecipeConfig
from specwise.training.trainer import TrainConfig, join_process_group, learning_rate, train

VOCAB_D = 96  # draft vocabulary of the tiny models (of 128)


def _records(n: int = 12, length: int = 6) -> list[PromptRecord]:
    out = []
    for i in range(n):
        words = " ".join(f"t{int(x)}" for x in random_prompt(length, seed=i))
        out.append(PromptRecord(f"cat{i % 3}/p{i}", f"cat{i % 3}", words))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tiny featured corpus: 12 prompts (held-out ones dropped), 10 new tokens each, greedy and sampled."""
    target = make_target("llama")
    out = tmp_path_factory.mktemp("corpus")
    config = CorpusConfig(new_tokens=10, batch_size=4, sampled_fraction=0.5, text_only_prompts=2, seed=1)
    build_corpus(target, _records(), out, config)
    vocab = draft_vocabulary(token_frequencies(out, 128), VOCAB_D, always=(1,))
    extract_features(target, out, vocab, FeatureConfig(top_k=4, hidden_layers=(1, 2), batch_tokens=64))
    return target, out, vocab


# ---------------------------------------------------------------------------------------- corpus


def test_corpus_holds_the_targets_own_continuations(corpus):
    target, out, _ = corpus
    records = {r.id: r for r in _records()}
    seqs = list(iter_corpus(out))
    assert {s.id for s in seqs} == {r.id for r in records.values() if not is_held_out(r)}
    modes = {s.mode for s in seqs}
    assert modes == {"greedy", "sampled", "text"}
    for seq in seqs:
        prompt = target.encode(records[seq.id].prompt).cpu()
        assert torch.equal(seq.tokens[: seq.prompt_length], prompt)
        if seq.mode == "greedy":  # batched, left-padded HF generate == the slow oracle, token for token
            expected = reference_greedy(target.model, prompt, 10)
            if 1 in expected:  # the corpus stops after EOS
                expected = expected[: expected.index(1) + 1]
            assert seq.tokens[seq.prompt_length:].tolist() == expected
        if seq.mode == "text":
            assert seq.tokens.numel() == seq.prompt_length


def test_corpus_build_resumes_without_redoing_prompts(corpus, tmp_path):
    target, out, _ = corpus
    before = sorted(p.name for p in out.glob("shard-*"))
    build_corpus(target, _records(), out, CorpusConfig(new_tokens=10, batch_size=4, text_only_prompts=2, seed=1))
    assert sorted(p.name for p in out.glob("shard-*")) == before


def test_corpus_stops_at_eos_and_refuses_held_out_only_input(tmp_path):
    reference = reference_greedy(make_target("llama").model, torch.tensor([5, 6]), 3)
    second = reference[1]
    target = make_target("llama", eos=(second,))
    record = next(r for r in (PromptRecord(f"x/{i}", "x", "t5 t6") for i in range(50)) if not is_held_out(r))
    build_corpus(target, [record], tmp_path / "c", CorpusConfig(new_tokens=8))
    (seq,) = list(iter_corpus(tmp_path / "c"))
    assert seq.tokens[2:].tolist() == reference[: reference.index(second) + 1]
    held = [r for r in (PromptRecord(f"h/{i}", "h", "t5") for i in range(200)) if is_held_out(r)]
    with pytest.raises(ConfigError, match="held-out"):
        build_corpus(target, held, tmp_path / "d")


def test_a_chat_corpus_continues_each_prompt_as_a_user_message(tmp_path):
    target = make_target("llama")
    target.tokenizer.chat_template = ("{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}"
                                      "{% if add_generation_prompt %}t5 {% endif %}")
    records = [r for r in _records() if not is_held_out(r)][:2]
    build_corpus(target, records, tmp_path / "c", CorpusConfig(new_tokens=4, chat=True))
    for seq in iter_corpus(tmp_path / "c"):
        record = next(r for r in records if r.id == seq.id)
        expected = target.encode_chat([{"role": "user", "content": record.prompt}]).cpu()
        assert torch.equal(seq.tokens[: seq.prompt_length], expected)
    target.tokenizer.chat_template = None
    with pytest.raises(ConfigError, match="no chat template: build its corpus without --chat"):
        build_corpus(target, records, tmp_path / "d", CorpusConfig(new_tokens=4, chat=True))
    assert not (tmp_path / "d").exists()  # refused before anything is written


# -------------------------------------------------------------------------------------- features


def test_features_are_the_targets_top_k_over_the_draft_vocabulary(corpus):
    target, out, vocab = corpus
    shard = sorted(out.glob("shard-*"))[0]
    features = read_features(out, shard.name)
    seq = next(iter_corpus(out))
    n = seq.tokens.numel()
    with torch.no_grad():
        hidden = target.model(seq.tokens[None], output_hidden_states=True).hidden_states
        logits = target.model(seq.tokens[None]).logits[0][:, vocab]
    expected = torch.log_softmax(logits, -1).topk(4, dim=-1)
    assert torch.equal(features["top_ids"][:n].long(), vocab[expected.indices])
    torch.testing.assert_close(features["top_logprobs"][:n].float(), expected.values.float(), atol=0.02, rtol=0.01)
    for layer in (1, 2):
        torch.testing.assert_close(features[f"hidden_{layer}"][:n].float(), hidden[layer][0].float(),
                                   atol=0.02, rtol=0.01)


def test_features_refuse_a_different_vocabulary(corpus):
    target, out, vocab = corpus
    with pytest.raises(ConfigError, match="other settings"):
        extract_features(target, out, vocab.flip(0), FeatureConfig(top_k=4, hidden_layers=(1, 2)))


def test_draft_vocabulary_is_frequency_ranked_and_keeps_forced_ids():
    counts = torch.tensor([5, 0, 9, 1, 7])
    assert draft_vocabulary(counts, 3).tolist() == [2, 4, 0]
    assert draft_vocabulary(counts, 3, always=(1,)).tolist() == [1, 2, 4]
    assert vocabulary_coverage(counts, torch.tensor([2, 4])) == pytest.approx(16 / 22)
    with pytest.raises(ConfigError):
        draft_vocabulary(counts, 6)


def test_replayed_chain_acceptance_by_hand():
    # agreements: accept 2 then reject; accept 3 (K=3 cap) ; then 1 left
    agree = torch.tensor([True, True, False, True, True, True, True, False])
    stats = replay_chain(agree, 3)
    # step 1: run 2, emit 3 (pos 0..2); step 2: pos 3, run 3 (cap), emit 4 (pos 3..6); step 3: pos 7, emit 1
    assert (stats.steps, stats.tokens) == (3, 8)
    assert stats.reached == [2, 2, 2] and stats.accepted == [2, 2, 1]  # step 1 rejects its 3rd draft
    assert stats.acceptance_by_position == [1.0, 1.0, 0.5]
    assert stats.mean_accepted_length == pytest.approx(8 / 3)


def test_draft_recipe_loss_on_generated_ignores_prompt_labels(corpus):
    _, out, vocab = corpus
    config = DraftRecipeConfig(batch_tokens=64, max_length=16, validation_every=4, loss_on="generated")
    generated = DraftLMRecipe(out, vocab, config)
    every = DraftLMRecipe(out, vocab, DraftRecipeConfig(batch_tokens=64, max_length=16, validation_every=4))
    assert len(generated.windows) < len(every.windows)
    assert all(generated.train_examples[i].tokens.numel() > generated.train_examples[i].prompt_length
               and start + length >= generated.train_examples[i].prompt_length for i, start, length in generated.windows)
    model = _model(corpus)
    batch = [w for w in generated.windows if generated.train_examples[w[0]].prompt_length - w[1] > 2][:2]
    assert batch
    before = generated.loss(model, batch)[0]
    for i, _, _ in batch:  # scramble the labels of tokens the prompt wrote
        ex = generated.train_examples[i]
        ex.top_probs[: ex.prompt_length - 1] = torch.rand_like(ex.top_probs[: ex.prompt_length - 1])
    torch.testing.assert_close(generated.loss(model, batch)[0], before)
    with pytest.raises(ConfigError, match="loss_on"):
        DraftRecipeConfig(loss_on="prompt")


# --------------------------------------------------------------------------------------- trainer


def _recipe(corpus):
    _, out, vocab = corpus
    return DraftLMRecipe(out, vocab, DraftRecipeConfig(batch_tokens=64, max_length=16, validation_every=4))


def _model(corpus, seed=0):
    target, _, vocab = corpus
    torch.manual_seed(seed)
    model = DraftLM(target, DraftLMConfig(init_layers=(0,), draft_vocab_size=VOCAB_D), vocab).float()
    with torch.no_grad():  # start away from the target's layer so there is something to learn
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def test_trainer_lowers_the_loss(corpus, tmp_path):
    recipe = _recipe(corpus)
    model = _model(corpus)
    first_batch = recipe.batches(0, 0)[0]
    with torch.no_grad():
        before = float(recipe.loss(model, first_batch)[0])
    result = train(model, recipe, TrainConfig(steps=40, lr=3e-3, warmup_steps=3, bf16=False, log_every=5),
                   tmp_path, progress=False)
    with torch.no_grad():
        after = float(recipe.loss(model, first_batch)[0])
    assert after < 0.7 * before
    assert result.steps == 40 and result.curve[-1]["step"] == 40
    assert {"mean_accepted_length", "acceptance_by_position", "top1_agreement"} <= set(result.validation)
    log = (tmp_path / "train_log.jsonl").read_text().splitlines()
    assert json.loads(log[-1])["final_validation"] == result.validation


def test_recipe_loss_follows_its_distill_option(corpus):
    """The TV term reaches the recipe's loss: a mix is the mix of the two losses (tests/training/test_losses.py
    checks the term itself and that training with it lowers held-out TV)."""
    _, out, vocab = corpus
    model, losses = _model(corpus), {}
    for weight in (0.0, 0.5, 1.0):
        config = DraftRecipeConfig(batch_tokens=64, max_length=16, validation_every=4,
                                   distill=DistillLoss(tv_weight=weight, tv_temperatures=(0.7, 1.0)))
        recipe = DraftLMRecipe(out, vocab, config)
        with torch.no_grad():
            losses[weight] = float(recipe.loss(model, recipe.batches(0, 0)[0])[0])
    assert 0.0 < losses[1.0] <= 1.0 < losses[0.0]  # a mean TV, a cross-entropy over 96 tokens
    assert losses[0.5] == pytest.approx((losses[0.0] + losses[1.0]) / 2, rel=1e-5)


def test_trainer_resumes_exactly(corpus, tmp_path):
    recipe = _recipe(corpus)
    straight = _model(corpus)
    train(straight, recipe, TrainConfig(steps=6, warmup_steps=2, bf16=False), tmp_path / "a", progress=False)
    resumed = _model(corpus)
    config = TrainConfig(steps=6, warmup_steps=2, bf16=False, checkpoint_every=4)
    paused = train(resumed, recipe, config, tmp_path / "b", progress=False, pause_after=3)
    assert paused.steps == 3
    fresh = _model(corpus, seed=1)  # a new process would start from other weights: they must be restored
    train(fresh, recipe, config, tmp_path / "b", progress=False)
    for (name, a), (_, b) in zip(straight.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), name


def test_learning_rate_schedule():
    config = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert learning_rate(0, 100, config) == pytest.approx(0.1)
    assert learning_rate(9, 100, config) == pytest.approx(1.0)
    assert learning_rate(100, 100, config) == pytest.approx(0.1)
    assert learning_rate(55, 100, config) == pytest.approx(0.55)
    with pytest.raises(ConfigError):
        TrainConfig()
    with pytest.raises(ConfigError):
        TrainConfig(steps=3, minutes=1.0)


def test_minutes_budget_becomes_a_step_count(corpus, tmp_path):
    result = train(_model(corpus), _recipe(corpus), TrainConfig(minutes=0.02, calibrate_steps=2, bf16=False),
                   tmp_path, progress=False)
    assert result.steps >= 2 and result.seconds < 30


def _ddp_worker(rank: int, world: int, port: int, out: str, corpus_dir: str, result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    torch.set_num_threads(1)
    target = make_target("llama")
    vocab = read_vocab(corpus_dir)
    recipe = DraftLMRecipe(corpus_dir, vocab, DraftRecipeConfig(batch_tokens=64, max_length=16, validation_every=4))
    torch.manual_seed(rank)  # different starting weights per rank: DDP must broadcast rank 0's
    model = DraftLM(target, DraftLMConfig(init_layers=(0,), draft_vocab_size=VOCAB_D), vocab).float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    join_process_group()
    precision_flag = rank0_decides(rank == 0)  # a timed choice such as --precision auto: rank 0's holds
    train(model, recipe, TrainConfig(steps=3, warmup_steps=1, bf16=False), out, progress=False)
    torch.save({k: v.detach() for k, v in model.state_dict().items()}, Path(result_dir) / f"rank{rank}.pt")
    torch.save(torch.tensor(precision_flag), Path(result_dir) / f"flag{rank}.pt")
    torch.distributed.destroy_process_group()


def read_vocab(corpus_dir) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(Path(corpus_dir) / "draft_vocab.safetensors"))["vocab"]


def test_ddp_two_gloo_processes_train_in_step(corpus, tmp_path):
    _, out, _ = corpus
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, port, str(tmp_path / "run"), str(out), str(tmp_path)), nprocs=2, join=True)
    zero, one = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    for name in zero:
        assert torch.equal(zero[name], one[name]), name
    state = torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)
    assert state["progress"]["step"] == 3
    assert [bool(torch.load(tmp_path / f"flag{r}.pt")) for r in (0, 1)] == [True, True]


# ----------------------------------------------------------------------------------- checkpoints


def _save_draft(target, model, path):
    tensors = {**model.trainable_state_dict(), "draft_vocab": model.vocab.to(torch.int32)}
    save_checkpoint(DrafterCheckpoint("draft", model.architecture(), target.name, target_fingerprint(target),
                                      tensors, {"recipe": "test"}, {"tau": 1.0}), path)


def test_checkpoint_round_trip_gives_identical_outputs(tmp_path):
    target = make_target("gemma3")
    vocab = torch.randperm(128, generator=torch.Generator().manual_seed(0))[:VOCAB_D]
    model = DraftLM(target, DraftLMConfig(init_layers=(1, 0), draft_vocab_size=VOCAB_D), vocab).double()
    with torch.no_grad():  # bf16 storage: round the weights first so the round trip is exact
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).double())
    _save_draft(target, model, tmp_path / "d")
    loaded = load_draft_lm(tmp_path / "d", target)
    ids = random_prompt(12)[None]
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))
    assert torch.equal(loaded.vocab, vocab)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["target"] == {"name": target.name, "fingerprint": target_fingerprint(target)}
    assert config["architecture"]["layer_types"] == ["full_attention", "sliding_attention"]
    stored = load_checkpoint(tmp_path / "d", target).tensors
    assert all(t.dtype == torch.bfloat16 for k, t in stored.items() if k != "draft_vocab")
    assert not any("embed" in k for k in stored), "the borrowed embedding must not be stored"


def test_borrowed_target_layers_are_shared_frozen_and_not_stored(tmp_path):
    target = make_target("gemma3")
    model = DraftLM(target, DraftLMConfig(init_layers=(-1,), draft_vocab_size=128, borrowed_layers=1),
                    torch.arange(128)).double()
    assert model.decoder.layers[0] is target.model.get_decoder().layers[0]
    assert not any(p.requires_grad for p in model.decoder.layers[0].parameters())
    assert not any(k.startswith("decoder.layers.0.") for k in model.trainable_state_dict())
    assert model.decoder_config.layer_types == ["sliding_attention", "full_attention"]
    ids = random_prompt(12)[None]
    with torch.no_grad():  # own layer = the target's last one: the draft is exactly the target
        torch.testing.assert_close(model(ids), target.model(ids).logits, atol=1e-12, rtol=0)
    with torch.no_grad():
        for p in model.own_modules()[0].parameters():
            p.copy_((p + 0.1 * torch.randn_like(p)).to(torch.bfloat16).double())
    _save_draft(target, model, tmp_path / "d")
    loaded = load_draft_lm(tmp_path / "d", target)
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))
    from transformers import AutoModelForCausalLM

    from specwise.models.export import export_hf

    export_hf(loaded, target, tmp_path / "hf", dtype=torch.float64)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, loaded(ids), atol=1e-5, rtol=1e-5)
    drafter = DraftModelDrafter(target, DraftModelConfig(num_draft_tokens=3, confidence_threshold=0.0),
                                draft_model=loaded)
    target.eos_token_ids = frozenset()
    prompt = random_prompt(15, seed=7)
    result = specwise.generate(target, prompt, drafter=drafter, max_new_tokens=20)
    assert result.token_ids == reference_greedy(target.model, prompt, 20)


def test_a_drafter_for_another_target_is_refused_naming_both(tmp_path):
    target = make_target("llama")
    model = DraftLM(target, DraftLMConfig(init_layers=(0,), draft_vocab_size=8), torch.arange(8))
    _save_draft(target, model, tmp_path / "d")
    other = make_target("llama", vocab_size=120)
    other.name = "other-model"
    with pytest.raises(DrafterError, match=r"trained for target 'tiny-llama-0'.*target is 'other-model'"):
        specwise.load_drafter(tmp_path / "d", other)
    assert isinstance(specwise.load_drafter(tmp_path / "d", target, num_draft_tokens=3), DraftModelDrafter)
    with pytest.raises(DrafterError, match="trained for target"):
        specwise.generate(other, [5, 6, 7], method="draft", drafter=str(tmp_path / "d"), max_new_tokens=2)
    with pytest.raises(DrafterError, match="float32 on cpu but the target"):
        DraftModelDrafter(target, DraftModelConfig(), draft_model=model.float())
    (tmp_path / "d" / "model.safetensors").unlink()
    with pytest.raises(DrafterError, match="no weights"):
        load_drafter(tmp_path / "d", target)
    with pytest.raises(DrafterError, match="not a drafter directory: config.json is missing"):
        load_drafter(tmp_path, target)


def test_fingerprint_sees_the_tokenizer():
    a, b = make_target("llama"), make_target("llama", seed=3)
    assert target_fingerprint(a) == target_fingerprint(b)  # same shapes and tokenizer, other weights
    from conftest import make_tokenizer

    b.tokenizer = make_tokenizer(128)
    b.tokenizer.add_tokens(["zzz"])
    assert target_fingerprint(a) != target_fingerprint(b)


def test_the_fingerprint_is_hashed_once_per_target_and_tokenizer(monkeypatch):
    from specwise.drafters import checkpoint

    target, calls = make_target("llama"), []
    real = checkpoint._fingerprint
    monkeypatch.setattr(checkpoint, "_fingerprint", lambda t: calls.append(1) or real(t))
    first = target_fingerprint(target)
    assert target_fingerprint(target) == first and len(calls) == 1  # every drafter built for it asks
    target.tokenizer.add_tokens(["zzz"])  # the vocabulary grew: hashed again
    assert target_fingerprint(target) != first and len(calls) == 2


# ---------------------------------------------------------------------------- the draft-LM route


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("k, threshold", [(1, 0.0), (4, 0.0), (6, 0.5)])
def test_draft_lm_route_is_greedy_equivalent(arch, k, threshold):
    target = make_target(arch, eos=())
    vocab = torch.randperm(128, generator=torch.Generator().manual_seed(1))[:VOCAB_D]
    model = DraftLM(target, DraftLMConfig(init_layers=(0, 1), draft_vocab_size=VOCAB_D), vocab).double().eval()
    drafter = DraftModelDrafter(target, DraftModelConfig(num_draft_tokens=k, confidence_threshold=threshold),
                                draft_model=model.requires_grad_(False))
    prompt = random_prompt(20, seed=4)
    result = specwise.generate(target, prompt, drafter=drafter, max_new_tokens=30)
    assert result.token_ids == reference_greedy(target.model, prompt, 30)
    assert 0 < result.stats.accepted_tokens <= result.stats.drafted_tokens


def test_confidence_threshold_shortens_chains():
    target = make_target("llama", eos=())
    vocab = torch.arange(128)
    model = DraftLM(target, DraftLMConfig(init_layers=(0,), draft_vocab_size=128), vocab).double().eval()
    model.requires_grad_(False)
    prompt = random_prompt(20, seed=4)
    drafted = []
    for threshold in (0.0, 0.9):
        drafter = DraftModelDrafter(target, DraftModelConfig(num_draft_tokens=6, confidence_threshold=threshold),
                                    draft_model=model)
        result = specwise.generate(target, prompt, drafter=drafter, max_new_tokens=20)
        assert result.token_ids == reference_greedy(target.model, prompt, 20)
        drafted.append(result.stats.drafted_tokens / result.stats.target_forwards)
    assert drafted[1] < drafted[0]


def test_export_hf_gives_the_same_predictions(tmp_path):
    from transformers import AutoModelForCausalLM

    from specwise.models.export import export_hf

    for arch in ("llama", "gemma3"):
        target = make_target(arch)
        model = DraftLM(target, DraftLMConfig(init_layers=(1,), draft_vocab_size=128), torch.arange(128)).double()
        export_hf(model, target, tmp_path / arch, dtype=torch.float64)
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / arch, dtype=torch.float64)
        ids = random_prompt(10)[None]
        with torch.no_grad():
            torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-5, rtol=1e-5)  # eager vs sdpa softmax
        # HF assisted generation runs with it
        out = target.model.generate(ids, assistant_model=hf, max_new_tokens=5, do_sample=False)
        assert out[0, 10:].tolist() == reference_greedy(target.model, ids[0], 5)


# ------------------------------------------------------------------------------------ the CLI


def test_cli_builds_trains_and_generates_end_to_end(tmp_path):
    target = make_target("llama")
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": r.id, "category": r.category, "prompt": r.prompt}) + "\n"
                               for r in _records(10)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = lambda *args: subprocess.run([sys.executable, "-m", "specwise.cli", *args], env=env,  # noqa: E731
                                       capture_output=True, text=True, timeout=300)
    common = ["--target", str(tmp_path / "target"), "--dtype", "float32"]
    built = run("data", "build", *common, "--data", str(prompts), "--out", str(tmp_path / "corpus"),
                "--new-tokens", "8", "--batch-size", "4")
    assert built.returncode == 0, built.stderr
    trained = run("train", "draft", *common, "--data", str(tmp_path / "corpus"), "--out", str(tmp_path / "draft"),
                  "--steps", "3", "--draft-vocab-size", "64", "--init-layers", "0", "--batch-tokens", "64", "--top-k", "4",
                  "--precision", "fp32")
    assert trained.returncode == 0, trained.stderr
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["method"] == "draft" and config["recipe"]["steps"] == 3
    assert config["recipe"]["optimizer"]["bf16"] is False and "training in fp32" in trained.stderr
    assert (tmp_path / "draft" / "training_curve.png").stat().st_size > 0
    generated = run("generate", *common, "--method", "draft", "--drafter", str(tmp_path / "draft"), "--json",
                    "--max-new-tokens", "6", "t5 t9 t11")
    assert generated.returncode == 0, generated.stderr
    ids = target.encode("t5 t9 t11")
    assert json.loads(generated.stdout)["token_ids"] == reference_greedy(target.model.float(), ids.cpu(), 6)
    eagle = run("train", "eagle", *common, "--data", str(tmp_path / "corpus"), "--out", str(tmp_path / "eagle"),
                "--steps", "3", "--draft-vocab-size", "64", "--batch-tokens", "64", "--top-k", "4", "--ttt-steps", "2")
    assert eagle.returncode == 0, eagle.stderr
    assert json.loads((tmp_path / "eagle" / "config.json").read_text())["architecture"]["feature_layers"] == [0, 1, 2]
    assert (tmp_path / "corpus" / "features-taps-0-1-2").is_dir()  # beside the draft recipe's features
    continued = run("train", "eagle", *common, "--data", str(tmp_path / "corpus"), "--out", str(tmp_path / "eagle2"),
                    "--steps", "1", "--lr", "1e-12", "--draft-vocab-size", "64", "--batch-tokens", "64", "--top-k", "4",
                    "--ttt-steps", "2", "--init-from", str(tmp_path / "eagle"), "--tv-weight", "0.5")
    assert continued.returncode == 0, continued.stderr
    # continued training labels its features with the starting drafter's vocabulary, in their own directory
    assert any(p.name.startswith("features-taps-0-1-2-vocab-") for p in (tmp_path / "corpus").iterdir())
    before, after = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("eagle", "eagle2"))
    # lr ~ 0: unchanged up to a step of ~1e-12 on weights that start at exactly 0 (stored in bf16)
    assert before.keys() == after.keys() and all(torch.allclose(before[k].float(), after[k].float(), atol=1e-9, rtol=0)
                                                 for k in before)
    record = json.loads((tmp_path / "eagle2" / "config.json").read_text())["recipe"]
    assert record["init_from"]["path"] == str(tmp_path / "eagle") and record["init_from"]["recipe"]["steps"] == 3
    generated = run("generate", *common, "--method", "eagle", "--drafter", str(tmp_path / "eagle"), "--json",
                    "--max-new-tokens", "6", "t5 t9 t11")
    assert generated.returncode == 0, generated.stderr
    assert json.loads(generated.stdout)["token_ids"] == reference_greedy(target.model.float(), ids.cpu(), 6)
    medusa = run("train", "medusa", *common, "--data", str(tmp_path / "corpus"), "--out", str(tmp_path / "medusa"),
                 "--steps", "3", "--draft-vocab-size", "64", "--batch-tokens", "64", "--top-k", "4", "--num-heads", "2",
                 "--precision", "bf16")
    assert medusa.returncode == 0, medusa.stderr
    assert json.loads((tmp_path / "medusa" / "config.json").read_text())["recipe"]["optimizer"]["bf16"] is True
    architecture = json.loads((tmp_path / "medusa" / "config.json").read_text())["architecture"]
    assert architecture["num_heads"] == 2 and architecture["tree"]["default_nodes"] >= 1
    assert (tmp_path / "corpus" / "features-taps-2").is_dir()
    generated = run("generate", *common, "--method", "medusa", "--drafter", str(tmp_path / "medusa"), "--json",
                    "--max-new-tokens", "6", "t5 t9 t11")
    assert generated.returncode == 0, generated.stderr
    assert json.loads(generated.stdout)["token_ids"] == reference_greedy(target.model.float(), ids.cpu(), 6)
    dflash = run("train", "dflash", *common, "--data", str(tmp_path / "corpus"), "--out", str(tmp_path / "dflash"),
                 "--steps", "3", "--draft-vocab-size", "64", "--batch-tokens", "64", "--top-k", "4", "--block-size", "4",
                 "--dflash-layers", "1")
    assert dflash.returncode == 0, dflash.stderr
    architecture = json.loads((tmp_path / "dflash" / "config.json").read_text())["architecture"]
    assert architecture["block_size"] == 4 and architecture["feature_layers"] == [0, 1, 2]  # eagle's features reused
    generated = run("generate", *common, "--method", "dflash", "--drafter", str(tmp_path / "dflash"), "--json",
                    "--max-new-tokens", "6", "t5 t9 t11")
    assert generated.returncode == 0, generated.stderr
    assert json.loads(generated.stdout)["token_ids"] == reference_greedy(target.model.float(), ids.cpu(), 6)
    exported = run("export-hf", str(tmp_path / "draft"), *common[:2], "--out", str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "hf" / "config.json").exists()
    wrong = run("train", "dflash", *common, "--data", str(tmp_path / "corpus"), "--out", str(tmp_path / "x"),
                "--steps", "1", "--draft-vocab-size", "64", "--init-from", str(tmp_path / "eagle"))
    assert wrong.returncode == 2 and "holds a 'eagle' drafter, not a 'dflash' one" in wrong.stderr
    bad = run("train", "nonsense", *common, "--data", str(tmp_path / "corpus"), "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "no training recipe" in bad.stderr


def test_hf_assisted_peer_runs_a_specwise_draft_lm(tmp_path):
    from specwise.lab.bench.contenders import hf_peer_specs, load_assistant, parse_contender

    assert hf_peer_specs(["ar", "draft"])[-1] == "hf-assisted[assistant=default]"
    assert hf_peer_specs(["draft[drafter=/x]"])[-1] == "hf-assisted[assistant=/x]"
    target = make_target("llama", eos=())
    model = DraftLM(target, DraftLMConfig(init_layers=(1,), draft_vocab_size=64), torch.arange(64)).double()
    _save_draft(target, model, tmp_path / "d")
    assistant = load_assistant(target, str(tmp_path / "d"))
    assert assistant.get_output_embeddings().weight.shape[0] == 128  # the full vocabulary, materialized
    peer = parse_contender(target, f"hf-assisted[assistant={tmp_path / 'd'}]")
    prompt = random_prompt(12, seed=2)
    assert peer.run(prompt, 8).token_ids == reference_greedy(target.model, prompt, 8)
    with pytest.raises(DrafterError, match="no draft LM ships"):
        load_assistant(target, "default")


def test_cli_draft_without_a_drafter_uses_the_shipped_one_or_fails_fast(capsys):
    from specwise.cli import main
    from specwise.drafters.checkpoint import shipped_drafter

    assert shipped_drafter("gemma-3-270m", "draft") is not None  # the default for the default target
    assert main(["generate", "--target", "/nonexistent/model", "--method", "draft", "hi"]) == 2
    assert "needs a draft model for /nonexistent/model" in capsys.readouterr().err
    assert main(["generate", "--method", "draft", "--drafter", "/nonexistent/draft", "hi"]) == 2
    assert "/nonexistent/draft does not exist" in capsys.readouterr().err
    assert main(["generate", "--target", "/nonexistent/model", "--method", "eagle", "hi"]) == 2
    assert "method 'eagle' needs a trained drafter for /nonexistent/model" in capsys.readouterr().err


# ------------------------------------------------------------------------- options and registry

#: the defaults `specwise train METHOD` had before the options dataclasses (the commands in the
#: reports rely on them)
_FLAG_DEFAULTS = {
    "draft": {"lr": 5e-4, "batch_tokens": 4096, "draft_vocab_size": 32768, "init_layers": (0, -1), "minutes": 45.0,
              "borrowed_layers": 0, "loss_on": "all"},
    "eagle": {"lr": 8e-4, "batch_tokens": 4096, "draft_vocab_size": 16384, "minutes": 45.0, "ttt_steps": 3,
              "max_length": 1024, "loss_on": "all", "feature_layers": None, "arch": "specwise"},
    "medusa": {"lr": 1e-3, "batch_tokens": 2048, "draft_vocab_size": 16384, "minutes": 30.0, "num_heads": 4,
               "medusa_layers": 1, "loss_on": "all", "arch": "specwise"},
    "dflash": {"lr": 8e-4, "batch_tokens": 2048, "draft_vocab_size": 16384, "minutes": 45.0, "block_size": 8,
               "dflash_layers": 2, "max_length": 1024, "loss_on": "all", "feature_layers": None, "arch": "specwise"},
}
_COMMON_DEFAULTS = {"steps": None, "grad_accum": 1, "top_k": 8, "validate_every": 100, "seed": 0, "init_from": None,
                    "precision": "auto", "tv_weight": 0.0, "tv_temperatures": (0.7,)}


@pytest.mark.parametrize("method", sorted(_FLAG_DEFAULTS))
def test_recipe_options_keep_the_cli_defaults_and_every_field_has_help(method):
    spec = get_recipe(method)
    options = spec.options_cls()
    assert dataclasses.asdict(options) == {**_COMMON_DEFAULTS, **_FLAG_DEFAULTS[method]}
    assert all(f.metadata.get("help") for f in dataclasses.fields(options))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.lr = 1.0


def test_recipes_are_discovered_and_the_registry_refuses_duplicates_and_unknown_names():
    assert recipe_names() == ["dflash", "draft", "eagle", "medusa"]
    assert get_recipe("eagle").train.__module__ == "specwise.methods.eagle.recipe"
    with pytest.raises(ConfigError, match=r"no training recipe for 'nonsense'; available: dflash, draft, eagle"):
        get_recipe("nonsense")
    with pytest.raises(ValueError, match="already registered"):
        RECIPES.register("eagle", TrainOptions, "again")(lambda job, options: job.out)
    with pytest.raises(ValueError, match="TrainOptions dataclass"):
        RecipeRegistry().register("x", dict, "not options")(lambda job, options: job.out)


def test_recipe_options_are_validated():
    with pytest.raises(ConfigError, match="ttt_steps"):
        get_recipe("eagle").options_cls(ttt_steps=0)
    with pytest.raises(ConfigError, match="loss_on"):
        get_recipe("draft").options_cls(loss_on="prompt")
    with pytest.raises(ConfigError, match="block_size"):
        get_recipe("dflash").options_cls(block_size=1)
    for method in ("eagle", "medusa", "dflash"):
        with pytest.raises(ConfigError, match="arch must be specwise or standard"):
            get_recipe(method).options_cls(arch="vllm")
    with pytest.raises(ConfigError, match="precision"):
        get_recipe("medusa").options_cls(precision="fp16")
    for method in recipe_names():
        with pytest.raises(ConfigError, match="tv_weight"):
            get_recipe(method).options_cls(tv_weight=2.0)
    assert get_recipe("dflash").options_cls(tv_weight=0.5, tv_temperatures=(0.7, 1.0)).distill_loss() == \
        DistillLoss(0.5, (0.7, 1.0))
    with pytest.raises(ConfigError, match="no training option colour"):
        make_options(get_recipe("medusa").options_cls, {"colour": 1})


def _parse_train(*argv):
    parser = build_parser()
    return parser.parse_args(["train", *argv, "--data", "c", "--out", "o"])


def test_train_flags_are_generated_from_the_options_with_option_key_value():
    args = _parse_train("eagle", "--lr", "3e-4", "--feature-layers", "2,9,15", "--steps", "5",
                        "--option", "max_length=512", "--option", "loss-on=generated")
    options = options_from_args(get_recipe("eagle").options_cls, args)
    assert (options.lr, options.feature_layers, options.steps, options.max_length, options.loss_on) == \
        (3e-4, (2, 9, 15), 5, 512, "generated")
    assert options.ttt_steps == 3 and options.minutes == 45.0  # untouched fields keep their defaults
    draft = options_from_args(get_recipe("draft").options_cls, _parse_train("draft", "--init-layers=-1"))
    assert draft.init_layers == (-1,)
    medusa = options_from_args(get_recipe("medusa").options_cls,
                               _parse_train("medusa", "--tv-weight", "0.5", "--tv-temperatures", "0.7,1.0"))
    assert medusa.distill_loss() == DistillLoss(0.5, (0.7, 1.0))
    with pytest.raises(ConfigError, match="given twice"):
        options_from_args(get_recipe("eagle").options_cls, _parse_train("eagle", "--lr", "1e-3", "--option", "lr=2e-3"))
    with pytest.raises(ConfigError, match="no training option"):
        options_from_args(get_recipe("eagle").options_cls, _parse_train("eagle", "--option", "num_heads=3"))
    with pytest.raises(SystemExit):  # one budget only
        _parse_train("medusa", "--minutes", "3", "--steps", "4")
    with pytest.raises(SystemExit):  # a flag of another recipe
        _parse_train("draft", "--ttt-steps", "2")


def test_train_help_shows_each_recipes_flags_and_defaults(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "medusa", "--help"])
    text = capsys.readouterr().out
    assert "--num-heads" in text and "--ttt-steps" not in text and "(default: 30.0)" in text
