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
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specwise.discovery import import_methods
from specwise.errors import DrafterError
from specwise.targets.aliases import KNOWN_TARGETS

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config layout the exports follow
#: HF activation names -> specwise's, and back
ACT_FROM_HF = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
ACT_TO_HF = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


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
    """The format a parsed ``config.json`` declares (see :func:`detect`): ours, else the first
    trained method whose ``interop.recognize`` claims it (:mod:`specwise.methods`), else a causal
    LM for ``draft`` when the config names architectures and no speculators type."""
    if "specwise_drafter_format" in config:
        method = str(config.get("method"))
        return Format("specwise", method, f"specwise ({method})")
    for module in import_methods("interop"):
        recognize = getattr(module, "recognize", None)  # a folder may read formats it never detects
        found = recognize(config) if recognize is not None else None
        if found is not None:
            return found
    if config.get("speculators_model_type") is None and config.get("architectures"):
        return Format("hf", "draft", "Hugging Face causal LM")
    return None


def prepare_out(out: str | Path, create: bool = True) -> Path:
    """The export directory, created (unless ``create`` is false: only checked); refused when it is
    a file or already holds files (an export never mixes with stale weights).

    Raises:
        DrafterError: ``out`` is a file, a non-empty directory, or cannot be created.
    """
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise DrafterError(f"{path} is a file, not a directory to export into.")
    if path.is_dir() and any(path.iterdir()):
        raise DrafterError(f"{path} already holds files; export into a new or empty directory.")
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DrafterError(f"cannot create {path} ({exc.strerror or exc}).") from None
    return path


def write_export(path: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                 weights_name: str = WEIGHTS_NAME) -> None:
    """Write an export's weights (safetensors) and ``config.json``, readable by other users like the
    config (a server often runs as another user; safetensors alone writes owner-only files)."""
    save_file(tensors, str(path / weights_name), metadata={"format": "pt"})
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    mode = (path / CONFIG_NAME).stat().st_mode & 0o777
    os.chmod(path / weights_name, mode)


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


def mapped_state(weights: dict[str, torch.Tensor], mapping: dict[str, str], module: torch.nn.Module,
                 where: str) -> dict[str, torch.Tensor]:
    """A public checkpoint's tensors under ``module``'s own names, every tensor accounted for.

    Args:
        weights: the file's tensors.
        mapping: public name -> the module's ``state_dict`` name.
        module: the module they load into (its ``state_dict`` gives the expected names and shapes).
        where: how messages name the drafter.

    Returns:
        the state dict to load.

    Raises:
        DrafterError: a tensor of no known name (a variant specwise does not run: never dropped, as
            a lenient loader would), a tensor the module needs missing, or a shape that differs.
    """
    state: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name in mapping:
            state[mapping[name]] = tensor
        elif not name.startswith(("verifier_", "target_")):  # the target's head and norm some trainers keep
            raise DrafterError(f"{where} holds a tensor specwise does not know ({name!r}): a variant it does not run.")
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        public = {ours: theirs for theirs, ours in mapping.items()}
        raise DrafterError(f"{where} is missing {public.get(missing[0], missing[0])!r}"
                           + (f" (and {len(missing) - 1} more)." if len(missing) > 1 else "."))
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise DrafterError(f"{where}: {name} has shape {list(tensor.shape)}, the config implies "
                               f"{list(expected[name].shape)}.")
    return state


def check_layer(layer: dict[str, Any], where: str) -> str:
    """Refuse the layer variants specwise's drafters do not compute; return specwise's name of
    the layer's activation.

    Raises:
        DrafterError: biases, rope scaling, or an activation other than SiLU / tanh-GELU.
    """
    for flag in ("attention_bias", "mlp_bias"):
        if layer.get(flag):
            raise DrafterError(f"{where} has biases ({flag}), a variant specwise does not run yet.")
    scaling = layer.get("rope_scaling") or {}
    kind = (layer.get("rope_parameters") or {}).get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise DrafterError(f"{where} uses {kind!r} rope scaling, which specwise does not run yet.")
    act = str(layer.get("hidden_act", "silu"))
    if act not in ACT_FROM_HF:
        raise DrafterError(f"{where} uses activation {act!r}; specwise runs {sorted(ACT_FROM_HF)}.")
    return ACT_FROM_HF[act]


def rope_theta(layer: dict[str, Any]) -> float:
    """The rotary base of an HF layer config (transformers 5 ``rope_parameters`` or the older key)."""
    return float((layer.get("rope_parameters") or {}).get("rope_theta", layer.get("rope_theta", 10000.0)))


def verifier_name(target) -> str:
    """What runtimes call ``target``: its Hugging Face repository when known, else its name."""
    known = KNOWN_TARGETS.get(target.name)
    return (known.hf_repo if known is not None and known.hf_repo else None) or target.name


@dataclass
class Exported:
    """What an export wrote and where it can run (the writers in each method folder's ``interop``).

    Attributes:
        path: the directory written.
        caveats: one sentence per runtime that cannot run the drafter as it is (empty for a
            standard drafter on a target every runtime serves).
        serve: runtime name -> the command that serves it (``vllm``, ``sglang``, ``llama.cpp``), for
            the runtimes that run it as it is (none may).
    """

    path: Path
    caveats: list[str] = field(default_factory=list)
    serve: dict[str, str] = field(default_factory=dict)
