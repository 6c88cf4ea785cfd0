"""Which engine runs a GGUF target faster on this machine: torch (packed or dense weights) or
llama.cpp (ggml). Measured on the first load here and recorded in the cache, as the weight form is
(:mod:`specwise.targets.native.weights`): the step and verification costs of the two engines differ
several-fold between CPUs (AVX2, AVX-512, AMX), so no constant can choose.

The measurement times, on each engine, a one-token decoding step and an 8-token verification after
64 cached tokens (the median of 7 each, through the target interface the loop itself uses) and picks
the smaller sum. The record (``<cache>/engines.json``) is keyed by the GGUF file (path, size,
modification time), CPU capability, threads and dtype.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from specwise.targets.native.weights import auto_or_one_of

ENGINES: tuple[str, ...] = ("torch", "llamacpp")
ENGINE_HELP = ("torch, llamacpp (a GGUF target on llama.cpp's own engine: the file's precision; --dtype and "
               "--weights do not apply), or auto: the faster measured here for a GGUF target (the first load "
               "times both, once), torch for any other")


def check_engine_name(engine: str | None) -> str | None:
    """One of :data:`ENGINES`, or ``None`` for the faster measured (also spelt ``"auto"``).

    Raises:
        ConfigError: any other value.
    """
    return auto_or_one_of("engine", engine, ENGINES)


@torch.inference_mode()
def step_ms(target, context: int = 64, repeats: int = 7) -> list[float]:
    """Median milliseconds of a one-token and an 8-token forward of ``target`` (any engine) after
    ``context`` cached tokens: ``[decoding step, 8-token verification]``."""
    ids = torch.arange(10, 10 + context + 8) % target.vocab_size
    cache = target.new_cache()
    target.forward(ids[:context], cache, num_logits=1)  # the prefill, untimed
    out = []
    for width in (1, 8):
        times = []
        for _ in range(repeats + 1):  # the first of each width warms its kernels, untimed
            start = time.perf_counter()
            target.forward(ids[context:context + width], cache, num_logits=width)
            times.append((time.perf_counter() - start) * 1e3)
            cache.rollback(context)
        out.append(statistics.median(times[1:]))
    return out


def record_key(gguf: Path, dtype: torch.dtype) -> str:
    """The record's key: the file as it is now, and what makes speeds differ between machines."""
    stat = gguf.stat()
    return (f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{platform.machine()}-"
            f"{torch.backends.cpu.get_cpu_capability()}-{torch.get_num_threads()}t-{dtype}")


def faster_engine(gguf: Path, dtype: torch.dtype, cache_root: Path, load: Callable[[str], object],
                  progress: Callable[[str], None] | None = None) -> tuple[str, object | None]:
    """The engine recorded as faster for ``gguf`` here, measuring both on the first call.

    Args:
        gguf: the target's GGUF file.
        dtype: the torch engine's dtype.
        cache_root: specwise's cache directory.
        load: ``load(engine) -> target`` for ``"torch"`` and ``"llamacpp"``.
        progress: told when the (one-time) measurement starts.

    Returns:
        ``(engine, target)``: the target is the winner if it was loaded to measure, else ``None``.
    """
    path = cache_root / "engines.json"
    key = record_key(gguf, dtype)
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        records = {}
    if key in records and records[key].get("faster") in ENGINES:
        return records[key]["faster"], None
    if progress is not None:
        progress("first load here: timing the torch and llama.cpp engines to pick the faster (once)")
    targets = {engine: load(engine) for engine in ENGINES}
    timings: dict = {engine: step_ms(target) for engine, target in targets.items()}
    timings["faster"] = min(ENGINES, key=lambda e: sum(timings[e]))
    records[key] = timings
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1, sort_keys=True))
    return timings["faster"], targets[timings["faster"]]
