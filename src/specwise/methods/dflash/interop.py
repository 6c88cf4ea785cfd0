"""DFlash drafters in the speculators (vLLM) and z-lab formats (Chen, Liang, Liu 2026, arXiv 2602.06036;
docs/interop.md).

Both store the same network: ``fc.weight`` ``[H, F*H]`` over the concatenated raw target taps, then
``hidden_norm`` (the context vectors); Qwen3 decoder layers ``layers.{i}.*`` (``input_layernorm``,
q/k/v/o, per-head ``q_norm``/``k_norm``, ``post_attention_layernorm``, gated MLP) whose keys and
values also come from the context vectors (no norm on them); ``norm`` and an output layer. The
block is ``[anchor, mask, ..., mask]`` with ``mask_token_id``'s embedding.

* ``speculators``: ``speculators_model_type: "dflash"``, a nested ``transformer_layer_config``,
  ``aux_hidden_state_layer_ids`` (HF ``hidden_states`` indices, as specwise's taps), ``block_size``,
  ``mask_token_id``; ``lm_head.weight`` with ``d2t``/``t2d`` for a reduced vocabulary. Its loader
  rebuilds the embeddings from the target's stored table (so Gemma's sqrt(H) scale is not applied):
  ``raw_embeddings``.
* ``dflash`` (z-lab): a flat Qwen3 config with ``dflash_config: {mask_token_id, target_layer_ids}``,
  where layer id t reads HF ``hidden_states[t + 1]``; no output layer (the target's LM head) and the
  target's embedding module.

specwise's own DFlash normalizes each tap and learns its mask vector; a public file has neither, so
such a drafter does not export (train the public layout to export one).
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
from specwise.methods.dflash.network import DFlashConfig, DFlashModel
from specwise.models.common import check_taps_and_vocabulary

#: specwise module (per layer) -> the public key under ``layers.{i}.``
_LAYER_KEYS = {"input_norm": "input_layernorm", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
               "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj", "q_norm": "self_attn.q_norm",
               "k_norm": "self_attn.k_norm", "mlp_norm": "post_attention_layernorm", "gate_proj": "mlp.gate_proj",
               "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}
_TOP_KEYS = {"fc": "fc", "context_norm": "hidden_norm", "final_norm": "norm"}


@torch.no_grad()
def export_dflash(model: DFlashModel, target, out: str | Path, *, verifier: str | None = None,
                  dtype: torch.dtype = torch.bfloat16, unbounded_attention: bool = False) -> Exported:
    """Write ``model`` in the speculators DFlash format, computing exactly the function it computes here.

    Args:
        model: the drafter, on ``target``.
        target: the :class:`specwise.targets.hf.Target`.
        out: the directory to write (created).
        verifier: the target's name for the runtimes (default: its Hugging Face repository when known).
        dtype: the weights' dtype.
        unbounded_attention: write a drafter with a context window anyway (the format's blocks see the
            whole context: the same drafts within ``window`` tokens); refused otherwise.

    Returns:
        :class:`specwise.interop.formats.Exported`.

    Raises:
        DrafterError: a drafter the format cannot express (per-tap norms, a learned mask vector,
            embeddings scaled by the target's module, an attention window).
    """
    cfg = model.config
    if not model.is_standard():
        raise DrafterError("this DFlash drafter normalizes each target tap and learns its own mask vector, which "
                           "the public DFlash format cannot express (its taps go to fc raw and its mask is a "
                           "token's embedding); it does not export exactly.")
    if cfg.window is not None and not unbounded_attention:
        raise DrafterError(f"this DFlash drafter sees at most {cfg.window} context tokens, which the format cannot "
                           "express; pass --unbounded-attention to accept full attention (same drafts within "
                           f"{cfg.window} tokens).")
    text = target.model.config.get_text_config()
    hidden, vocab_size = int(text.hidden_size), target.vocab_size
    tensors: dict[str, torch.Tensor] = {}
    for ours, theirs in _TOP_KEYS.items():
        tensors[theirs + ".weight"] = getattr(model, ours).weight
    for i, layer in enumerate(model.layers):
        for ours, theirs in _LAYER_KEYS.items():
            tensors[f"layers.{i}.{theirs}.weight"] = getattr(layer, ours).weight
    full = model.vocab.numel() == vocab_size and torch.equal(model.vocab.cpu(), torch.arange(vocab_size))
    if not full or model.lm_head is not None:
        order, d2t, t2d = to_tables(model.vocab.cpu(), vocab_size)
        tensors["lm_head.weight"] = model.output_weight()[order.to(model.fc.weight.device)]
        if not full:
            tensors["d2t"], tensors["t2d"] = d2t, t2d
    tensors = {name: (t.detach().to(dtype) if t.is_floating_point() else t).cpu().contiguous()
               for name, t in tensors.items()}  # the weights in ``dtype``; d2t stays int64, t2d bool
    name = verifier or verifier_name(target)
    layer = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": cfg.num_layers,
             "hidden_size": hidden, "intermediate_size": cfg.intermediate_size,
             "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
             "hidden_act": ACT_TO_HF[cfg.hidden_act], "rms_norm_eps": model.final_norm.eps, "vocab_size": vocab_size,
             "max_position_embeddings": int(getattr(text, "max_position_embeddings", 32768)),
             "rope_theta": cfg.rope_theta, "rope_scaling": None,
             "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
             "attention_bias": False, "tie_word_embeddings": False, "use_sliding_window": False,
             "layer_types": ["full_attention"] * cfg.num_layers}
    config = {"architectures": ["DFlashDraftModel"], "speculators_model_type": "dflash",
              "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer,
              "draft_vocab_size": cfg.draft_vocab_size, "block_size": cfg.block_size,
              "aux_hidden_state_layer_ids": list(cfg.feature_layers), "mask_token_id": cfg.mask_token_id,
              "target_hidden_size": hidden, "sliding_window_non_causal": False, "sample_from_anchor": False,
              "speculators_config": {
                  "algorithm": "dflash", "default_proposal_method": "greedy",
                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1,
                                        "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                  "verifier": {"name_or_path": name, "architectures": [type(target.model).__name__]}}}
    path = prepare_out(out)
    write_export(path, tensors, config)
    spec = json.dumps({"method": "dflash", "model": str(path), "num_speculative_tokens": cfg.block_size - 1})
    caveats = []
    if cfg.hidden_act != "silu":
        caveats.append(f"vLLM and SGLang refuse its {ACT_TO_HF[cfg.hidden_act]} MLP (their DFlash layers run SiLU only).")
    return Exported(path, caveats, {
        "vllm": f"vllm serve {name} --speculative-config '{spec}'",
        "sglang": (f"python -m sglang.launch_server --model-path {name} --speculative-algorithm DFLASH "
                   f"--speculative-draft-model-path {path} --speculative-num-draft-tokens {cfg.block_size}")})


def read_dflash(path: str | Path, target) -> DFlashModel:
    """Load a DFlash drafter written by speculators or z-lab (or :func:`export_dflash`) for ``target``.

    Args:
        path: the drafter's directory.
        target: the :class:`specwise.targets.hf.Target`.

    Returns:
        a :class:`DFlashModel` in the target's dtype and on its device, eval mode, frozen, ``origin`` set.

    Raises:
        DrafterError: not a DFlash directory, a required key missing (``mask_token_id``,
            ``block_size``, ...), a hidden size, tap id, vocabulary or ``d2t`` that does not fit the
            target, a variant specwise does not run (sliding-window layers, biases, rope scaling),
            or weights that do not fit.
    """
    root = Path(path)
    config = read_json(root / CONFIG_NAME)
    found = format_of(config)
    if found is None or found.method != "dflash":
        raise DrafterError(f"{root} is not a DFlash drafter in the speculators or z-lab format.")
    where = f"the DFlash drafter in {root}"
    text = target.model.config.get_text_config()
    hidden, num_layers = int(text.hidden_size), int(text.num_hidden_layers)
    if found.name == "speculators":
        layer = require(config, "transformer_layer_config", where)
        taps = [int(i) for i in require(config, "aux_hidden_state_layer_ids", where)]
        mask_token_id = require(config, "mask_token_id", where)
        block_size = require(config, "block_size", where)
    else:
        layer = config
        dflash = require(config, "dflash_config", where)
        # z-lab's layer id t reads hidden_states[t + 1] (index 0 is the embedding output)
        taps = [int(i) + 1 for i in require(dflash, "target_layer_ids", where)]
        mask_token_id = require(dflash, "mask_token_id", where)
        block_size = config.get("block_size") or require(dflash, "block_size", where)
    model_config = _model_config(config, layer, found.name, where, hidden, num_layers, target.vocab_size, taps,
                                 int(mask_token_id), int(block_size))
    weights = load_weights(root, (WEIGHTS_NAME, "pytorch_model.bin"))
    weights.pop("embed_tokens.weight", None)  # both runtimes embed with the target's own table
    weights.pop("t2d", None)
    vocab = from_d2t(weights.pop("d2t", None), model_config.draft_vocab_size, target.vocab_size, where)
    check_taps_and_vocabulary(target, model_config.feature_layers, vocab, model_config.draft_vocab_size)
    if "lm_head.weight" in weights:
        model_config = dataclasses.replace(model_config, own_lm_head=True)
    model = DFlashModel(target, model_config, vocab, initialize=False).to(device=target.device, dtype=target.dtype)
    model.load_state_dict(_our_state(weights, model, where))
    model.origin = found.label
    return model.eval().requires_grad_(False)


def _model_config(config: dict[str, Any], layer: dict[str, Any], fmt: str, where: str, hidden: int,
                  num_layers: int, vocab_size: int, taps: list[int], mask_token_id: int,
                  block_size: int) -> DFlashConfig:
    """The :class:`DFlashConfig` a public config describes, after checking it against the target."""
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers"):
        require(layer, key, where)
    if int(layer["hidden_size"]) != hidden:
        raise DrafterError(f"{where} has hidden size {layer['hidden_size']} but the target's is {hidden}.")
    target_hidden = config.get("target_hidden_size")
    if target_hidden is not None and int(target_hidden) != hidden:
        raise DrafterError(f"{where} reads target features of width {target_hidden} but the target's hidden "
                           f"size is {hidden}.")
    if "vocab_size" in layer and int(layer["vocab_size"]) != vocab_size:
        raise DrafterError(f"{where} was made for a {layer['vocab_size']}-token vocabulary but the target has "
                           f"{vocab_size} tokens.")
    bad = [i for i in taps if not 0 <= i <= num_layers]
    if bad:
        raise DrafterError(f"{where} reads target layer {bad[0]}, outside the target's hidden states 0..{num_layers} "
                           "(a drafter for a deeper target, or layer ids counted from another origin?).")
    if not 0 <= mask_token_id < vocab_size:
        raise DrafterError(f"{where}: mask_token_id {mask_token_id} is outside the target's {vocab_size} tokens.")
    if "sliding_attention" in (layer.get("layer_types") or []) or layer.get("use_sliding_window"):
        raise DrafterError(f"{where} has sliding-window layers, a variant specwise does not run yet.")
    act = check_layer(layer, where)
    heads = int(layer["num_attention_heads"])
    return DFlashConfig(
        feature_layers=tuple(taps), draft_vocab_size=int(config.get("draft_vocab_size") or vocab_size),
        block_size=block_size, num_layers=int(layer["num_hidden_layers"]), num_heads=heads,
        head_dim=int(layer.get("head_dim") or hidden // heads), intermediate_size=int(layer["intermediate_size"]),
        rope_theta=rope_theta(layer), window=None, tap_norms=False, hidden_act=act,
        num_kv_heads=int(layer.get("num_key_value_heads") or heads), mask_token_id=mask_token_id,
        # speculators rebuilds the embeddings from the target's stored table; z-lab calls its module
        raw_embeddings=fmt == "speculators", rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)))


def _our_state(weights: dict[str, torch.Tensor], model: DFlashModel, where: str) -> dict[str, torch.Tensor]:
    """The public checkpoint's tensors under :class:`DFlashModel`'s names (:func:`mapped_state`)."""
    mapping = {theirs + ".weight": ours + ".weight" for ours, theirs in _TOP_KEYS.items()}
    mapping["lm_head.weight"] = "lm_head.weight"
    for i in range(len(model.layers)):
        for ours, theirs in _LAYER_KEYS.items():
            mapping[f"layers.{i}.{theirs}.weight"] = f"layers.{i}.{ours}.weight"
    return mapped_state(weights, mapping, model, where)


# ------------------------------------------------------------------ what specwise.methods finds
#: the formats ``specwise export`` writes a DFlash drafter in
FORMATS = ("speculators",)
#: the architecture z-lab names a DFlash drafter by
ARCHITECTURES = ("DFlashDraftModel",)


def recognize(config: dict[str, Any]) -> Format | None:
    """The DFlash format a parsed ``config.json`` declares (speculators' ``speculators_model_type``
    ``"dflash"``, or z-lab's ``dflash_config`` / architecture name), else ``None``."""
    if config.get("speculators_model_type") == "dflash":
        return Format("speculators", "dflash", "speculators (DFlash)")
    if "dflash_config" in config or any(name in ARCHITECTURES for name in config.get("architectures") or []):
        return Format("dflash", "dflash", "DFlash (z-lab)")
    return None


def export(network: DFlashModel, target, out: str | Path, fmt: str, *, dtype: torch.dtype, **options) -> Exported:
    """``specwise export``'s entry for DFlash drafters: :func:`export_dflash` (``fmt`` is one of
    :data:`FORMATS`, checked by the caller; options ``verifier``, ``unbounded_attention``)."""
    return export_dflash(network, target, out, dtype=dtype, verifier=options.get("verifier"),
                         unbounded_attention=bool(options.get("unbounded_attention")))
