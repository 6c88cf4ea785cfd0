"""The target factory: a name or path, a dtype, a device and an engine turned into a loaded target.

:func:`load_target` picks the engine (torch, llama.cpp's, or the one measured faster here for a GGUF
file, :mod:`specwise.targets.engine_choice`) and hands the files to it: the torch target
(:class:`specwise.targets.hf.Target`) over the model files :mod:`specwise.targets.files` finds or
converts, or llama.cpp's (:class:`specwise.targets.llamacpp.LlamaCppTarget`) over the GGUF file
itself. This module is the only one that knows both engines.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specwise.errors import ConfigError
from specwise.targets.engine_choice import check_engine_name, faster_engine
from specwise.targets.files import default_cache_dir, gguf_file, load_model_and_tokenizer
from specwise.targets.gguf_parts import tokenizer_of
from specwise.targets.hf import Target
from specwise.targets.llamacpp import LlamaCppTarget
from specwise.targets.llamacpp_backend import available as llamacpp_available
from specwise.targets.native.weights import check_weights

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
          "float64": torch.float64}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``torch.bfloat16`` -> ``torch.bfloat16``.

    Raises:
        ConfigError: an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}.")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> CUDA when available, else CPU.

    Raises:
        ConfigError: an unknown device, or CUDA asked for but not available.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {device!r}; use cpu or cuda.") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} is not supported; use cpu or cuda.")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but no CUDA device is available.")
    return device


def load_target(
    name_or_path: str | Path = "gemma-3-270m",
    *,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device | None = None,
    progress=None,
    weights: str | None = None,
    engine: str | None = "torch",
):
    """Load a target model: the alias ``gemma-3-270m``, a local HF model directory, or a ``.gguf`` file.

    Args:
        name_or_path: alias or path.
        dtype: ``"bfloat16"`` (default), ``"float32"``, ``"float16"`` or ``"float64"``.
        device: ``"cpu"``, ``"cuda"``, or ``None`` for CUDA when available.
        progress: optional ``callable(str)`` told about slow steps (the first GGUF conversion).
        weights: ``"native"`` (the GGUF's own precision on torch's packed CPU kernels),
            ``"native-exact"``, ``"bf16"`` (dense), or ``None``: the faster on this machine, measured
            on first load and recorded in the cache. Lossless speculation is relative to the target
            as loaded, never to another precision.
        engine: ``"torch"`` (the default: this module's :class:`Target`) or ``"llamacpp"``: a GGUF
            alias or file on llama.cpp's own engine (:class:`specwise.targets.llamacpp.LlamaCppTarget`,
            float32 logits on the CPU; ``dtype`` and ``weights`` do not apply: it runs the file's own
            precision), or ``None`` (also ``"auto"``): for a GGUF target on the CPU with no weight
            form asked for, the engine measured faster here (:mod:`specwise.targets.engine_choice`:
            the first load times both and records the winner), else torch.

    Returns:
        a target implementing :class:`specwise.engine.target.DecodingTarget`.

    Raises:
        TargetLoadError: the name is unknown or the files cannot be loaded.
        ConfigError: bad dtype, device, weights or engine, native weights where they cannot run, or
            the llama.cpp engine for a target that is no GGUF file.
    """
    engine = check_engine_name(engine)
    torch_dtype = resolve_dtype(dtype)
    torch_device = resolve_device(device)
    if engine is None:
        gguf = gguf_file(str(name_or_path))
        if gguf is None or torch_device.type != "cpu" or check_weights(weights) is not None or not llamacpp_available():
            engine = "torch"
        else:
            def load(which: str):
                return load_target(name_or_path, dtype=torch_dtype, device=torch_device, progress=progress,
                                   weights=weights, engine=which)

            engine, loaded = faster_engine(gguf, torch_dtype, default_cache_dir(), load, progress)
            if loaded is not None:
                return loaded
    if engine == "llamacpp":
        return load_llamacpp_target(str(name_or_path))
    model, tokenizer, name = load_model_and_tokenizer(
        str(name_or_path), dtype=torch_dtype, device=torch_device, progress=progress, weights=weights
    )
    return Target(model, tokenizer, name)


def load_llamacpp_target(name_or_path: str, threads: int | None = None) -> LlamaCppTarget:
    """A GGUF alias or file on llama.cpp's engine, with the file's own tokenizer (``threads``:
    compute threads, default torch's).

    Raises:
        ConfigError: the target is a Hugging Face directory, not a GGUF file.
        TargetLoadError: an unknown name, llama-cpp-python missing, or the file does not load.
    """
    path = gguf_file(name_or_path)
    if path is None:
        raise ConfigError(f"the llama.cpp engine runs GGUF files; {name_or_path} is a Hugging Face directory "
                          "(use engine='torch').")
    return LlamaCppTarget(path, tokenizer_of(path), name_or_path, threads=threads)
