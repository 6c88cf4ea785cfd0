"""The OpenMP runtime ggml's CPU kernels share with torch in this process, and the one thing asked
of it: that a thread done with it lets its pool of workers go.

Each thread that starts a parallel region (a ggml forward, or a torch op over more than ~32,768
elements) keeps a pool of idle workers for as long as it lives. libgomp counts them all, and once it
manages more threads than the machine has cores it cuts every team's spin-wait short, so ggml's
barriers (hundreds per forward) sleep and wake instead of spinning: one idle pool left on another
thread slows every later decode (measured in docs/serve.md, "Threads"). A thread that ends takes
its pool with it; a thread that stays (the engine's round thread, the server's main thread)
releases it with :func:`release_pool`.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

#: ``omp_pause_soft`` (OpenMP 5.0): the runtime may free the calling thread's resources
_PAUSE_SOFT = 1


def openmp_runtimes(maps: str | None = None) -> tuple[ctypes.CDLL, ...]:
    """The libgomp copies loaded in this process (torch brings one; ggml binds to it by its soname),
    already loaded, never loaded here; empty where there is none (another runtime, or none).

    Args:
        maps: ``/proc/self/maps``'s text (read when ``None``; unreadable: no runtimes).
    """
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return ()
    paths = sorted({line.split()[-1] for line in maps.splitlines() if "libgomp" in line and "/" in line})
    runtimes = []
    for path in paths:
        try:
            library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            library.omp_pause_resource_all.argtypes = [ctypes.c_int]
            library.omp_pause_resource_all.restype = ctypes.c_int
            library.omp_set_num_threads.argtypes = [ctypes.c_int]
            library.omp_set_num_threads.restype = None
            library.omp_get_max_threads.argtypes = []
            library.omp_get_max_threads.restype = ctypes.c_int
        except (OSError, AttributeError):  # gone meanwhile, or older than OpenMP 5.0's pause
            continue
        runtimes.append(library)
    return tuple(runtimes)


def release_pool(runtimes: tuple[ctypes.CDLL, ...]) -> bool:
    """Let the calling thread's idle OpenMP workers exit (its next parallel region starts new ones).
    Call it outside any parallel region. Returns whether every runtime agreed (``True`` for none)."""
    return all(runtime.omp_pause_resource_all(_PAUSE_SOFT) == 0 for runtime in runtimes)


def set_team(runtimes: tuple[ctypes.CDLL, ...], threads: int) -> None:
    """Size the calling thread's later parallel regions (OpenMP's ``nthreads`` setting, which is
    per thread): ``1`` runs its torch operations on it alone and lets its idle pool go (a thread
    whose forwards another thread decodes keeps no pool beside that thread's); more gives them a
    team again. ggml names its team's size itself, so this moves only torch's.

    Args:
        runtimes: :func:`openmp_runtimes`.
        threads: >= 1.
    """
    torch.get_num_threads()  # torch sets a thread's own count on its first call there, which would undo ours
    for runtime in runtimes:
        if runtime.omp_get_max_threads() != threads:
            runtime.omp_set_num_threads(threads)
            if threads == 1:
                release_pool((runtime,))
