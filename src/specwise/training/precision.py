"""How a training process computes: the matmul precision it trains in, and how it keeps freed memory.

Both are measured choices, not assumptions. On a CPU whose bf16 matmuls are slower than its fp32
ones (AVX-512 with bf16 but no AMX, like the machine the shipped drafters were trained on), bf16
autocast makes training slower; on CPUs with fast bf16 units (AMX, or cores where bf16 dot products
issue at twice the fp32 rate) and on GPUs the order flips. ``auto`` times both on the machine at
hand. The measurements are in docs/training.md and docs/notes/train.md.

Training allocates large short-lived tensors (the logits over the draft vocabulary, every
micro-batch). glibc serves big blocks with ``mmap`` and returns them on free, so each new one
page-faults again, which made ``log_softmax`` over the draft vocabulary several times slower and
training markedly slower (same notes). :func:`keep_freed_memory` makes the process reuse its freed
memory instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

import torch

from specwise.errors import ConfigError

PRECISIONS = ("auto", "bf16", "fp32")

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def choose_precision(requested: str, device: torch.device | str = "cpu") -> str:
    """The precision a training forward runs in: ``"bf16"`` (autocast) or ``"fp32"``.

    Args:
        requested: ``"bf16"``, ``"fp32"``, or ``"auto"``: bf16 on CUDA; on CPU whichever runs a
            training-sized matmul (``[4096, 640] @ [640, 2048]``, forward and both gradients'
            shapes) faster on this machine, timed in about a second (a probe of ``_PROBE_ROWS``
            rows decides alone when one precision is ``_CLEAR_MARGIN`` times slower or more).
        device: where training runs.

    Returns:
        ``"bf16"`` or ``"fp32"``.

    Raises:
        ConfigError: an unknown precision.
    """
    if requested not in PRECISIONS:
        raise ConfigError(f"unknown precision {requested!r}; choose one of {', '.join(PRECISIONS)}.")
    if requested != "auto":
        return requested
    if torch.device(device).type != "cpu":
        return "bf16"
    # a small probe first: where one precision is emulated (bf16 on a CPU without AVX-512-bf16 or
    # AMX) the ratio is large at any size and the probe decides; close calls get the full size
    bf16, fp32 = (_matmul_seconds(dtype, rows=_PROBE_ROWS) for dtype in (torch.bfloat16, torch.float32))
    if max(bf16, fp32) > _CLEAR_MARGIN * min(bf16, fp32):
        return "bf16" if bf16 < fp32 else "fp32"
    return "bf16" if _matmul_seconds(torch.bfloat16) < _matmul_seconds(torch.float32) else "fp32"


_PROBE_ROWS = 256  # token rows of the probe (the full measurement takes 4096)
_CLEAR_MARGIN = 3.0  # a probe ratio beyond this is not a matter of size


def _matmul_seconds(dtype: torch.dtype, repeats: int = 3, rows: int = 4096) -> float:
    """Median seconds of a forward-plus-gradients-sized set of matmuls in ``dtype`` (CPU) on
    ``rows`` token rows."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 640, generator=generator).to(dtype)
    w = torch.randn(2048, 640, generator=generator).to(dtype)
    g = torch.randn(rows, 2048, generator=generator).to(dtype)

    def run() -> None:
        torch.nn.functional.linear(x, w)  # forward
        g @ w  # gradient of the input
        g.T @ x  # gradient of the weight

    run()  # warm-up: kernel selection and first-touch allocations
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def keep_freed_memory() -> bool:
    """Make this process reuse freed memory instead of returning it to the OS (glibc only).

    Sets ``M_MMAP_MAX = 0`` (large blocks come from the heap, not from fresh ``mmap`` regions) and
    the largest trim threshold, 2 GiB (freed heap memory is kept unless that much lies free at its
    top). Memory then stays near the process's peak until it exits, so call it in processes that
    train, not in a library user's process.

    Returns:
        ``True`` when applied; ``False`` where the C library has no ``mallopt`` (not glibc).
    """
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1))
