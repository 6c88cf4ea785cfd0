"""Medusa heads in FasterDecoding's format (Cai et al. 2024, arXiv 2401.10774; docs/interop.md).

The format: ``config.json`` with ``medusa_num_heads`` (K) and ``medusa_num_layers`` (L), and
``medusa_lm_head.safetensors`` (FasterDecoding's loader reads ``medusa_lm_head.pt``: both are
written) holding, per head h, its residual blocks ``{h}.{l}.linear.weight`` ``[H, H]`` and
``.bias`` ``[H]`` (``x + SiLU(W x + b)``) and its output layer ``{h}.{L}.weight`` ``[V, H]`` over the
*whole* vocabulary. Every head reads the target's final normed hidden state.

specwise's heads work on the hidden state divided by a per-dimension scale and share the target's
LM-head rows of a reduced draft vocabulary; neither exists in the format, so only heads without
a scale (``scale == 1``) over the full vocabulary export, and a set that has them is refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from specwise.errors import DrafterError
from specwise.interop.formats import (
    CONFIG_NAME,
    Exported,
    Format,
    format_of,
    load_weights,
    prepare_out,
    read_json,
    require,
    write_export,
)
from specwise.methods.medusa.network import MedusaConfig, MedusaHeads

WEIGHTS_NAMES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors", "pytorch_model.bin")


@torch.no_grad()
def export_medusa(heads: MedusaHeads, target, out: str | Path, *, verifier: str | None = None,
                  dtype: torch.dtype = torch.bfloat16) -> Exported:
    """Write ``heads`` in FasterDecoding's Medusa format, computing exactly the function they compute here.

    Args:
        heads: the heads, on ``target``.
        target: the :class:`specwise.targets.hf.Target`.
        out: the directory to write (created).
        verifier: the target's name written as ``base_model_name_or_path`` (default: its name).
        dtype: the weights' dtype.

    Returns:
        :class:`specwise.interop.formats.Exported`.

    Raises:
        DrafterError: heads with a per-dimension scale or a reduced draft vocabulary (the format
            has neither).
    """
    if not heads.is_standard():
        raise DrafterError("these Medusa heads work on the hidden state divided by a per-dimension scale, which "
                           "the Medusa format cannot express; train a set without it "
                           "(`specwise train medusa --arch standard`).")
    vocab_size = target.vocab_size
    if heads.vocab.numel() != vocab_size:
        raise DrafterError(f"these Medusa heads predict a {heads.vocab.numel()}-token draft vocabulary; the Medusa "
                           f"format's output layers cover the whole vocabulary ({vocab_size} tokens): train with "
                           f"--arch standard --draft-vocab-size {vocab_size}.")
    order = torch.argsort(heads.vocab.cpu())
    layers = heads.config.num_layers
    tensors: dict[str, torch.Tensor] = {}
    for h, blocks in enumerate(heads.heads):
        for b, block in enumerate(blocks):
            tensors[f"{h}.{b}.linear.weight"] = block.linear.weight
            tensors[f"{h}.{b}.linear.bias"] = block.linear.bias
        output = heads.lm_heads[h].weight if heads.lm_heads is not None else heads._borrowed.head
        tensors[f"{h}.{layers}.weight"] = output[order.to(output.device)]
    tensors = {name: t.detach().to(device="cpu", dtype=dtype).contiguous() for name, t in tensors.items()}
    text = target.model.config.get_text_config()
    name = verifier or target.name
    # medusa_fc_bias: vLLM's Medusa layers have no bias unless it is set, and it drops the biases
    # it reads otherwise (FasterDecoding's layers always have one; its loader ignores the key)
    config = {"medusa_num_heads": heads.config.num_heads, "medusa_num_layers": layers,
              "base_model_name_or_path": name, "hidden_size": int(text.hidden_size), "vocab_size": vocab_size,
              "medusa_fc_bias": True, "version": "2"}
    path = prepare_out(out)
    write_export(path, tensors, config, WEIGHTS_NAMES[0])
    torch.save(tensors, path / WEIGHTS_NAMES[1])  # the name FasterDecoding's loader reads
    os.chmod(path / WEIGHTS_NAMES[1], (path / CONFIG_NAME).stat().st_mode & 0o777)
    serve = {"vllm": f"vllm serve {name} --speculative-config '{json.dumps({'method': 'medusa', 'model': str(path), 'num_speculative_tokens': heads.config.num_heads})}'",
             "medusa": f"python -m medusa.inference.cli --model {path}"}
    return Exported(path, [], serve)


def read_medusa(path: str | Path, target) -> MedusaHeads:
    """Load Medusa heads written by FasterDecoding's Medusa (or :func:`export_medusa`) for ``target``.

    Args:
        path: the heads' directory.
        target: the :class:`specwise.targets.hf.Target`.

    Returns:
        :class:`MedusaHeads` with their own output layers, in the target's dtype and on its device,
        eval mode, frozen, ``origin`` set.

    Raises:
        DrafterError: not a Medusa directory, ``medusa_num_heads``/``medusa_num_layers`` missing,
            blocks or output layers whose shapes do not fit the target (hidden size, vocabulary),
            a head or block missing, or tensors of no known name.
    """
    root = Path(path)
    config = read_json(root / CONFIG_NAME)
    found = format_of(config)
    where = f"the Medusa heads in {root}"
    if found is None or found.name != "medusa":
        raise DrafterError(f"{root} is not a set of Medusa heads in FasterDecoding's format.")
    num_heads = int(require(config, "medusa_num_heads", where))
    num_layers = int(config.get("medusa_num_layers", 1))
    weights = {name.removeprefix("medusa_head."): t for name, t in load_weights(root, WEIGHTS_NAMES).items()}
    hidden = int(target.model.config.get_text_config().hidden_size)
    state: dict[str, torch.Tensor] = {}
    for h in range(num_heads):
        for b in range(num_layers):
            for kind, shape in (("weight", (hidden, hidden)), ("bias", (hidden,))):
                state[f"heads.{h}.{b}.linear.{kind}"] = _take(weights, f"{h}.{b}.linear.{kind}", shape, where)
        state[f"lm_heads.{h}.weight"] = _take(weights, f"{h}.{num_layers}.weight", (target.vocab_size, hidden), where)
    if weights:
        raise DrafterError(f"{where} holds tensors specwise does not know ({sorted(weights)[0]!r}): "
                           f"is medusa_num_layers ({num_layers}) right?")
    heads = MedusaHeads(target, MedusaConfig(num_heads=num_heads, num_layers=num_layers,
                                             draft_vocab_size=target.vocab_size, own_lm_heads=True),
                        torch.arange(target.vocab_size)).to(device=target.device, dtype=target.dtype)
    state["scale"] = torch.ones(hidden)
    heads.load_state_dict(state)
    heads.origin = found.label
    return heads.eval().requires_grad_(False)


def _take(weights: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], where: str) -> torch.Tensor:
    """Pop ``weights[name]``, checking its shape against the target's."""
    if name not in weights:
        raise DrafterError(f"{where} has no {name!r} (medusa_num_heads / medusa_num_layers do not match the weights).")
    tensor = weights.pop(name)
    if tuple(tensor.shape) != shape:
        raise DrafterError(f"{where}: {name} has shape {list(tensor.shape)}, but the target needs {list(shape)} "
                           "(hidden size, vocabulary): heads for another model?")
    return tensor


# ------------------------------------------------------------------ what specwise.methods finds
#: the formats ``specwise export`` writes Medusa heads in
FORMATS = ("medusa",)


def recognize(config: dict[str, Any]) -> Format | None:
    """FasterDecoding's Medusa format when a parsed ``config.json`` has ``medusa_num_heads``, else ``None``."""
    if "medusa_num_heads" in config:
        return Format("medusa", "medusa", "Medusa (FasterDecoding)")
    return None


def export(network: MedusaHeads, target, out: str | Path, fmt: str, *, dtype: torch.dtype, **options) -> Exported:
    """``specwise export``'s entry for Medusa heads: :func:`export_medusa` (``fmt`` is one of
    :data:`FORMATS`, checked by the caller; option ``verifier``)."""
    return export_medusa(network, target, out, dtype=dtype, verifier=options.get("verifier"))
