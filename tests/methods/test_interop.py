"""Drafters in the public formats (speculators, SpecForge, FasterDecoding Medusa): export, import, checks.

Round trips (ours -> format -> ours) must give the same draft logits in float64; independently,
checkpoints built here *in each format* must import to a head whose outputs equal a reference
forward written in this file from the format's definition (never by calling specwise's models).
"""

from __future__ import annotations

import json
import math
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import specwise
from conftest import ARCHS, interop_python, make_target, random_prompt, reference_greedy
from specwise.drafters.export import export_drafter
from specwise.drafters.trained import ImportCanary
from specwise.engine.loop import speculative_generate
from specwise.engine.sampling import SamplingConfig
from specwise.engine.types import StepFeedback
from specwise.errors import DrafterError
from specwise.interop.formats import detect
from specwise.interop.vocab import from_d2t, to_tables
from specwise.methods.dflash.interop import export_dflash, read_dflash
from specwise.methods.dflash.network import DFlashConfig, DFlashModel
from specwise.methods.eagle.drafter import EagleDrafter, EagleDrafterConfig, load_eagle_head
from specwise.methods.eagle.interop import export_eagle3, read_eagle3
from specwise.methods.eagle.network import STANDARD_ARCHITECTURE, EagleConfig, EagleHead
from specwise.methods.medusa.drafter import load_medusa_heads
from specwise.methods.medusa.interop import export_medusa, read_medusa
from specwise.methods.medusa.network import MedusaConfig, MedusaHeads

LAYERS = (0, 1, 2)
VOCAB_D = 96


def make_head(target, seed: int = 0, vocab: torch.Tensor | None = None, **arch) -> EagleHead:
    """A random float64 head with live residual branches, in specwise's or another architecture."""
    torch.manual_seed(seed)
    vocab = torch.randperm(target.vocab_size)[:VOCAB_D] if vocab is None else vocab
    config = EagleConfig(**{"feature_layers": LAYERS, "draft_vocab_size": vocab.numel(), "num_heads": 2,
                            "head_dim": 16, "intermediate_size": 64, "window": 64, **arch})
    head = EagleHead(target, config, vocab).double()
    with torch.no_grad():
        for p in (head.o_proj.weight, head.down_proj.weight):
            p.normal_(std=0.2)
        for module in head.modules():
            if isinstance(module, torch.nn.RMSNorm):
                module.weight.uniform_(0.5, 1.5)  # non-trivial gains: a swapped norm shows
    return head.eval().requires_grad_(False)


def features_of(target, ids: torch.Tensor, layers=LAYERS) -> torch.Tensor:
    """``[T, F*H]`` the target's hidden states at ``layers`` over ``ids``."""
    out = target.model(input_ids=ids[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)


def full_logits(head: EagleHead, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits ``[..., Vd]`` scattered onto the target's vocabulary (-inf elsewhere)."""
    out = torch.full((*logits.shape[:-1], vocab_size), float("-inf"), dtype=logits.dtype)
    out[..., head.vocab] = logits
    return out


def chain_logits(head: EagleHead, target, ids: torch.Tensor, steps: int = 3) -> list[torch.Tensor]:
    """The head's training-time-test logits over ``ids`` on the target vocabulary, per step."""
    features = features_of(target, ids[:-steps], head.config.feature_layers)
    outs = head.unroll(features[None], ids[1:][None], steps)
    return [full_logits(head, o[0], target.vocab_size) for o in outs]


# ---------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", ["specwise", "standard", "gqa-normed-residual"])
@pytest.mark.parametrize("fmt", ["speculators", "eagle3"])
def test_round_trip_gives_the_same_draft_logits(tmp_path, arch, variant, fmt):
    target = make_target(arch)
    extra = {"specwise": {}, "standard": STANDARD_ARCHITECTURE,
             "gqa-normed-residual": {**STANDARD_ARCHITECTURE, "num_kv_heads": 1, "norm_before_residual": True}}[variant]
    head = make_head(target, **extra)
    exported = export_eagle3(head, target, tmp_path / "out", fmt, dtype=torch.float64, unbounded_attention=True)
    assert detect(exported.path).method == "eagle"
    imported = read_eagle3(exported.path, target)
    assert imported.origin is not None and imported.config.feature_layers == LAYERS
    ids = random_prompt(24, seed=3)  # within the window: the SpecForge copy of a windowed head is unbounded
    for ours, theirs in zip(chain_logits(head, target, ids), chain_logits(imported, target, ids)):
        torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)
    config = json.loads((exported.path / "config.json").read_text())
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "draft_vocab_size",
                 "eagle_aux_hidden_state_layer_ids", "target_hidden_size"):
        assert flag in config, flag  # every flag explicit: runtimes disagree on the defaults
    if fmt == "speculators":
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
        assert config["speculators_config"]["verifier"]["name_or_path"]
        assert config["transformer_layer_config"]["vocab_size"] == target.vocab_size
    else:  # SGLang reads the nested copy as outputs of layer k
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in LAYERS]


def test_a_windowed_head_keeps_its_window_in_speculators_and_is_refused_by_specforge(tmp_path):
    target = make_target("gemma3")
    head = make_head(target, window=8)
    imported = read_eagle3(export_eagle3(head, target, tmp_path / "s", dtype=torch.float64).path, target)
    assert imported.config.window == 8
    ids = random_prompt(30, seed=5)  # longer than the window
    for ours, theirs in zip(chain_logits(head, target, ids), chain_logits(imported, target, ids)):
        torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)
    with pytest.raises(DrafterError, match="attends to at most 8"):
        export_eagle3(head, target, tmp_path / "e", "eagle3")


def test_caveats_name_what_each_runtime_cannot_run(tmp_path):
    target = make_target("gemma3")
    ours = export_eagle3(make_head(target), target, tmp_path / "a")
    assert any("SiLU" in c for c in ours.caveats) and any("fc_norm" in c for c in ours.caveats)
    assert any("llama.cpp" in c and "gemma3" in c for c in ours.caveats)
    assert ours.serve == {}  # no runtime runs a GELU head: no command to paste
    assert export_eagle3(make_head(target), target, tmp_path / "a2", "eagle3", unbounded_attention=True).serve == {}
    llama = make_target("llama")
    standard = export_eagle3(make_head(llama, **STANDARD_ARCHITECTURE), llama, tmp_path / "b")
    assert standard.caveats == []
    assert set(standard.serve) == {"vllm", "llama.cpp"} and "--speculative-config" in standard.serve["vllm"]
    assert "--model-impl" not in standard.serve["vllm"]  # vLLM's own Llama class records the taps
    gemma = export_eagle3(make_head(target, **STANDARD_ARCHITECTURE), target, tmp_path / "g")
    assert gemma.serve["vllm"].endswith("--model-impl transformers")  # its own Gemma-3 class does not
    sglang = export_eagle3(make_head(llama, **STANDARD_ARCHITECTURE), llama, tmp_path / "c", "eagle3")
    assert set(sglang.serve) == {"sglang"} and "EAGLE3" in sglang.serve["sglang"]
    # the weights are as readable as the config (a server may run as another user)
    mode = lambda name: (sglang.path / name).stat().st_mode & 0o777  # noqa: E731
    assert mode("model.safetensors") == mode("config.json")


def test_vocabulary_tables_follow_the_offset_convention():
    vocab = torch.tensor([7, 2, 9, 4])
    order, d2t, t2d = to_tables(vocab, 12)
    assert vocab[order].tolist() == [2, 4, 7, 9]
    assert (torch.arange(4) + d2t).tolist() == [2, 4, 7, 9]  # target id = draft id + d2t[draft id]
    assert t2d.nonzero().flatten().tolist() == [2, 4, 7, 9]
    assert from_d2t(d2t, 4, 12, "x").tolist() == [2, 4, 7, 9]


# ---------------------------------------------------------------------------------------- independent reference


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotate-half rotary embedding; ``x`` ``[T, heads, d]``."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.cat([positions[:, None].double() * inv] * 2, dim=-1)[:, None, :]
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * angles.cos() + half * angles.sin()


def reference_eagle3(w: dict, cfg: dict, feats: torch.Tensor, ids: torch.Tensor, prefix: str) -> torch.Tensor:
    """EAGLE-3 step-0 logits over the target vocabulary by the format's definition (speculators'
    Eagle3 first layer / SpecForge's LlamaDecoderLayer): ``[T, V]``.

    ``feats`` ``[T, 3H]`` concatenated raw taps, ``ids`` ``[T]`` the token after each position.
    """
    eps, heads, kv, d = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta = cfg["rope_theta"]
    g = feats @ w["fc.weight"].T
    emb = w["embed_tokens.weight"][ids]
    e = _rms(emb, w[prefix + "input_layernorm.weight"], eps)
    h = _rms(g, w[prefix + "hidden_norm.weight"], eps)
    residual = h if cfg.get("norm_before_residual") else g
    x = torch.cat([e, h], dim=-1)
    t = x.shape[0]
    pos = torch.arange(t)
    q = _rope((x @ w[prefix + "self_attn.q_proj.weight"].T).view(t, heads, d), pos, theta)
    k = _rope((x @ w[prefix + "self_attn.k_proj.weight"].T).view(t, kv, d), pos, theta)
    v = (x @ w[prefix + "self_attn.v_proj.weight"].T).view(t, kv, d)
    k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, heads * d)
    h1 = residual + attn @ w[prefix + "self_attn.o_proj.weight"].T
    m = _rms(h1, w[prefix + "post_attention_layernorm.weight"], eps)
    out = h1 + (F.silu(m @ w[prefix + "mlp.gate_proj.weight"].T) * (m @ w[prefix + "mlp.up_proj.weight"].T)) \
        @ w[prefix + "mlp.down_proj.weight"].T
    logits = _rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T  # [T, Vd]
    full = torch.full((t, cfg["vocab_size"]), float("-inf"), dtype=torch.float64)
    full[:, torch.arange(logits.shape[1]) + w["d2t"]] = logits
    return full


def write_public_eagle3(path: Path, target, fmt: str, *, taps=(0, 1, 2), kv_heads: int = 1, seed: int = 0,
                        norm_before_residual: bool = True, d2t_shift: int = 0, **overrides) -> tuple[dict, dict]:
    """A random EAGLE-3 checkpoint written the way speculators / SpecForge write one (float64)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = target.model.config.hidden_size
    vocab_size, heads, d, inter, vd = target.vocab_size, 4, 8, 48, 80
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    rand = lambda *shape, s=0.2: torch.randn(*shape, generator=gen, dtype=torch.float64) * s  # noqa: E731
    ids = torch.randperm(vocab_size, generator=gen)[:vd].sort().values
    w = {"embed_tokens.weight": rand(vocab_size, hidden, s=1.0), "fc.weight": rand(hidden, 3 * hidden),
         "norm.weight": 1 + rand(hidden), "lm_head.weight": rand(vd, hidden, s=1.0),
         "d2t": ids - torch.arange(vd) + d2t_shift, "t2d": torch.zeros(vocab_size, dtype=torch.bool)}
    w["t2d"][ids] = True
    for name, shape in (("input_layernorm", (hidden,)), ("hidden_norm", (hidden,)),
                        ("post_attention_layernorm", (hidden,))):
        w[prefix + name + ".weight"] = 1 + rand(*shape)
    for name, shape in (("self_attn.q_proj", (heads * d, 2 * hidden)), ("self_attn.k_proj", (kv_heads * d, 2 * hidden)),
                        ("self_attn.v_proj", (kv_heads * d, 2 * hidden)), ("self_attn.o_proj", (hidden, heads * d)),
                        ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                        ("mlp.down_proj", (hidden, inter))):
        w[prefix + name + ".weight"] = rand(*shape)
    layer = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": hidden, "intermediate_size": inter,
             "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": d, "hidden_act": "silu",
             "rms_norm_eps": 1e-5, "vocab_size": vocab_size, "rope_theta": 5000.0, "tie_word_embeddings": False}
    if fmt == "speculators":
        config = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": layer, "draft_vocab_size": vd,
                  "norm_before_residual": norm_before_residual, "norm_before_fc": False, "fc_norm": False,
                  "norm_output": False, "eagle_aux_hidden_state_layer_ids": list(taps),
                  "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
                      {"proposal_type": "greedy", "speculative_tokens": 3}], "default_proposal_method": "greedy",
                      "verifier": {"name_or_path": "tiny"}}}
    else:  # SpecForge: flat, nested ids as outputs of layer k, no norm_before_residual
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": vd,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in taps]}}
        norm_before_residual = False
    config.update(overrides)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return w, {**layer, "norm_before_residual": norm_before_residual}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", ["speculators", "eagle3"])
def test_a_public_checkpoint_imports_to_the_formats_own_forward(tmp_path, arch, fmt):
    target = make_target(arch)
    taps = (1, 2, 0) if fmt == "speculators" else (1, 2, 2)
    w, cfg = write_public_eagle3(tmp_path / "head", target, fmt, taps=taps)
    head = read_eagle3(tmp_path / "head", target)
    assert head.config.feature_layers == taps
    ids = random_prompt(20, seed=7)
    feats = features_of(target, ids[:-1], taps)
    expected = reference_eagle3(w, cfg, feats, ids[1:], "layers.0." if fmt == "speculators" else "midlayer.")
    got = full_logits(head, head.unroll(feats[None], ids[1:][None], 1)[0][0], target.vocab_size)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.filterwarnings("ignore:the imported")  # a random head accepts nothing: the canary speaks
def test_greedy_with_an_imported_head_equals_plain_decoding(tmp_path, arch):
    target = make_target(arch, eos=(), attn_implementation="sdpa")
    write_public_eagle3(tmp_path / "head", target, "speculators")
    prompt = random_prompt(16, seed=2)
    tokens = specwise.generate(target, prompt, method="eagle", drafter_path=str(tmp_path / "head"),
                               max_new_tokens=24, depth=3, tree_top_k=4, total_tokens=8).token_ids
    assert tokens == reference_greedy(target.model, prompt, 24)
    # and a specwise head exported and re-imported drafts the same tokens as the original
    head = make_head(target, **STANDARD_ARCHITECTURE)
    exported = export_eagle3(head, target, tmp_path / "ours", dtype=torch.float64)
    config = EagleDrafterConfig(lookup_tokens=0, min_path_prob=0.0, depth=3, tree_top_k=4, total_tokens=8)
    runs = [speculative_generate(target, EagleDrafter(target, config, head=h), prompt, max_new_tokens=24,
                                 sampling=SamplingConfig()) for h in (head, read_eagle3(exported.path, target))]
    assert runs[0].token_ids == runs[1].token_ids == reference_greedy(target.model, prompt, 24)
    assert runs[0].stats.accepted_lengths == runs[1].stats.accepted_lengths


# ---------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("change,message", [
    ({"transformer_layer_config": None}, "transformer_layer_config"),
    ({"draft_vocab_size": None}, "draft_vocab_size"),
    ({"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}, "outside the target's hidden states"),
    ({"target_hidden_size": 4096}, "width 4096"),
    ({"norm_before_fc": True}, "norm_before_fc"),
])
def test_config_mismatches_are_refused_at_load_time(tmp_path, change, message):
    target = make_target("llama")
    write_public_eagle3(tmp_path / "head", target, "speculators", **change)
    with pytest.raises(DrafterError, match=message):
        read_eagle3(tmp_path / "head", target)


@pytest.mark.parametrize("layer_change,message", [
    ({"hidden_size": 128}, "hidden size 128"),
    ({"vocab_size": 32000}, "32000-token vocabulary"),
    ({"hidden_act": "relu"}, "activation 'relu'"),
])
def test_layer_mismatches_are_refused_at_load_time(tmp_path, layer_change, message):
    target = make_target("llama")
    write_public_eagle3(tmp_path / "head", target, "speculators")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    config["transformer_layer_config"].update(layer_change)
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterError, match=message):
        read_eagle3(tmp_path / "head", target)


def test_a_d2t_outside_the_target_vocabulary_is_refused(tmp_path):
    target = make_target("llama")
    write_public_eagle3(tmp_path / "head", target, "speculators", d2t_shift=target.vocab_size)
    with pytest.raises(DrafterError, match="outside the target's"):
        read_eagle3(tmp_path / "head", target)


def test_an_unknown_tensor_is_an_error_not_dropped(tmp_path):
    target = make_target("llama")
    write_public_eagle3(tmp_path / "head", target, "speculators")
    weights = load_file(str(tmp_path / "head" / "model.safetensors"))
    weights["layers.0.self_attn.k_norm.weight"] = torch.ones(8, dtype=torch.float64)
    save_file(weights, str(tmp_path / "head" / "model.safetensors"))
    with pytest.raises(DrafterError, match="k_norm"):
        read_eagle3(tmp_path / "head", target)


def test_an_eagle3_head_given_to_another_method_is_refused(tmp_path):
    target = make_target("llama")
    write_public_eagle3(tmp_path / "head", target, "speculators")
    with pytest.raises(DrafterError, match="--method eagle"):
        load_medusa_heads(tmp_path / "head", target)
    with pytest.raises(DrafterError, match="--method eagle"):
        specwise.generate(target, random_prompt(8), method="medusa", drafter_path=str(tmp_path / "head"),
                          max_new_tokens=4)
    assert isinstance(load_eagle_head(tmp_path / "head", target), EagleHead)


def test_export_refuses_a_method_format_or_output_it_cannot_write(tmp_path):
    target = make_target("llama")
    write_public_eagle3(tmp_path / "head", target, "speculators")
    with pytest.raises(DrafterError, match="eagle drafters export to speculators or eagle3, not medusa"):
        export_drafter(target, tmp_path / "out", "medusa", path=tmp_path / "head")
    with pytest.raises(DrafterError, match="no eagle drafter ships"):
        export_drafter(target, tmp_path / "out", method="eagle")
    with pytest.raises(DrafterError, match="method 'ar' has no trained drafter to export"):
        export_drafter(target, tmp_path / "out", method="ar")
    with pytest.raises(DrafterError, match="does not exist"):
        export_drafter(target, tmp_path / "out", path=tmp_path / "nowhere")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{not json")
    with pytest.raises(DrafterError, match="no drafter of a known format"):
        export_drafter(target, tmp_path / "out", path=tmp_path / "junk")
    (tmp_path / "afile").write_text("x")
    for out, message in ((tmp_path / "afile", "is a file"), (tmp_path / "afile" / "sub", "cannot create"),
                         (tmp_path / "junk", "already holds files")):
        with pytest.raises(DrafterError, match=message):
            export_drafter(target, out, path=tmp_path / "head", dtype=torch.float64)
    # an imported head re-exports (speculators -> SpecForge)
    out = export_drafter(target, tmp_path / "sgl", "eagle3", path=tmp_path / "head", dtype=torch.float64)
    assert detect(out.path).name == "eagle3"


# ---------------------------------------------------------------------------------------- canary


def _feedback(accepted: int, drafted: int = 4) -> StepFeedback:
    return StepFeedback(torch.arange(4), num_drafted=drafted, num_accepted=accepted, cache_length=3)


def test_the_canary_warns_once_when_almost_nothing_is_accepted():
    canary = ImportCanary("speculators (EAGLE-3)", steps=10, min_rate=0.2)  # warns below 2 tokens in 10 steps
    with pytest.warns(UserWarning, match="had 1 draft tokens accepted in its first 10 greedy steps"):
        for accepted in (1, *[0] * 9):
            canary.observe(_feedback(accepted, drafted=4 if accepted else 0))  # steps without drafts count
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        canary.observe(_feedback(0))  # once only
        happy = ImportCanary("x", steps=10, min_rate=0.2)
        for accepted in (0, 1, 0, 1, *[0] * 10):
            happy.observe(_feedback(accepted))
        assert happy.done


def test_an_imported_head_that_never_matches_trips_the_canary(tmp_path):
    target = make_target("llama", eos=())
    prompt = random_prompt(12, seed=1)
    truth = set(reference_greedy(target.model, prompt, 40))
    vocab = torch.tensor([i for i in range(target.vocab_size) if i not in truth][:VOCAB_D])
    head = make_head(target, vocab=vocab, **STANDARD_ARCHITECTURE)
    path = export_eagle3(head, target, tmp_path / "never", dtype=torch.float64).path
    with pytest.warns(UserWarning, match="imported speculators"):
        specwise.generate(target, prompt, method="eagle", drafter_path=str(path), max_new_tokens=40,
                          lookup_tokens=0, min_path_prob=0.0)


# ---------------------------------------------------------------------------------------- Medusa


def make_medusa(target, vocab: torch.Tensor, seed: int = 0, num_layers: int = 2, scaled: bool = False) -> MedusaHeads:
    """Random float64 Medusa heads with live blocks (the identity at init would hide a swap)."""
    torch.manual_seed(seed)
    heads = MedusaHeads(target, MedusaConfig(num_heads=3, num_layers=num_layers, draft_vocab_size=vocab.numel()),
                        vocab).double()
    with torch.no_grad():
        for block in heads.modules():
            if isinstance(block, torch.nn.Linear):
                block.weight.normal_(std=0.1)
                block.bias.normal_(std=0.1)
        if scaled:
            heads.scale.uniform_(0.5, 2.0)
    return heads.eval().requires_grad_(False)


def medusa_full_logits(heads: MedusaHeads, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor:
    logits = heads(hidden)  # [K, T, Vd]
    out = torch.full((*logits.shape[:-1], vocab_size), float("-inf"), dtype=logits.dtype)
    out[..., heads.vocab] = logits
    return out


def final_hidden(target, ids: torch.Tensor) -> torch.Tensor:
    out = target.model(input_ids=ids[None], output_hidden_states=True)
    return out.hidden_states[-1][0]


@pytest.mark.parametrize("arch", ARCHS)
def test_medusa_round_trip_gives_the_same_logits(tmp_path, arch):
    target = make_target(arch)
    heads = make_medusa(target, torch.randperm(target.vocab_size))  # full vocabulary, frequency order
    exported = export_medusa(heads, target, tmp_path / "m", dtype=torch.float64)
    assert {p.name for p in exported.path.iterdir()} >= {"config.json", "medusa_lm_head.safetensors",
                                                          "medusa_lm_head.pt"}
    # vLLM builds its Medusa layers without biases (and drops the ones it reads) unless told
    assert json.loads((exported.path / "config.json").read_text())["medusa_fc_bias"] is True
    imported = read_medusa(exported.path, target)
    hidden = final_hidden(target, random_prompt(12, seed=3))
    torch.testing.assert_close(medusa_full_logits(imported, hidden, target.vocab_size),
                               medusa_full_logits(heads, hidden, target.vocab_size), rtol=0, atol=1e-9)


def test_medusa_export_refuses_what_the_format_cannot_express(tmp_path):
    target = make_target("llama")
    with pytest.raises(DrafterError, match="per-dimension scale"):
        export_medusa(make_medusa(target, torch.arange(target.vocab_size), scaled=True), target, tmp_path / "a")
    with pytest.raises(DrafterError, match="--draft-vocab-size 128"):
        export_medusa(make_medusa(target, torch.arange(64)), target, tmp_path / "b")


def write_public_medusa(path: Path, target, num_heads: int = 3, num_layers: int = 1, seed: int = 0,
                        prefix: str = "") -> dict:
    """A random FasterDecoding Medusa checkpoint (float64)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab_size = target.model.config.hidden_size, target.vocab_size
    w = {}
    for h in range(num_heads):
        for b in range(num_layers):
            w[f"{prefix}{h}.{b}.linear.weight"] = torch.randn(hidden, hidden, generator=gen, dtype=torch.float64) * 0.1
            w[f"{prefix}{h}.{b}.linear.bias"] = torch.randn(hidden, generator=gen, dtype=torch.float64) * 0.1
        w[f"{prefix}{h}.{num_layers}.weight"] = torch.randn(vocab_size, hidden, generator=gen, dtype=torch.float64)
    path.mkdir(parents=True, exist_ok=True)
    torch.save(w, path / "medusa_lm_head.pt")
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
                                                  "base_model_name_or_path": "tiny"}))
    return {k.removeprefix(prefix): v for k, v in w.items()}


def reference_medusa(w: dict, hidden: torch.Tensor, num_heads: int, num_layers: int) -> torch.Tensor:
    """Medusa's heads by the definition: ``x + SiLU(W x + b)`` per block, then the head's own LM head."""
    out = []
    for h in range(num_heads):
        x = hidden
        for b in range(num_layers):
            x = x + F.silu(x @ w[f"{h}.{b}.linear.weight"].T + w[f"{h}.{b}.linear.bias"])
        out.append(x @ w[f"{h}.{num_layers}.weight"].T)
    return torch.stack(out)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("num_layers,prefix", [(1, ""), (2, "medusa_head.")])
def test_a_public_medusa_checkpoint_imports_to_the_formats_own_forward(tmp_path, arch, num_layers, prefix):
    target = make_target(arch)
    w = write_public_medusa(tmp_path / "m", target, num_layers=num_layers, prefix=prefix)
    heads = read_medusa(tmp_path / "m", target)
    hidden = final_hidden(target, random_prompt(10, seed=4))
    torch.testing.assert_close(medusa_full_logits(heads, hidden, target.vocab_size),
                               reference_medusa(w, hidden, 3, num_layers), rtol=0, atol=1e-9)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.filterwarnings("ignore:the imported")
def test_greedy_with_imported_medusa_heads_equals_plain_decoding(tmp_path, arch):
    target = make_target(arch, eos=(), attn_implementation="sdpa")
    write_public_medusa(tmp_path / "m", target)
    prompt = random_prompt(14, seed=6)
    tokens = specwise.generate(target, prompt, method="medusa", drafter_path=str(tmp_path / "m"),
                               max_new_tokens=20).token_ids
    assert tokens == reference_greedy(target.model, prompt, 20)


@pytest.mark.parametrize("change,message", [
    ({"medusa_num_layers": 2}, "has no '0.1.linear.weight'"),
    ({"medusa_num_heads": 2}, "tensors specwise does not know"),
])
def test_medusa_mismatches_are_refused(tmp_path, change, message):
    target = make_target("llama")
    write_public_medusa(tmp_path / "m", target)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(DrafterError, match=message):
        read_medusa(tmp_path / "m", target)
    other = make_target("llama", vocab_size=96)
    write_public_medusa(tmp_path / "n", target)
    with pytest.raises(DrafterError, match="heads for another model"):
        read_medusa(tmp_path / "n", other)
    with pytest.raises(DrafterError, match="--method medusa"):
        load_eagle_head(tmp_path / "n", target)


# ---------------------------------------------------------------------------------------- speculators' own loader


@pytest.mark.parametrize("variant", ["specwise", "standard"])
def test_speculators_own_loader_reads_our_export(tmp_path, variant):
    """speculators' Eagle3DraftModel.from_pretrained + forward on our export, three TTT steps, against
    our head (speculators' rotary runs in float32: agreement to 1e-5). Skipped without the venv,
    saying how to build it; ``make interop-check`` (``SPECWISE_REQUIRE_INTEROP=1``) fails instead."""
    python = interop_python("SPECWISE_SPECULATORS_PYTHON", "speculators-venv",
                            "the speculators package pins an older transformers", "scripts/speculators-env.sh")
    target = make_target("llama")
    target.model.save_pretrained(tmp_path / "verifier")  # speculators reads the verifier's depth and weights
    head = make_head(target, **({} if variant == "specwise" else STANDARD_ARCHITECTURE))
    export_eagle3(head, target, tmp_path / "draft", dtype=torch.float64, verifier=str(tmp_path / "verifier"))
    ids, steps = random_prompt(24, seed=3), 3
    feats = features_of(target, ids[:-steps])
    torch.save({"hidden_states": feats[None], "input_ids": ids[1:1 + feats.shape[0]][None], "ttt_steps": steps},
               tmp_path / "in.pt")
    probe = Path(__file__).resolve().parents[2] / "scripts" / "speculators_probe.py"
    run = subprocess.run([str(python), str(probe), str(tmp_path / "draft"), str(tmp_path / "in.pt"),
                          str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert out["layer_ids"] == list(LAYERS)
    theirs_vocab = torch.arange(out["logits"][0].shape[-1]) + out["d2t"]
    for j, (ours, theirs) in enumerate(zip(head.unroll(feats[None], ids[1:][None], steps), out["logits"])):
        rows = feats.shape[0] - j  # speculators pads the shifted tokens of the last j rows
        mine = full_logits(head, ours[0], target.vocab_size)[:rows]
        other = torch.full_like(mine, float("-inf"))
        other[:, theirs_vocab] = theirs[0][:rows].double()
        torch.testing.assert_close(other, mine, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------- DFlash

DFLASH_STANDARD = {"tap_norms": False, "mask_token_id": 5, "raw_embeddings": True, "window": None, "hidden_act": "silu"}


def make_dflash(target, vocab: torch.Tensor, seed: int = 0, **arch) -> DFlashModel:
    """A random float64 DFlash drafter with live residual branches and non-trivial norm gains."""
    torch.manual_seed(seed)
    config = DFlashConfig(**{"feature_layers": LAYERS, "draft_vocab_size": vocab.numel(), "block_size": 4,
                             "num_layers": 2, "num_heads": 4, "head_dim": 8, "intermediate_size": 48, **arch})
    model = DFlashModel(target, config, vocab).double()
    with torch.no_grad():
        for layer in model.layers:
            layer.o_proj.weight.normal_(std=0.2)
            layer.down_proj.weight.normal_(std=0.2)
        for module in model.modules():
            if isinstance(module, torch.nn.RMSNorm):
                module.weight.uniform_(0.5, 1.5)
    return model.eval().requires_grad_(False)


def block_logits(model: DFlashModel, target, ids: torch.Tensor) -> torch.Tensor:
    """``[B-1, V]`` the block's draft logits after committing ``ids`` (the last one is the anchor)."""
    p = ids.numel() - 1
    context = model.fuse(features_of(target, ids[:-1], model.config.feature_layers))
    kv = model.context_keys_values(context, torch.arange(p))
    h = model.run_block(model.block_input(ids[-1]), torch.arange(p, p + model.config.block_size), kv)
    logits = model.logits(h[1:])
    out = torch.full((logits.shape[0], target.vocab_size), float("-inf"), dtype=logits.dtype)
    out[:, model.vocab] = logits
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("full_vocab", [False, True])
def test_dflash_round_trip_gives_the_same_block_logits(tmp_path, arch, full_vocab):
    target = make_target(arch)
    vocab = torch.arange(target.vocab_size) if full_vocab else torch.randperm(target.vocab_size)[:VOCAB_D]
    model = make_dflash(target, vocab, **DFLASH_STANDARD, num_kv_heads=2)
    exported = export_dflash(model, target, tmp_path / "d", dtype=torch.float64)
    config = json.loads((exported.path / "config.json").read_text())
    assert config["aux_hidden_state_layer_ids"] == list(LAYERS) and config["mask_token_id"] == 5
    assert ("d2t" in load_file(str(exported.path / "model.safetensors"))) is not full_vocab
    imported = read_dflash(exported.path, target)
    ids = random_prompt(18, seed=8)
    torch.testing.assert_close(block_logits(imported, target, ids), block_logits(model, target, ids),
                               rtol=0, atol=1e-9)


@pytest.mark.parametrize("method", ["eagle", "dflash"])
def test_a_bf16_export_keeps_the_vocabulary_tables_integer(tmp_path, method):
    """The weights go to bf16, the tables must not: bf16 offsets of a 262k-token vocabulary round
    to other tokens (this once turned a real-model DFlash export into a drafter that accepted nothing)."""
    target = make_target("gemma3")
    vocab = torch.randperm(target.vocab_size)[:VOCAB_D]
    if method == "eagle":
        path = export_eagle3(make_head(target, vocab=vocab), target, tmp_path / "x").path
        imported = read_eagle3(path, target)
    else:
        path = export_dflash(make_dflash(target, vocab, **DFLASH_STANDARD), target, tmp_path / "x").path
        imported = read_dflash(path, target)
    tables = load_file(str(path / "model.safetensors"))
    assert tables["d2t"].dtype == torch.int64 and tables["t2d"].dtype == torch.bool
    assert sorted(imported.vocab.tolist()) == sorted(vocab.tolist())
    tables["d2t"] = tables["d2t"].to(torch.bfloat16)
    save_file(tables, str(path / "model.safetensors"))
    with pytest.raises(DrafterError, match="not an integer table"):
        (read_eagle3 if method == "eagle" else read_dflash)(path, target)


def test_dflash_export_refuses_what_the_format_cannot_express(tmp_path):
    target = make_target("gemma3")
    with pytest.raises(DrafterError, match="learns its own mask vector"):
        export_dflash(make_dflash(target, torch.arange(VOCAB_D)), target, tmp_path / "a")
    with pytest.raises(DrafterError, match="at most 64 context tokens"):
        export_dflash(make_dflash(target, torch.arange(VOCAB_D), **{**DFLASH_STANDARD, "window": 64}), target,
                      tmp_path / "b")


def write_public_dflash(path: Path, target, fmt: str, *, taps=(1, 2), seed: int = 0, **overrides) -> dict:
    """A random DFlash checkpoint written as speculators (reduced vocabulary, ``d2t``) or z-lab
    (the target's LM head) write one (float64, Qwen3 layers with GQA)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab_size, heads, kv, d, inter, layers, vd = target.model.config.hidden_size, target.vocab_size, 4, 2, 8, 48, 2, 80
    rand = lambda *shape, s=0.2: torch.randn(*shape, generator=gen, dtype=torch.float64) * s  # noqa: E731
    w = {"fc.weight": rand(hidden, len(taps) * hidden), "hidden_norm.weight": 1 + rand(hidden), "norm.weight": 1 + rand(hidden)}
    for i in range(layers):
        for name, shape in (("input_layernorm", (hidden,)), ("post_attention_layernorm", (hidden,)),
                            ("self_attn.q_norm", (d,)), ("self_attn.k_norm", (d,))):
            w[f"layers.{i}.{name}.weight"] = 1 + rand(*shape)
        for name, shape in (("self_attn.q_proj", (heads * d, hidden)), ("self_attn.k_proj", (kv * d, hidden)),
                            ("self_attn.v_proj", (kv * d, hidden)), ("self_attn.o_proj", (hidden, heads * d)),
                            ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                            ("mlp.down_proj", (hidden, inter))):
            w[f"layers.{i}.{name}.weight"] = rand(*shape)
    layer = {"model_type": "qwen3", "num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": inter,
             "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d, "hidden_act": "silu",
             "rms_norm_eps": 1e-6, "vocab_size": vocab_size, "rope_theta": 1000.0}
    if fmt == "speculators":
        ids = torch.randperm(vocab_size, generator=gen)[:vd].sort().values
        w["lm_head.weight"] = rand(vd, hidden, s=1.0)
        w["d2t"] = ids - torch.arange(vd)
        config = {"architectures": ["DFlashDraftModel"], "speculators_model_type": "dflash",
                  "transformer_layer_config": layer, "draft_vocab_size": vd, "block_size": 4,
                  "aux_hidden_state_layer_ids": list(taps), "mask_token_id": 7}
    else:
        config = {**layer, "architectures": ["DFlashDraftModel"], "block_size": 4,
                  "dflash_config": {"mask_token_id": 7, "target_layer_ids": [i - 1 for i in taps]}}
    config.update(overrides)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return w


def reference_dflash(w: dict, target, fmt: str, ids: torch.Tensor, taps) -> torch.Tensor:
    """DFlash's block by the definition (speculators / z-lab): ``[B-1, V]`` logits on the target vocabulary."""
    heads, kv, d, eps, theta, block = 4, 2, 8, 1e-6, 1000.0, 4
    p = ids.numel() - 1
    ctx = _rms(features_of(target, ids[:-1], taps) @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    block_ids = torch.tensor([int(ids[-1])] + [7] * (block - 1))
    embed = target.model.get_input_embeddings()
    x = embed.weight[block_ids] if fmt == "speculators" else embed(block_ids)  # stored table / the module
    pos_ctx, pos_blk = torch.arange(p), torch.arange(p, p + block)
    for i in range(2):
        g = lambda name: w[f"layers.{i}.{name}.weight"]  # noqa: E731
        h = _rms(x, g("input_layernorm"), eps)
        q = _rope(_rms((h @ g("self_attn.q_proj").T).view(block, heads, d), g("self_attn.q_norm"), eps), pos_blk, theta)
        k_ctx = _rope(_rms((ctx @ g("self_attn.k_proj").T).view(p, kv, d), g("self_attn.k_norm"), eps), pos_ctx, theta)
        k_blk = _rope(_rms((h @ g("self_attn.k_proj").T).view(block, kv, d), g("self_attn.k_norm"), eps), pos_blk, theta)
        v = torch.cat([(ctx @ g("self_attn.v_proj").T).view(p, kv, d), (h @ g("self_attn.v_proj").T).view(block, kv, d)])
        k = torch.cat([k_ctx, k_blk]).repeat_interleave(heads // kv, dim=1)
        v = v.repeat_interleave(heads // kv, dim=1)
        att = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)  # every block entry sees all: non-causal
        x = x + torch.einsum("hts,shd->thd", att.softmax(-1), v).reshape(block, heads * d) @ g("self_attn.o_proj").T
        m = _rms(x, g("post_attention_layernorm"), eps)
        x = x + (F.silu(m @ g("mlp.gate_proj").T) * (m @ g("mlp.up_proj").T)) @ g("mlp.down_proj").T
    normed = _rms(x[1:], w["norm.weight"], eps)
    if fmt == "speculators":
        out = torch.full((block - 1, target.vocab_size), float("-inf"), dtype=torch.float64)
        out[:, torch.arange(w["d2t"].numel()) + w["d2t"]] = normed @ w["lm_head.weight"].T
        return out
    return normed @ target.model.get_output_embeddings().weight.T


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", ["speculators", "dflash"])
def test_a_public_dflash_checkpoint_imports_to_the_formats_own_forward(tmp_path, arch, fmt):
    target = make_target(arch)
    w = write_public_dflash(tmp_path / "d", target, fmt)
    model = read_dflash(tmp_path / "d", target)
    assert model.config.feature_layers == (1, 2)  # z-lab's ids are one lower
    ids = random_prompt(15, seed=9)
    torch.testing.assert_close(block_logits(model, target, ids), reference_dflash(w, target, fmt, ids, (1, 2)),
                               rtol=0, atol=1e-9)


@pytest.mark.parametrize("fmt", ["speculators", "dflash"])
@pytest.mark.filterwarnings("ignore:the imported")
def test_greedy_with_an_imported_dflash_drafter_equals_plain_decoding(tmp_path, fmt):
    target = make_target("gemma3", eos=(), attn_implementation="sdpa")
    write_public_dflash(tmp_path / "d", target, fmt)
    prompt = random_prompt(14, seed=6)
    tokens = specwise.generate(target, prompt, method="dflash", drafter_path=str(tmp_path / "d"),
                               max_new_tokens=20).token_ids
    assert tokens == reference_greedy(target.model, prompt, 20)


@pytest.mark.parametrize("fmt,change,message", [
    ("speculators", {"mask_token_id": None}, "mask_token_id"),
    ("speculators", {"aux_hidden_state_layer_ids": [1, 3]}, "outside the target's hidden states"),
    ("dflash", {"dflash_config": {"mask_token_id": 7, "target_layer_ids": [1, 2]}}, "outside the target's hidden"),
    ("dflash", {"layer_types": ["sliding_attention", "full_attention"]}, "sliding-window"),
])
def test_dflash_mismatches_are_refused(tmp_path, fmt, change, message):
    target = make_target("llama")
    write_public_dflash(tmp_path / "d", target, fmt, **change)
    with pytest.raises(DrafterError, match=message):
        read_dflash(tmp_path / "d", target)
    with pytest.raises(DrafterError, match="--method dflash"):
        load_eagle_head(tmp_path / "d", target)
