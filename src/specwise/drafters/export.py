"""``specwise export``: a trained (or imported) drafter written in a format vLLM, SGLang or llama.cpp serves.

The drafter is loaded exactly as ``generate`` would load it for the target, then handed to the
format's writer in :mod:`specwise.interop`, which refuses what the format cannot express exactly.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specwise.drafters.checkpoint import shipped_drafter
from specwise.drafters.dflash import load_dflash
from specwise.drafters.eagle import load_eagle_head
from specwise.drafters.medusa import load_medusa_heads
from specwise.errors import DrafterError
from specwise.interop.dflash import export_dflash
from specwise.interop.eagle3 import EXPORT_FORMATS, export_eagle3
from specwise.interop.formats import Exported, detect
from specwise.interop.medusa import export_medusa

#: method -> the formats its drafters export to
FORMATS = {"eagle": EXPORT_FORMATS, "medusa": ("medusa",), "dflash": ("speculators",)}


def export_drafter(target, out: str | Path, fmt: str = "speculators", *, path: str | Path | None = None,
                   method: str | None = None, dtype: torch.dtype = torch.bfloat16, **options) -> Exported:
    """Write a drafter of ``target`` in a public format.

    Args:
        target: the :class:`specwise.engine.target.Target` the drafter runs on.
        out: the directory to write.
        fmt: ``"speculators"``, ``"eagle3"`` (SpecForge / SGLang) or ``"medusa"`` (FasterDecoding).
        path: the drafter's directory (any format ``--drafter`` reads); ``None``: the one shipped
            for ``method``.
        method: the drafter's method when ``path`` is not given (else read from its config).
        dtype: the weights' dtype.
        **options: the format writer's own (e.g. ``verifier``, ``speculative_tokens``,
            ``unbounded_attention`` for EAGLE-3).

    Returns:
        :class:`specwise.interop.formats.Exported`: the directory, the runtimes' caveats and their
        serve commands.

    Raises:
        DrafterError: no drafter found, a method or format that does not export, or a drafter the
            format cannot express exactly.
    """
    if path is None:
        if method is None:
            raise DrafterError("give the drafter's directory or --method to export the one shipped for the target.")
        path = shipped_drafter(target, method)
        if path is None or not Path(str(path)).is_dir():
            raise DrafterError(f"no {method} drafter ships for {target.name}; give its directory.")
    found = detect(path)
    if found is None:
        raise DrafterError(f"{path} is not a drafter directory of any known format.")
    if method is not None and found.method != method:
        raise DrafterError(f"{path} holds a {found.label} drafter, not a {method} one.")
    allowed = FORMATS.get(found.method, ())
    if fmt not in allowed:
        what = ", ".join(allowed) if allowed else "none yet"
        raise DrafterError(f"a {found.method} drafter exports to: {what} (not {fmt}); the draft model exports "
                           "with `specwise export-hf`.")
    if found.method == "eagle":
        return export_eagle3(load_eagle_head(path, target), target, out, fmt, dtype=dtype, **options)
    if found.method == "dflash":
        return export_dflash(load_dflash(path, target), target, out, dtype=dtype, verifier=options.get("verifier"),
                             unbounded_attention=bool(options.get("unbounded_attention")))
    if found.method == "medusa":
        return export_medusa(load_medusa_heads(path, target)[0], target, out, dtype=dtype,
                             verifier=options.get("verifier"))
    raise DrafterError(f"exporting {found.method} drafters to {fmt} is not supported yet (docs/interop.md).")
