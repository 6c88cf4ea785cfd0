"""llama.cpp's library in this process: whether it is installed, which of ggml's CPU variants
to load and load it (:func:`load_backends`), and the per-CPU choices that follow from it.

- llama-cpp-python built with ggml's runtime CPU-variant dispatch (``GGML_BACKEND_DL`` with
  ``GGML_CPU_ALL_VARIANTS``, how the project's Makefile builds it) loads no CPU backend by itself;
  :func:`load_backends` loads the best variant for this CPU, so one wheel runs on every machine.
- On a CPU with AMX, :func:`load_backends` loads an AVX-512 variant without AMX kernels, and weight
  repacking (``use_extra_bufts``) stays on: llama.cpp's AMX matmul crashed the process on decoding
  repacked weights (docs/llamacpp.md). Where ggml's AMX kernels run (a backend linked in on such a
  CPU) repacking is off.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import torch

from specwise.engine.clock import cpu_flags
from specwise.errors import TargetLoadError

try:  # the [llamacpp] extra
    import llama_cpp as lc
except ImportError:  # pragma: no cover - exercised where the extra is missing
    lc = None

#: llama.cpp's log callback that drops every message (its load logs would flood the console)
_SILENT = lc.llama_log_callback(lambda level, text, data: None) if lc is not None else None

def available() -> bool:
    """Whether llama-cpp-python is installed."""
    return lc is not None


#: ggml's CPU variants with AMX kernels (where repacked weights crashed its AMX matmul)
_AMX_VARIANTS = frozenset({"sapphirerapids"})
#: on a CPU with AMX, the variants to load instead, best first: AVX-512 without AMX kernels, so
#: weight repacking (ggml's fastest CPU layout) can stay on, as it does for the peer built without them
_WITHOUT_AMX = ("zen4", "cooperlake", "icelake", "cascadelake", "cannonlake", "skylakex", "haswell")


def loaded_cpu_variant(maps: str | None = None) -> str | None:
    """Which of ggml's CPU variant libraries this process loaded (``libggml-cpu-<variant>.so`` in
    ``/proc/self/maps``), or ``None`` for a build with its CPU backend linked in."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
    found = re.search(r"libggml-cpu-([A-Za-z0-9_]+)\.so", maps)
    return found.group(1) if found else None


def repack_by_default(flags: frozenset[str] | None = None, variant: str | None = None) -> bool:
    """Whether weight repacking is safe to turn on: everywhere but on a CPU with AMX (``amx_tile``)
    running ggml's AMX kernels (an AMX variant, or a backend linked in whose kernels are unknown),
    where llama.cpp's AMX matmul crashed on decoding repacked weights."""
    flags = cpu_flags() if flags is None else flags
    if not any(flag.startswith("amx") for flag in flags):
        return True
    return variant is not None and variant not in _AMX_VARIANTS


def drafter_dtype(flags: frozenset[str] | None = None) -> torch.dtype:
    """The dtype drafters compute in beside a llama.cpp target: bfloat16 where the CPU multiplies
    bf16 natively (AMX or AVX-512 BF16: oneDNN's bf16 matmuls there cost a fraction of float32's),
    else float32. Drafts are proposals, so their precision never changes the output's distribution
    (greedy: which drafts are verified together, so where a batched kernel's near-tie falls)."""
    flags = cpu_flags() if flags is None else flags
    return torch.bfloat16 if {"amx_bf16", "avx512_bf16"} & flags else torch.float32


def load_backends() -> None:
    """Load llama.cpp's CPU backend where the build loads backends dynamically: the variant that
    suits this CPU best, from the directory the wheel installed them in. A no-op where a backend is
    already registered (a build with the backend linked in, or a second call).

    Raises:
        TargetLoadError: llama-cpp-python is missing, or no backend could be loaded.
    """
    if lc is None:
        raise TargetLoadError("the llama.cpp engine needs llama-cpp-python: pip install 'specwise[llamacpp]'.")
    lc.llama_log_set(_SILENT, None)
    package = Path(lc.__file__).resolve().parent
    libggml = next((p for p in (package / "lib" / "libggml.so.0", package / "lib" / "libggml.so") if p.exists()), None)
    if libggml is None:
        return  # a build without the dynamic loader: its backends are linked in
    ggml = ctypes.CDLL(str(libggml))
    ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
    if ggml.ggml_backend_reg_count() > 0:
        return
    ggml.ggml_backend_load.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_load.restype = ctypes.c_void_p
    amx = any(flag.startswith("amx") for flag in cpu_flags())
    for where in (package.parent / "bin", package / "bin", package / "lib"):
        if any(where.glob("libggml-cpu*.so")):
            # ggml would pick its AMX variant on such a CPU; one without AMX keeps repacking safe
            for variant in _WITHOUT_AMX if amx else ():
                library = where / f"libggml-cpu-{variant}.so"
                if library.exists() and ggml.ggml_backend_load(str(library).encode()):
                    return  # a variant this CPU cannot run is refused by its own score check
            ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
            ggml.ggml_backend_load_all_from_path(str(where).encode())
            break
    if ggml.ggml_backend_reg_count() == 0:
        raise TargetLoadError(f"llama.cpp found no CPU backend to load (looked next to {package}).")


def ggml_base():
    """ggml's base library with the three functions the taps call, typed."""
    package = Path(lc.__file__).resolve().parent
    path = next((p for p in (package / "lib" / "libggml-base.so.0", package / "lib" / "libggml-base.so")
                 if p.exists()), None)
    if path is None:
        raise TargetLoadError(f"llama-cpp-python has no ggml-base library next to {package}: no hidden states.")
    base = ctypes.CDLL(str(path))
    base.ggml_get_name.restype = ctypes.c_char_p
    base.ggml_get_name.argtypes = [ctypes.c_void_p]
    base.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    return base
