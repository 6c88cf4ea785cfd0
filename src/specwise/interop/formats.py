"""Which drafter format a directory holds, and reading its files (docs/interop.md).

A directory is recognized by its ``config.json`` alone:

============================  ==========================================================  ========
format                        recognized by                                               method
============================  ==========================================================  ========
``specwise``                  ``specwise_drafter_format``                                 its own
``speculators``               ``speculators_model_type`` ``"eagle3"`` / ``"dflash"``      eagle / dflash
``eagle3`` (SpecForge/SGLang) ``architectures`` ``LlamaForCausalLMEagle3``                eagle
``dflash`` (z-lab)            ``dflash_config`` or ``architectures`` ``DFlashDraftModel`` dflash
``medusa`` (FasterDecoding)   ``medusa_num_heads``                                        medusa
``hf``                        any other ``architectures`` (a causal LM: a draft model)    draft
============================  ==========================================================  ========
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from specwise.errors import DrafterError

CONFIG_NAME = "config.json"
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
DFLASH_ARCHITECTURES = ("DFlashDraftModel",)


@dataclass(frozen=True)
class Format:
    """A drafter directory's format and the method its drafter serves.

    Attributes:
        name: ``"specwise"``, ``"speculators"``, ``"eagle3"``, ``"dflash"``, ``"medusa"`` or ``"hf"``.
        method: the specwise method that runs it (``"eagle"``, ``"dflash"``, ``"medusa"``, ``"draft"``).
        label: how messages name the format, e.g. ``"speculators (EAGLE-3)"``.
    """

    name: str
    method: str
    label: str


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``.

    Raises:
        DrafterError: the file is missing, not JSON, or not an object.
    """
    if not path.is_file():
        raise DrafterError(f"{path.parent} is not a drafter directory: {path.name} is missing.")
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DrafterError(f"{path} is not valid JSON ({exc}).") from None
    if not isinstance(value, dict):
        raise DrafterError(f"{path} does not hold a JSON object.")
    return value


def detect(path: str | Path) -> Format | None:
    """The format of the drafter directory ``path`` (module docstring), or ``None`` when its
    ``config.json`` is missing, unreadable or of no known drafter format."""
    config_path = Path(path) / CONFIG_NAME
    try:
        config = read_json(config_path)
    except DrafterError:
        return None
    return format_of(config)


def format_of(config: dict[str, Any]) -> Format | None:
    """The format a parsed ``config.json`` declares (see :func:`detect`)."""
    architectures = config.get("architectures") or []
    if "specwise_drafter_format" in config:
        method = str(config.get("method"))
        return Format("specwise", method, f"specwise ({method})")
    kind = config.get("speculators_model_type")
    if kind == "eagle3":
        return Format("speculators", "eagle", "speculators (EAGLE-3)")
    if kind == "dflash":
        return Format("speculators", "dflash", "speculators (DFlash)")
    if any(name in EAGLE3_ARCHITECTURES for name in architectures):
        return Format("eagle3", "eagle", "EAGLE-3 (SpecForge / SGLang)")
    if "dflash_config" in config or any(name in DFLASH_ARCHITECTURES for name in architectures):
        return Format("dflash", "dflash", "DFlash (z-lab)")
    if "medusa_num_heads" in config:
        return Format("medusa", "medusa", "Medusa (FasterDecoding)")
    if kind is None and architectures:
        return Format("hf", "draft", "Hugging Face causal LM")
    return None


def check_method(path: str | Path, method: str) -> Format | None:
    """The format of ``path`` when it is a foreign format for ``method``; ``None`` for a specwise
    checkpoint or an unrecognized directory (the caller's own loader reports those).

    Raises:
        DrafterError: the directory holds a drafter of another method (the message names the
            method that runs it).
    """
    found = detect(path)
    if found is None or found.name == "specwise":
        return None
    if found.method != method:
        raise DrafterError(f"{path} holds a {found.label} drafter, which runs with --method {found.method}, "
                           f"not {method}.")
    return found


def load_weights(path: str | Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """All tensors of the first of ``names`` (files in ``path``) that exists; a name ending in
    ``.safetensors`` also matches its shards (``model-00001-of-00002.safetensors``), a ``.bin``/``.pt``
    file is read with ``torch.load(weights_only=True)``.

    Raises:
        DrafterError: none of the files exists, or one cannot be read.
    """
    root = Path(path)
    for name in names:
        files = [root / name]
        if name.endswith(".safetensors") and not files[0].is_file():
            files = sorted(root.glob(name.removesuffix(".safetensors") + "-*-of-*.safetensors"))
        files = [f for f in files if f.is_file()]
        if not files:
            continue
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            try:
                if file.suffix == ".safetensors":
                    tensors.update(load_file(str(file)))
                else:
                    tensors.update(torch.load(file, map_location="cpu", weights_only=True))
            except Exception as exc:  # noqa: BLE001 - safetensors and pickle raise several types
                raise DrafterError(f"cannot read {file} ({exc}).") from None
        return tensors
    raise DrafterError(f"{root} has no weights (looked for {', '.join(names)}).")


def require(config: dict[str, Any], key: str, where: str) -> Any:
    """``config[key]``.

    Raises:
        DrafterError: the key is missing (the message names it and the file).
    """
    if key not in config or config[key] is None:
        raise DrafterError(f"{where} has no {key!r}: it is required.")
    return config[key]
