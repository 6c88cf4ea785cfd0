"""EAGLE-3 heads in the formats vLLM and SGLang serve (Li et al. 2025, arXiv 2503.01840; docs/interop.md).

Two layouts of the same one-layer head:

* ``speculators`` (vLLM's drafter format): ``speculators_model_type: "eagle3"``, the layer's
  hyper-parameters in a nested Llama ``transformer_layer_config``, weights ``layers.0.*``;
* ``eagle3`` (SpecForge's, which SGLang serves): a flat Llama config with ``architectures:
  ["LlamaForCausalLMEagle3"]``, weights ``midlayer.*``.

Both store ``fc.weight`` ``[H, F*H]`` (over the concatenated raw taps), the layer's
``input_layernorm`` (token embedding), ``hidden_norm`` (feature), attention and gated MLP, ``norm``
and ``lm_head.weight`` ``[Vd, H]`` with the ``d2t``/``t2d`` tables (:mod:`specwise.interop.vocab`),
and the field's flags: ``fc_norm`` (one RMSNorm per tap before ``fc``: specwise's ``tap_norms``),
``norm_before_fc`` (one RMSNorm over the concatenation), ``norm_before_residual`` and ``norm_output``.

How the pieces map onto :class:`specwise.methods.eagle.network.EagleHead` (``[embed; feature]`` order,
pre-norm output fed back, rotary half-split, ``1/sqrt(head_dim)`` scale all agree):

====================  ==========================================  ======================
specwise              speculators ``layers.0.`` / SpecForge ``midlayer.``  notes
====================  ==========================================  ======================
``tap_norms.i``       ``fc_norm.i`` (``fc_norm: true``)           not in llama.cpp b11434
``token_norm``        ``input_layernorm``
``feature_norm``      ``hidden_norm``
``mlp_norm``          ``post_attention_layernorm``
``final_norm``        ``norm``
``window``            ``layer_types: [sliding_attention]``        speculators only
``hidden_act``        ``hidden_act`` (``gelu_pytorch_tanh``)      vLLM/SGLang: silu only
====================  ==========================================  ======================

Tap ids are HF ``hidden_states`` indices (the input of layer k) in ``eagle_aux_hidden_state_layer_ids``,
as vLLM, speculators and llama.cpp read them; SGLang reads the nested
``eagle_config.eagle_aux_hidden_state_layer_ids`` as *outputs* of layer k, so the SpecForge export
writes those one lower.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from specwise.errors import DrafterError
from specwise.interop.formats import (
    ACT_TO_HF,
    CONFIG_NAME,
    SPECULATORS_VERSION,
    WEIGHTS_NAME,
    Exported,
    Format,
    check_layer,
    format_of,
    load_weights,
    mapped_state,
    prepare_out,
    read_json,
    require,
    rope_theta,
    verifier_name,
    write_export,
)
from specwise.interop.vocab import from_d2t, to_tables
from specwise.methods.eagle.network import EagleConfig, EagleHead
from specwise.models.common import check_taps_and_vocabulary, default_feature_layers

EXPORT_FORMATS = ("speculators", "eagle3")
#: specwise module -> the layer's key (under ``layers.0.`` or ``midlayer.``)
_LAYER_KEYS = {"token_norm": "input_layernorm", "feature_norm": "hidden_norm", "q_proj": "self_attn.q_proj",
               "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
               "mlp_norm": "post_attention_layernorm", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
               "down_proj": "mlp.down_proj"}
_PREFIX = {"speculators": "layers.0.", "eagle3": "midlayer."}
#: target model types whose llama.cpp b11434 graph does not expose layer inputs, so `llama-server`
#: cannot feed an EAGLE-3 draft its taps (its converter accepts the draft regardless)
LLAMA_CPP_NO_TAPS = ("gemma", "gemma2", "gemma3", "gemma3_text", "qwen2", "mistral3", "phi3")
#: target model types whose vLLM 0.32 class does not record EAGLE-3 taps ("Model does not support
#: EAGLE3 interface"); vLLM's Transformers backend (`--model-impl transformers`) does, and serves them
VLLM_NO_TAPS = ("gemma", "gemma2", "gemma3", "gemma3_text")


# ---------------------------------------------------------------------------------------- export
@torch.no_grad()
def export_eagle3(head: EagleHead, target, out: str | Path, fmt: str = "speculators", *, verifier: str | None = None,
                  speculative_tokens: int = 3, dtype: torch.dtype = torch.bfloat16,
                  unbounded_attention: bool = False) -> Exported:
    """Write ``head`` in a public EAGLE-3 format, computing exactly the function it computes here.

    The borrowed parts are written out: the target's token embeddings as the head uses them
    (Gemma's scaled by sqrt(H)) and its LM-head rows of the draft vocabulary in ascending id order.

    Args:
        head: the head, on ``target``.
        target: the :class:`specwise.targets.hf.Target` it drafts for.
        out: the directory to write (new or empty; created).
        fmt: ``"speculators"`` or ``"eagle3"`` (SpecForge / SGLang).
        verifier: the target's name for the runtimes (default: its Hugging Face repository when
            known, else its specwise name).
        speculative_tokens: draft tokens per step the config proposes to the runtime.
        dtype: the weights' dtype (bf16 is compact; float32/float64 for exactness checks).
        unbounded_attention: write a windowed head to a format without attention windows (SpecForge),
            accepting that it attends to the whole context (the same drafts within ``window``
            tokens); refused otherwise.

    Returns:
        :class:`Exported`.

    Raises:
        DrafterError: an unknown format, an output path that is a file or holds files, or a head
            the format cannot express exactly (the message says which option trains one it can:
            ``specwise train eagle --arch standard``).
    """
    if fmt not in EXPORT_FORMATS:
        raise DrafterError(f"unknown EAGLE-3 export format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}.")
    cfg = head.config
    if fmt == "eagle3" and cfg.window is not None and not unbounded_attention:
        raise DrafterError(f"this head attends to at most {cfg.window} earlier tokens, which the SpecForge/SGLang "
                           f"format cannot express; export to speculators, pass --unbounded-attention to accept "
                           f"full attention (same drafts within {cfg.window} tokens), or train with --arch standard.")
    text = target.model.config.get_text_config()
    hidden, vocab_size = int(text.hidden_size), target.vocab_size
    order, d2t, t2d = to_tables(head.vocab.cpu(), vocab_size)
    prefix = _PREFIX[fmt]
    tensors: dict[str, torch.Tensor] = {
        "embed_tokens.weight": head.embed(torch.arange(vocab_size, device=head.fc.weight.device)),
        "fc.weight": head.fc.weight,
        "norm.weight": head.final_norm.weight,
        "lm_head.weight": head.output_weight()[order.to(head.fc.weight.device)],
    }
    for i, norm in enumerate(head.tap_norms):
        tensors[f"fc_norm.{i}.weight"] = norm.weight
    for ours, theirs in _LAYER_KEYS.items():
        tensors[prefix + theirs + ".weight"] = getattr(head, ours).weight
    tensors = {name: t.detach().to(device="cpu", dtype=dtype).contiguous() for name, t in tensors.items()}
    if head.vocab.numel() != vocab_size or not torch.equal(head.vocab.cpu(), torch.arange(vocab_size)):
        tensors["d2t"], tensors["t2d"] = d2t, t2d
    name = verifier or verifier_name(target)
    layer = _layer_config(head, text, vocab_size, window=None if fmt == "eagle3" else cfg.window)
    flags = {"draft_vocab_size": cfg.draft_vocab_size, "norm_before_residual": cfg.norm_before_residual,
             "norm_before_fc": False, "fc_norm": cfg.tap_norms, "norm_output": False, "target_hidden_size": hidden,
             "eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers)}
    if fmt == "speculators":
        config = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
                  "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer, **flags,
                  "embed_requires_grad": False,
                  "speculators_config": {
                      "algorithm": "eagle3", "default_proposal_method": "greedy",
                      "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                            "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                      "verifier": {"name_or_path": name, "architectures": [type(target.model).__name__]}}}
    else:
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], **flags,
                  "target_model_type": str(text.model_type),
                  # SGLang reads only this copy, as outputs of layer k: hidden_states index k + 1
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.feature_layers]}}
    path = prepare_out(out)
    write_export(path, tensors, config)
    return Exported(path, _caveats(head, text, fmt), _serve_commands(head, text, fmt, path, name, speculative_tokens))


def _layer_config(head: EagleHead, text, vocab_size: int, window: int | None) -> dict[str, Any]:
    """The head's layer as a Llama config (``transformer_layer_config``, or SpecForge's flat config)."""
    cfg = head.config
    layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
             "hidden_size": head.hidden_size, "intermediate_size": cfg.intermediate_size,
             "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
             "hidden_act": ACT_TO_HF[cfg.hidden_act], "rms_norm_eps": head.final_norm.eps,
             "vocab_size": vocab_size, "max_position_embeddings": int(getattr(text, "max_position_embeddings", 32768)),
             "rope_theta": cfg.rope_theta, "rope_scaling": None,
             "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
             "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}
    if window is not None:
        layer.update(layer_types=["sliding_attention"], use_sliding_window=True, sliding_window=window)
    return layer


def _caveats(head: EagleHead, text, fmt: str) -> list[str]:
    cfg = head.config
    out = []
    if cfg.hidden_act != "silu":
        out.append(f"vLLM and SGLang refuse its {ACT_TO_HF[cfg.hidden_act]} MLP (their EAGLE-3 layer runs SiLU "
                   "only) and llama.cpp would run SiLU regardless: train with --arch standard to serve it there.")
    if cfg.tap_norms:
        out.append("llama.cpp b11434 cannot convert fc_norm (per-tap norms); SGLang releases without fc_norm "
                   "support drop those weights silently.")
    if cfg.window is not None and fmt == "speculators":
        out.append(f"vLLM's and llama.cpp's EAGLE-3 layers have no attention window: past {cfg.window} tokens of "
                   "context they attend to more than this head does.")
    if str(text.model_type) in LLAMA_CPP_NO_TAPS:
        out.append(f"llama.cpp b11434's {text.model_type} graph does not expose the layer inputs an EAGLE-3 draft "
                   "reads, so llama-server cannot serve a draft for this target.")
    return out


def _serve_commands(head: EagleHead, text, fmt: str, path: Path, verifier: str, tokens: int) -> dict[str, str]:
    """The commands of the runtimes that run this export as it is: vLLM reads the speculators
    format, SGLang SpecForge's; none runs a GELU layer, llama.cpp and older SGLang no ``fc_norm``."""
    cfg = head.config
    out = {}
    if cfg.hidden_act != "silu":
        return out
    if fmt == "speculators":
        spec = json.dumps({"method": "eagle3", "model": str(path), "num_speculative_tokens": tokens})
        out["vllm"] = f"vllm serve {verifier} --speculative-config '{spec}'" + (
            " --model-impl transformers" if str(text.model_type) in VLLM_NO_TAPS else "")
        if not cfg.tap_norms and str(text.model_type) not in LLAMA_CPP_NO_TAPS:
            out["llama.cpp"] = (f"python convert_hf_to_gguf.py {path} --target-model-dir TARGET_HF_DIR --outfile "
                                f"draft.gguf && llama-server -m TARGET.gguf -md draft.gguf --spec-type draft-eagle3 "
                                f"--spec-draft-n-max {tokens}")
    elif not cfg.tap_norms:
        out["sglang"] = (f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 "
                         f"--speculative-draft-model-path {path} --speculative-num-steps {tokens} "
                         f"--speculative-eagle-topk 4 --speculative-num-draft-tokens 8")
    return out


# ---------------------------------------------------------------------------------------- import
def read_eagle3(path: str | Path, target) -> EagleHead:
    """Load an EAGLE-3 head written by speculators or SpecForge (or :func:`export_eagle3`) for ``target``.

    Everything the head's function depends on is checked against the target and the format, so a
    mismatch is an error here rather than a run that accepts nothing.

    Args:
        path: the head's directory (``config.json`` and ``model.safetensors`` or ``pytorch_model.bin``).
        target: the :class:`specwise.targets.hf.Target` to draft for.

    Returns:
        an :class:`EagleHead` in the target's dtype and on its device, eval mode, frozen, with
        ``origin`` naming the format.

    Raises:
        DrafterError: not an EAGLE-3 directory, a required key missing, a hidden size, tap id, vocab
            size or ``d2t`` that does not fit the target, a variant specwise does not run
            (``norm_before_fc``, ``norm_output``, several layers, attention biases, rope scaling,
            q/k norms), or weights that do not fit.
    """
    root = Path(path)
    config = read_json(root / CONFIG_NAME)
    found = format_of(config)
    if found is None or found.method != "eagle" or found.name not in _PREFIX:
        raise DrafterError(f"{root} is not an EAGLE-3 head in the speculators or SpecForge format.")
    where = f"the EAGLE-3 head in {root}"
    if found.name == "speculators":
        layer = require(config, "transformer_layer_config", where)
        if not isinstance(layer, dict):
            raise DrafterError(f"{where}: transformer_layer_config must be an object.")
    else:
        layer = config
    text = target.model.config.get_text_config()
    hidden, num_layers = int(text.hidden_size), int(text.num_hidden_layers)
    head_config = _head_config(config, layer, where, hidden, num_layers, target.vocab_size)
    weights = load_weights(root, (WEIGHTS_NAME, "pytorch_model.bin"))
    vocab = from_d2t(weights.pop("d2t", None), head_config.draft_vocab_size, target.vocab_size, where)
    weights.pop("t2d", None)
    check_taps_and_vocabulary(target, head_config.feature_layers, vocab, head_config.draft_vocab_size)
    embeddings = _own_embeddings(weights, target, where)
    if embeddings is not None:
        head_config = dataclasses.replace(head_config, own_embeddings=True)
        weights["embed_tokens.weight"] = embeddings
    head = EagleHead(target, head_config, vocab, initialize=False).to(device=target.device, dtype=target.dtype)
    head.load_state_dict(_our_state(weights, head, where))  # copied in the target's dtype, not through float32
    head.origin = found.label
    return head.eval().requires_grad_(False)


@torch.no_grad()
def _own_embeddings(weights: dict[str, torch.Tensor], target, where: str) -> torch.Tensor | None:
    """The head's embedding table when it ships one that differs from what the target's embedding
    module computes (runtimes use a shipped table as it is); ``None`` to borrow the target's.

    Raises:
        DrafterError: a table without the target's shape.
    """
    table = weights.pop("embed_tokens.weight", weights.pop("model.embed_tokens.weight", None))
    if table is None:
        return None
    module = target.model.get_input_embeddings()
    rows = int(getattr(module, "num_embeddings", target.vocab_size))
    hidden = int(target.model.config.get_text_config().hidden_size)
    if tuple(table.shape) != (rows, hidden):
        raise DrafterError(f"{where}: embed_tokens has shape {list(table.shape)}, not the target's embedding table "
                           f"[{rows}, {hidden}].")
    theirs = module(torch.arange(rows, device=target.device))
    if torch.equal(table.to(device=theirs.device, dtype=theirs.dtype), theirs):
        return None
    return table


def _head_config(config, layer, where: str, hidden: int, num_layers: int,
                 vocab_size: int) -> EagleConfig:
    """The :class:`EagleConfig` a public config describes, after checking it against the target."""
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        require(layer, key, where)
    if int(layer["hidden_size"]) != hidden:
        raise DrafterError(f"{where} has hidden size {layer['hidden_size']} but the target's is {hidden}.")
    target_hidden = config.get("target_hidden_size") or layer.get("target_hidden_size")
    if target_hidden is not None and int(target_hidden) != hidden:
        raise DrafterError(f"{where} reads target features of width {target_hidden} but the target's hidden "
                           f"size is {hidden}.")
    if int(layer["vocab_size"]) != vocab_size:
        raise DrafterError(f"{where} was made for a {layer['vocab_size']}-token vocabulary but the target has "
                           f"{vocab_size} tokens.")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise DrafterError(f"{where} has {layer['num_hidden_layers']} layers; specwise runs one-layer EAGLE-3 heads.")
    for flag in ("norm_before_fc", "norm_output"):
        if config.get(flag) or layer.get(flag):
            raise DrafterError(f"{where} sets {flag}, a variant specwise does not run yet.")
    act = check_layer(layer, where)
    taps = config.get("eagle_aux_hidden_state_layer_ids")
    if taps is None and isinstance(config.get("eagle_config"), dict):
        nested = config["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
        taps = None if nested is None else [int(i) + 1 for i in nested]  # SGLang: outputs of layer k
    taps = tuple(int(i) for i in taps) if taps is not None else default_feature_layers(num_layers)
    bad = [i for i in taps if not 0 <= i <= num_layers]
    if bad:
        raise DrafterError(f"{where} reads target layer {bad[0]}, outside the target's hidden states 0..{num_layers} "
                           "(a head for a deeper target, or layer ids counted from another origin?).")
    heads = int(layer["num_attention_heads"])
    window = None
    if layer.get("use_sliding_window", True) and "sliding_attention" in (layer.get("layer_types") or []):
        window = int(require(layer, "sliding_window", where))
    return EagleConfig(
        feature_layers=taps, draft_vocab_size=int(require(config, "draft_vocab_size", where)), num_heads=heads,
        head_dim=int(layer.get("head_dim") or hidden // heads), intermediate_size=int(layer["intermediate_size"]),
        rope_theta=rope_theta(layer),
        window=window, tap_norms=bool(config.get("fc_norm") or layer.get("fc_norm")), hidden_act=act,
        num_kv_heads=int(layer.get("num_key_value_heads") or heads),
        # absent: false, as speculators (the format's owner) and SGLang read it; vLLM assumes true
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        own_embeddings=False, own_lm_head=True, rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)))


def _our_state(weights: dict[str, torch.Tensor], head: EagleHead, where: str) -> dict[str, torch.Tensor]:
    """The public checkpoint's tensors under :class:`EagleHead`'s names (:func:`mapped_state`)."""
    if "lm_head.weight" not in weights:
        raise DrafterError(f"{where} has no lm_head.weight.")
    mapping = {"fc.weight": "fc.weight", "norm.weight": "final_norm.weight", "lm_head.weight": "lm_head.weight",
               "embed_tokens.weight": "embed_tokens.weight"}
    for ours, theirs in _LAYER_KEYS.items():
        for prefix in _PREFIX.values():
            mapping[prefix + theirs + ".weight"] = ours + ".weight"
    for i in range(len(head.tap_norms)):
        mapping[f"fc_norm.{i}.weight"] = f"tap_norms.{i}.weight"
    return mapped_state(weights, mapping, head, where)


# ------------------------------------------------------------------ what specwise.methods finds
#: the formats ``specwise export`` writes an EAGLE head in
FORMATS = EXPORT_FORMATS
#: the architectures SpecForge / SGLang name an EAGLE-3 head by
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def recognize(config: dict[str, Any]) -> Format | None:
    """The EAGLE-3 format a parsed ``config.json`` declares (speculators' ``speculators_model_type``
    ``"eagle3"``, or SpecForge's architecture name), else ``None``."""
    if config.get("speculators_model_type") == "eagle3":
        return Format("speculators", "eagle", "speculators (EAGLE-3)")
    if any(name in ARCHITECTURES for name in config.get("architectures") or []):
        return Format("eagle3", "eagle", "EAGLE-3 (SpecForge / SGLang)")
    return None


def export(network: EagleHead, target, out: str | Path, fmt: str, *, dtype: torch.dtype, **options) -> Exported:
    """``specwise export``'s entry for EAGLE heads: :func:`export_eagle3` with the writer's options
    (``verifier``, ``speculative_tokens``, ``unbounded_attention``)."""
    return export_eagle3(network, target, out, fmt, dtype=dtype, **options)
