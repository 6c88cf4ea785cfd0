"""Choose and apply a GGUF target's weights: dense (``"bf16"``) or packed at their own precision.

``"native"`` keeps 4-bit blocks as int4 groups (exact) and wider ones as int8 rows;
``"native-exact"`` keeps every 4-, 5- and 8-bit block exact (wider types as several int4 planes,
Q6_K dense); ``"bf16"`` is the dense dequantized model in the requested dtype. Each native form is
cached once beside the dense safetensors (``<model dir>/<form>/``), so switching never mixes them.
With no choice given, the form that measured faster on this machine is used: the first load
times a decoding step and an 8-token verification of both and records the result
(``<model dir>/speed.json``, keyed by CPU capability, threads and dtype).
"""

from __future__ import annotations

import copy
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from specwise.errors import ConfigError
from specwise.targets.kv_cache import KVCache
from specwise.targets.native.convert import apply_native, pack_from_gguf, read_manifest, save_native
from specwise.targets.native.modules import Int8Linear, PackedEmbedding, PackedLinear

WEIGHTS: tuple[str, ...] = ("native", "native-exact", "bf16")
NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WEIGHTS_HELP = ("target weights: native (the GGUF's own precision on torch's packed CPU kernels), native-exact, "
                "bf16 (dense), or auto: the faster measured on this machine (default)")


def auto_or_one_of(what: str, value: str | None, choices: tuple[str, ...]) -> str | None:
    """``value`` if it is one of ``choices``; ``None`` for ``None`` or ``"auto"`` (the faster measured).

    Raises:
        ConfigError: any other value, named as ``what``.
    """
    if value is None or value == "auto":
        return None
    if value in choices:
        return value
    raise ConfigError(f"unknown {what} {value!r}; choose auto or one of {', '.join(choices)}.")


def check_weights(weights: str | None) -> str | None:
    """One of :data:`WEIGHTS`, or ``None`` for the faster measured form (also spelt ``"auto"``).

    Raises:
        ConfigError: any other value.
    """
    return auto_or_one_of("weights", weights, WEIGHTS)


def weights_of(model: nn.Module) -> str:
    """Which weights a loaded model holds: ``"native"`` (int8 rows, which only that form uses, or
    only single-plane int4: a file of 4-bit blocks packs identically in both native forms),
    ``"native-exact"`` (several exact int4 planes and no int8 rows) or ``"bf16"`` (dense)."""
    packed = [m for m in model.modules() if isinstance(m, (PackedLinear, PackedEmbedding, Int8Linear))]
    if not packed:
        return "bf16"
    if any(isinstance(m, Int8Linear) for m in packed):
        return "native"
    return "native-exact" if any(isinstance(m, PackedLinear) and m.num_planes > 1 for m in packed) else "native"


def native_supported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why packed weights cannot run here (one sentence), or ``None`` when they can."""
    if device.type != "cpu":
        return f"native weights run on torch's CPU kernels, not on {device.type}; use weights='bf16'."
    if dtype not in NATIVE_DTYPES:
        return f"native weights compute in bfloat16, float16 or float32, not {str(dtype).removeprefix('torch.')}."
    return None


def apply_weights(
    model: nn.Module,
    model_dir: Path,
    make_gguf: Callable[[Path], Path],
    weights: str | None,
    dtype: torch.dtype,
    progress: Callable[[str], None] | None = None,
) -> str:
    """Turn the freshly loaded dense ``model`` (in ``dtype``, on CPU) into the weights asked for.

    Args:
        model: dense model converted from a GGUF file; changed in place.
        model_dir: its dense safetensors cache directory.
        make_gguf: ``make_gguf(tmp) -> path`` of the GGUF file (may write into scratch dir ``tmp``).
        weights: one of :data:`WEIGHTS`, or ``None`` for the faster recorded form.
        dtype: the model's dtype.

    Returns:
        The weights the model now holds.

    Raises:
        ConfigError: ``weights`` is unknown.
    """
    weights = check_weights(weights)
    if weights == "bf16":
        return "bf16"
    if weights is None:
        return _apply_faster(model, model_dir, make_gguf, dtype, progress)
    directory = _native_dir(model, model_dir, make_gguf, weights, progress)
    apply_native(model, directory, dtype)
    return weights


def _native_dir(model, model_dir: Path, make_gguf, form: str, progress) -> Path:
    """The cache directory of one native form, packed from the GGUF file on first use."""
    directory = model_dir / form
    if read_manifest(directory) is not None:
        return directory
    if progress is not None:
        progress(f"first {form} load: packing the GGUF weights under {directory} (about a minute, once)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{form}.partial-", dir=model_dir))
    try:
        tensors, report = pack_from_gguf(model, Path(make_gguf(tmp)), next(model.parameters()).dtype,
                                         exact=form == "native-exact")
        save_native(tmp / "out", tensors, report)
        shutil.rmtree(directory, ignore_errors=True)  # an older format's cache
        try:
            (tmp / "out").rename(directory)
        except OSError:
            if read_manifest(directory) is None:  # not a lost race with another process
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def _apply_faster(model, model_dir: Path, make_gguf, dtype: torch.dtype, progress) -> str:
    """Apply the form recorded as faster here, measuring both on the first load."""
    record_path = model_dir / "speed.json"
    key = f"{platform.machine()}-{torch.backends.cpu.get_cpu_capability()}-{torch.get_num_threads()}t-{dtype}"
    try:
        records = json.loads(record_path.read_text())
    except (OSError, ValueError):
        records = {}
    if key not in records:
        if progress is not None:
            progress("first load here: timing dense against native weights to pick the faster (once)")
        directory = _native_dir(model, model_dir, make_gguf, "native", progress)
        packed = copy.deepcopy(model)
        apply_native(packed, directory, dtype)
        timings = {"bf16": forward_ms(model), "native": forward_ms(packed)}
        del packed
        timings["faster"] = min(("bf16", "native"), key=lambda k: sum(timings[k]))
        records[key] = timings
        record_path.write_text(json.dumps(records, indent=1, sort_keys=True))
    if records[key].get("faster") != "native":
        return "bf16"
    apply_native(model, _native_dir(model, model_dir, make_gguf, "native", progress), dtype)
    return "native"


@torch.inference_mode()
def forward_ms(model: nn.Module, context: int = 64, repeats: int = 7) -> list[float]:
    """Median milliseconds of a one-token and an eight-token forward after ``context`` cached tokens:
    ``[decode step, 8-token verification]``."""
    ids = torch.arange(10, 10 + context + 8)[None]
    cache = KVCache()  # the engine's own: it rolls sliding-window layers back too
    model(input_ids=ids[:, :context], cache=cache.hf_cache, use_cache=True, logits_to_keep=1)  # one prefill, untimed
    out = []
    for width in (1, 8):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(input_ids=ids[:, context:context + width], cache=cache.hf_cache, use_cache=True,
                  logits_to_keep=width)
            times.append((time.perf_counter() - start) * 1e3)
            cache.rollback(context)  # back to the prefix, so every repeat verifies after the same context
        out.append(statistics.median(times))
    return out
