"""Pack a loaded Hugging Face model's GGUF-born weights at their own precision, and cache the result.

:func:`pack_from_gguf` reads every tensor of the GGUF file the model was converted from, maps it to
the model's module by transformers' own GGUF name map, and packs each linear layer in the form
:func:`form_of` gives its block type (int4 groups, int8 rows) and the token embedding as its own
codes; norms and float tensors stay dense. Each packed tensor is checked against the dense weight
already loaded: a name map or row order that disagrees leaves that tensor dense instead of silently
changing the model.

The packed tensors are saved once (:func:`save_native`) in one directory per form beside the dense
cache, with a manifest naming every packed module, and re-applied in seconds by :func:`apply_native`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

from specwise.targets.native.blocks import PLANE_TYPES, Affine, affine_from_blocks, planes_from_affine
from specwise.targets.native.modules import Int8Linear, PackedEmbedding, PackedLinear, int8_rows

FORMAT = 1  # bump when the saved layout changes: an older cache is then rebuilt, never misread


@dataclass
class PackReport:
    """What :func:`pack_from_gguf` did.

    Attributes:
        packed: module path -> ``{"type": GGUF block type, "form": "int4" | "int8" |
            "embedding"}`` for every module packed.
        dense: GGUF tensor name -> why it stayed dense (its block type, or a failed check).
        deviation: ``"<block type> as <form>"`` -> largest ``|packed - GGUF dequantized|`` over its
            tensors (a sample of rows), in the activation dtype the model runs in.
    """

    packed: dict[str, dict] = field(default_factory=dict)
    dense: dict[str, str] = field(default_factory=dict)
    deviation: dict[str, float] = field(default_factory=dict)


def pack_from_gguf(model: nn.Module, gguf_path: Path, dtype: torch.dtype,
                   exact: bool = False) -> tuple[dict, PackReport]:
    """Build packed modules for ``model`` from the GGUF file it was converted from.

    Each linear layer takes the closest form torch's CPU kernels multiply (:func:`form_of`): 4-bit
    types as int4 groups (exact); wider types as int8 rows, or with ``exact`` as several int4 planes
    (exact, slower). The token embedding keeps its codes exactly; a tied LM head is a linear layer
    over the same table.

    Args:
        model: the dense model (weights as transformers dequantized them, any float dtype).
        gguf_path: the GGUF file.
        dtype: activation dtype the deviations are measured in.
        exact: pack wider types as exact int4 planes instead of int8 rows.

    Returns:
        ``(tensors, report)``: ``tensors`` maps ``"<module path>.<array>"`` to what
        :func:`save_native` writes (codes and float32 factors, independent of ``dtype``).
    """
    reader = gguf.GGUFReader(str(gguf_path))
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field is not None else ""
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    to_hf = get_gguf_hf_weights_map(model, processor)
    modules = dict(model.named_modules())
    tensors: dict[str, torch.Tensor] = {}
    report = PackReport()
    embedding_name = _module_path(model, model.get_input_embeddings())
    head_name = _module_path(model, model.get_output_embeddings())
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    for tensor in reader.tensors:
        kind, hf_name = tensor.tensor_type.name, to_hf.get(tensor.name, "")
        path = hf_name.removesuffix(".weight")
        module = modules.get(path)
        if not hf_name.endswith(".weight") or not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        uses = [(path, "embedding" if path == embedding_name else form_of(kind, exact))]
        if path == embedding_name and head_name and not has_output and _tied(model):
            uses.append((head_name, form_of(kind, exact)))  # the tied LM head reads the same table
        for use, form in uses:
            if form == "int4" and int(tensor.shape[1]) % 16:  # the kernel tiles 16 output rows
                form = None if exact else "int8"
            if form is None or (form == "embedding" and kind not in PLANE_TYPES):
                report.dense[tensor.name] = kind
                continue
            arrays, deviation = _pack(tensor, form, processor, module.weight, dtype)
            if arrays is None:
                report.dense[tensor.name] = f"{kind}: does not match the loaded weight"
                continue
            tensors.update({f"{use}.{key}": value for key, value in arrays.items()})
            report.packed[use] = {"type": kind, "form": form}
            key = f"{kind} as {form}"
            report.deviation[key] = max(report.deviation.get(key, 0.0), deviation)
    return tensors, report


INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})


def form_of(block_type: str, exact: bool = False) -> str | None:
    """How a linear weight of this GGUF block type is packed: ``"int4"`` (groups of 32, one plane
    per 4 bits), ``"int8"`` (int8 rows, requantized) or ``None`` (kept dense: F32, F16, BF16, and with ``exact``
    every type without an exact int4 form, such as Q6_K)."""
    if block_type in INT4_TYPES or (exact and block_type in PLANE_TYPES):
        return "int4"
    if not exact and block_type.startswith(("Q", "IQ", "TQ")):
        return "int8"
    return None


def save_native(directory: Path, tensors: dict, report: PackReport) -> None:
    """Write ``weights.safetensors`` and ``manifest.json`` into ``directory`` (created)."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "weights.safetensors"))
    manifest = {"format": FORMAT, "weights": "native", "packed": report.packed, "dense": report.dense,
                "deviation": report.deviation}
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def read_manifest(directory: Path) -> dict | None:
    """The manifest of a native cache, or ``None`` when absent or of another format."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    ok = manifest.get("format") == FORMAT and manifest.get("weights") == "native"
    return manifest if ok and (directory / "weights.safetensors").is_file() else None


def apply_native(model: nn.Module, directory: Path, dtype: torch.dtype) -> dict:
    """Replace the manifest's modules of ``model`` by packed ones; returns the manifest.

    Raises:
        ValueError: the directory holds no native cache of this format, or a module it names is
            missing from ``model``.
    """
    manifest = read_manifest(directory)
    if manifest is None:
        raise ValueError(f"{directory} holds no native weights of format {FORMAT}.")
    arrays = load_file(str(directory / "weights.safetensors"))
    for path, entry in manifest["packed"].items():
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, attr, _module(entry["form"], arrays, path, getattr(parent, attr), dtype))
    return manifest


def _module(form: str, arrays: dict, path: str, old: nn.Module, dtype: torch.dtype) -> nn.Module:
    get = lambda key: arrays[f"{path}.{key}"]  # noqa: E731
    if form == "int8":
        return Int8Linear(get("codes"), get("row_scale"), getattr(old, "bias", None), dtype)
    affine = Affine(codes=get("codes").numpy(), scale=get("scale").numpy(), offset=get("offset").numpy(),
                    bits=int(get("bits")))
    if form == "embedding":
        return PackedEmbedding(affine, dtype, getattr(old, "embed_scale", None))
    return PackedLinear(planes_from_affine(affine), getattr(old, "bias", None), dtype)


def _pack(tensor, form: str, processor, loaded: torch.Tensor, dtype: torch.dtype):
    """``(arrays, deviation)`` of one tensor in one form, or ``(None, 0)`` when its dequantization
    (in the model's row order) does not match the weight already loaded."""
    kind = tensor.tensor_type.name
    k, n = (int(s) for s in tensor.shape[:2])
    order = _row_order(processor, tensor.name, n)
    if order is None:
        return None, 0.0
    if form == "int8":
        dense = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(n, k)[order]
        if not _matches(dense, loaded):
            return None, 0.0
        codes, scale = int8_rows(dense)
        ours = Int8Linear(codes, scale, None, dtype).weight.float().numpy()
        return {"codes": codes, "row_scale": scale}, float(np.abs(ours - dense).max())
    affine = affine_from_blocks(tensor.data, kind, (n, k))
    affine = Affine(codes=affine.codes[order], scale=affine.scale[order], offset=affine.offset[order], bits=affine.bits)
    if not _matches(affine.dequantize(), loaded):
        return None, 0.0
    arrays = {"codes": torch.from_numpy(affine.codes), "scale": torch.from_numpy(affine.scale),
              "offset": torch.from_numpy(affine.offset), "bits": torch.tensor(affine.bits)}
    return arrays, _deviation(affine, dtype, embedding=form == "embedding")


def _row_order(processor, name: str, n: int) -> np.ndarray | None:
    """The row permutation transformers' GGUF loading applies to this tensor (``None``: not one)."""
    rows = processor.process(weights=np.arange(n, dtype=np.float64)[:, None], name=name).weights
    order = np.asarray(rows).reshape(-1)
    if order.shape != (n,) or not np.array_equal(np.sort(order), np.arange(n)):
        return None
    return order.astype(np.int64)


def _matches(ours: np.ndarray, weight: torch.Tensor) -> bool:
    """Whether our float32 dequantization is the loaded dense weight (up to that weight's dtype)."""
    if tuple(weight.shape) != tuple(ours.shape):
        return False
    dense = weight.detach().float().cpu().numpy()
    tolerance = float(torch.finfo(weight.dtype).eps) * np.abs(ours) + 1e-6
    return bool((np.abs(dense - ours) <= tolerance).all())


def _deviation(affine: Affine, dtype: torch.dtype, embedding: bool) -> float:
    """Largest ``|w_packed - w_gguf|`` over a sample of rows, in ``dtype``."""
    rows = slice(0, min(affine.codes.shape[0], 4096))
    sample = Affine(codes=affine.codes[rows], scale=affine.scale[rows], offset=affine.offset[rows], bits=affine.bits)
    module = PackedEmbedding(sample, dtype) if embedding else PackedLinear(planes_from_affine(sample), None, dtype)
    return float(np.abs(module.weight.float().numpy() - sample.dequantize()).max())


def _module_path(model: nn.Module, module: nn.Module | None) -> str:
    for name, candidate in model.named_modules():
        if candidate is module:
            return name
    return ""


def _tied(model: nn.Module) -> bool:
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and head.weight.data_ptr() == embedding.weight.data_ptr() or bool(
        getattr(model.config.get_text_config(), "tie_word_embeddings", False))

