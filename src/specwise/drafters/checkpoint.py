"""Drafter checkpoints: a directory with ``config.json`` and ``model.safetensors`` (docs/training.md).

``config.json`` records the method, the architecture, the target the drafter was trained for (its
name and a fingerprint of its config and vocabulary), the recipe and the measured results;
``model.safetensors`` holds the drafter's own weights in bf16 plus integer tables (the draft
vocabulary). Weights borrowed from the target (embeddings, LM head rows) are never stored.

Loading checks the fingerprint first: a drafter trained for another target is refused with an
error naming both.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from specwise.errors import DrafterError
from specwise.interop.formats import read_json
from specwise.targets.aliases import KNOWN_TARGETS

FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_FINGERPRINT_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "vocab_size", "head_dim")


def target_fingerprint(target) -> str:
    """A short hash of the target's architecture and tokenizer vocabulary.

    Two targets with the same fingerprint have the same shapes and map text to the same token ids,
    so a drafter trained for one runs on the other. Weights are not hashed (a fine-tuned target
    keeps its drafter; acceptance says how well it still fits).

    Computed once per target and tokenizer (kept in ``target.kept.once``, keyed by the tokenizer
    object itself and its length, so a tokenizer swapped or grown is hashed again): hashing a 262k-token
    vocabulary takes a tenth of a second, and every drafter built for the target asks.

    Returns:
        16 hex characters.
    """
    kept = getattr(target, "kept", None)
    if kept is None:
        return _fingerprint(target)
    # the key holds the tokenizer (hashed by identity), so no other tokenizer can take its place
    return kept.once.get(("fingerprint", target.tokenizer, len(target.tokenizer)), lambda: _fingerprint(target))


def _fingerprint(target) -> str:
    config = target.text_config
    shape = {key: getattr(config, key, None) for key in _FINGERPRINT_KEYS}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode())
    digest.update(str(target.vocab_size).encode())
    vocab = target.tokenizer.get_vocab()
    for token, index in sorted(vocab.items(), key=lambda item: item[1]):
        digest.update(f"{index}\t{token}\n".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:16]


@dataclass
class DrafterCheckpoint:
    """A drafter checkpoint in memory.

    Attributes:
        method: the registry name of the drafting method (``"draft"``, ``"medusa"``, ...).
        architecture: hyper-parameters the method's model is rebuilt from.
        target_name: the name of the target it was trained for.
        target_fingerprint: :func:`target_fingerprint` of that target.
        tensors: weights (floating point ones are stored as bf16) and integer tables.
        recipe: how it was trained (data, steps, minutes, optimizer settings).
        metrics: what was measured (τ, acceptance by position, ...).
    """

    method: str
    architecture: dict[str, Any]
    target_name: str
    target_fingerprint: str
    tensors: dict[str, torch.Tensor]
    recipe: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)

    def config_dict(self) -> dict[str, Any]:
        return {"specwise_drafter_format": FORMAT_VERSION, "method": self.method,
                "architecture": self.architecture,
                "target": {"name": self.target_name, "fingerprint": self.target_fingerprint},
                "recipe": self.recipe, "metrics": self.metrics}


def save_checkpoint(checkpoint: DrafterCheckpoint, path: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (floating point tensors cast to bf16).

    Returns:
        the directory.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: (t.detach().to(torch.bfloat16) if t.is_floating_point() else t.detach()).cpu().contiguous()
               for name, t in checkpoint.tensors.items()}
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(checkpoint.config_dict(), indent=2) + "\n")
    return out


def is_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is a specwise drafter directory (not, e.g., a plain HF model)."""
    config = Path(path) / CONFIG_NAME
    if not config.is_file():
        return False
    try:
        return "specwise_drafter_format" in json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def read_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a drafter directory.

    Raises:
        DrafterError: the directory or its config is missing or unreadable.
    """
    config = read_json(Path(path) / CONFIG_NAME)
    if config.get("specwise_drafter_format") != FORMAT_VERSION:
        raise DrafterError(f"{path} holds no drafter of a known format (specwise's, speculators, SpecForge EAGLE-3, "
                           "z-lab DFlash, FasterDecoding Medusa: docs/interop.md).")
    return config


def load_checkpoint(path: str | Path, target, method: str | None = None) -> DrafterCheckpoint:
    """Read a drafter directory made for ``target``.

    Args:
        path: the drafter directory.
        target: the :class:`specwise.targets.hf.Target` it will run on.
        method: when given, the method the caller expects.

    Returns:
        the checkpoint, tensors on CPU as stored.

    Raises:
        DrafterError: missing files, another method, or a drafter trained for another target (the
            message names both targets).
    """
    config = read_config(path)
    if method is not None and config.get("method") != method:
        raise DrafterError(f"{path} holds a {config.get('method')!r} drafter, not a {method!r} one.")
    trained_for = config.get("target", {})
    mine = target_fingerprint(target)
    if trained_for.get("fingerprint") != mine:
        raise DrafterError(
            f"the drafter in {path} was trained for target {trained_for.get('name')!r} "
            f"(fingerprint {trained_for.get('fingerprint')}), but the target is {target.name!r} "
            f"(fingerprint {mine}); train one for this target with `specwise train`."
        )
    weights = Path(path) / WEIGHTS_NAME
    if not weights.is_file():
        raise DrafterError(f"the drafter in {path} has no weights ({WEIGHTS_NAME} is missing).")
    try:
        tensors = load_file(str(weights))
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise DrafterError(f"cannot read {weights} ({exc}).") from None
    return DrafterCheckpoint(config["method"], config.get("architecture", {}), trained_for.get("name", ""),
                             trained_for.get("fingerprint", ""), tensors, config.get("recipe", {}),
                             config.get("metrics", {}))


def load_vocabulary_module(path: str | Path, target, method: str, what: str, config_cls,
                           build: Callable[[Any, torch.Tensor], torch.nn.Module], *,
                           tuple_fields: tuple[str, ...] = (), extras: tuple[str, ...] = ()):
    """Load a drafter module that maps to the target through a draft vocabulary (EAGLE, Medusa, DFlash).

    Args:
        path: the drafter directory.
        target: the :class:`specwise.targets.hf.Target` it will run on.
        method: the method the checkpoint must hold.
        what: how errors name the module, e.g. ``"the EAGLE head"``.
        config_cls: the architecture dataclass, built from the checkpoint's ``architecture``.
        build: ``(config, draft vocabulary [Vd] long) -> module`` with the target's borrowed weights.
        tuple_fields: architecture fields stored as JSON lists that the config wants as tuples.
        extras: architecture entries that are not config fields (tuned defaults), returned apart.

    Returns:
        ``(module, extras)``: the module in the target's dtype and on its device, eval mode, frozen;
        and ``{name: value or None}`` for each of ``extras``.

    Raises:
        DrafterError: another method or target, an unknown architecture, no draft vocabulary, or
            weights that do not fit.
    """
    ckpt = load_checkpoint(path, target, method=method)
    arch = dict(ckpt.architecture)
    found = {name: arch.pop(name, None) for name in extras}
    for name in tuple_fields:
        arch[name] = tuple(arch.get(name, ()))
    try:
        config = config_cls(**arch)
    except TypeError as exc:
        raise DrafterError(f"{what} in {path} has an unknown architecture ({exc}).") from None
    if "draft_vocab" not in ckpt.tensors:
        raise DrafterError(f"{what} in {path} has no draft vocabulary table.")
    module = build(config, ckpt.tensors["draft_vocab"].long())
    weights = {k: v for k, v in ckpt.tensors.items() if k != "draft_vocab"}
    missing, unexpected = module.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise DrafterError(f"the weights in {path} do not fit {what} (missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}).")
    return module.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False), found


def shipped_drafter(target, method: str) -> Path | str | None:
    """The default drafter of ``method`` for ``target`` (a Target, or its name), if any: the trained
    drafter that ships with specwise, else for ``draft`` the alias of the pretrained small model of
    the target's family (``qwen2.5-coder-0.5b-instruct`` for ``qwen2.5-coder-1.5b-instruct``)."""
    name = target if isinstance(target, str) else target.name
    path = Path(str(files("specwise").joinpath(f"data/drafters/{name}/{method}")))
    if (path / "config.json").is_file():
        return path
    known = KNOWN_TARGETS.get(name)
    return known.draft_model if method == "draft" and known is not None and known.draft_model else None
