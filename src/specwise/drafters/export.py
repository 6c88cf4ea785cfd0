"""``specwise export``: a trained (or imported) drafter written in a format vLLM, SGLang or llama.cpp serves.

The drafter is loaded exactly as ``generate`` would load it for the target, then handed to the
writer in the method's folder (``specwise.methods.<method>.interop``), which refuses what the format cannot express exactly.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from specwise.discovery import import_methods
from specwise.drafters.checkpoint import shipped_drafter
from specwise.errors import DrafterError
from specwise.interop.formats import Exported, Format, detect


def export_formats() -> dict[str, tuple[str, ...]]:
    """Method -> the formats its drafters export to: every method folder whose ``interop`` module
    declares ``FORMATS`` (:mod:`specwise.methods`)."""
    return {module.__name__.split(".")[-2]: tuple(module.FORMATS) for module in import_methods("interop")
            if getattr(module, "FORMATS", None)}


def resolve_export(target, fmt: str, path: str | Path | None = None, method: str | None = None) -> tuple[Path, Format]:
    """The drafter directory an export reads and its format, checked against ``fmt`` before any
    model is loaded.

    Args:
        target: the :class:`specwise.targets.hf.Target`, or its name.
        fmt: the format to write.
        path: the drafter's directory; ``None``: the one shipped for ``method``.
        method: the drafter's method when ``path`` is not given.

    Raises:
        DrafterError: no such directory, no drafter of a known format in it, a method without a
            drafter to export, or a format the method does not export to.
    """
    name = target if isinstance(target, str) else target.name
    formats = export_formats()
    if path is None:
        if method is None:
            raise DrafterError("give the drafter's directory, or the method whose shipped drafter to export.")
        if method not in formats:
            raise DrafterError(f"method {method!r} has no trained drafter to export; these do: {', '.join(formats)}"
                               + (" (the draft model exports with `specwise export-hf`)." if method == "draft" else "."))
        path = shipped_drafter(name, method)
        if path is None or not Path(str(path)).is_dir():
            raise DrafterError(f"no {method} drafter ships for {name}; give its directory.")
    path = Path(str(path))
    if not path.is_dir():
        raise DrafterError(f"the drafter directory {path} does not exist.")
    found = detect(path)
    if found is None:
        raise DrafterError(f"{path} holds no drafter of a known format (its config.json is missing, unreadable or "
                           "of none of: specwise, speculators, SpecForge EAGLE-3, z-lab DFlash, Medusa).")
    if method is not None and found.method != method:
        raise DrafterError(f"{path} holds a {found.label} drafter, not a {method} one.")
    allowed = formats.get(found.method)
    if allowed is None:
        raise DrafterError(f"{path} holds a {found.label} drafter, which does not export"
                           + (" (the draft model exports with `specwise export-hf`)." if found.method == "draft" else "."))
    if fmt not in allowed:
        raise DrafterError(f"{found.method} drafters export to {' or '.join(allowed)}, not {fmt}.")
    return path, found


def export_drafter(target, out: str | Path, fmt: str = "speculators", *, path: str | Path | None = None,
                   method: str | None = None, dtype: torch.dtype = torch.bfloat16, **options) -> Exported:
    """Write a drafter of ``target`` in a public format.

    Args:
        target: the :class:`specwise.targets.hf.Target` the drafter runs on
            (``specwise.load_target("gemma-3-270m")``).
        out: the directory to write (new or empty).
        fmt: ``"speculators"``, ``"eagle3"`` (SpecForge / SGLang) or ``"medusa"`` (FasterDecoding).
        path: the drafter's directory (any format ``--drafter`` reads); ``None``: the one shipped
            for ``method``.
        method: the drafter's method when ``path`` is not given (else read from its config).
        dtype: the weights' dtype.
        **options: the format writer's own (``verifier``, ``speculative_tokens`` and
            ``unbounded_attention`` for EAGLE-3; ``verifier``, ``unbounded_attention`` for DFlash).

    Returns:
        :class:`specwise.interop.formats.Exported`: the directory, the runtimes' caveats and the
        serve commands of the runtimes that run it.

    Raises:
        DrafterError: what :func:`resolve_export` refuses, an output path that is a file or holds
            files, or a drafter the format cannot express exactly.
    """
    path, found = resolve_export(target, fmt, path, method)
    network = load_network(found.method, path, target)
    writer = importlib.import_module(f"specwise.methods.{found.method}.interop")  # its interop writes it
    return writer.export(network, target, out, fmt, dtype=dtype, **options)


def load_network(method: str, path: str | Path, target):
    """The torch network of ``method``'s drafter stored at ``path``, for ``target``: loaded by the
    method folder's own ``drafter.load_network``, as :func:`specwise.generate` would load it (the
    registry finds the folder by name, so nothing below the methods imports one).

    Raises:
        DrafterError: not that method's drafter, trained for another target, or bad weights.
    """
    return importlib.import_module(f"specwise.methods.{method}.drafter").load_network(path, target)
