"""What the llama.cpp engine's target reads of a GGUF file besides what llama.cpp runs: the Hugging
Face tokenizer and model config, and the tensors a trained drafter borrows (the token embedding
and the LM-head rows).

ggml holds the weights, so no torch module can lend these. Reading a GGUF's metadata through the
``gguf`` package (or transformers, which uses it) walks every entry of the vocabulary in Python:
seconds per read for a 262,144-token vocabulary. So the first read of a file writes what was read
into the cache (``<cache>/gguf/<key>/``: ``config.json``, the tokenizer's files, and the byte offsets
of the borrowed tensors), keyed by the file's path, size and modification time; later loads read
those. The tensors themselves are a memory map of the file, dequantized row by row when a drafter
asks (``gguf.quants``): a 262,144-row embedding table costs no memory until tokens are embedded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from torch import nn
from transformers import AutoConfig, AutoTokenizer

from specwise.errors import TargetLoadError
from specwise.targets.files import default_cache_dir

#: model types whose input embeddings are scaled by sqrt(hidden size), as HF's embedding module does
_SCALED_EMBEDDINGS = ("gemma",)
#: the GGUF tensors a drafter borrows: the token embedding, and the output layer where not tied
_BORROWED = ("token_embd.weight", "output.weight")


def metadata_dir(path: Path, cache_dir: Path | None = None) -> Path:
    """The cache directory of ``path``'s config and borrowed tensors' offsets (and its tokenizer, once
    :func:`tokenizer_of` read it), written on first use.

    Raises:
        TargetLoadError: transformers cannot read the file's config, or the file has no token
            embedding.
    """
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    where = (cache_dir or default_cache_dir()) / "gguf" / f"{path.stem}-{key}"
    if (where / "tensors.json").exists():
        return where
    where.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=where.parent, prefix=".tmp-"))
    try:
        try:
            AutoConfig.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(scratch)
        except Exception as exc:  # re-raised as the user-facing error, cause chained
            raise TargetLoadError(f"could not read the model config of {path}: {exc}") from exc
        tensors = {t.name: t for t in GGUFReader(path).tensors if t.name in _BORROWED}
        if "token_embd.weight" not in tensors:
            raise TargetLoadError(f"{path} has no token embedding (token_embd.weight).")
        offsets = {name: {"offset": int(t.data_offset), "type": int(t.tensor_type), "rows": int(t.data.shape[0]),
                          "row_bytes": int(t.data.nbytes // t.data.shape[0]), "columns": int(t.shape[0])}
                   for name, t in tensors.items()}
        (scratch / "tensors.json").write_text(json.dumps(offsets))
        try:
            os.replace(scratch, where)
        except OSError:  # another process wrote it first: theirs is as good
            pass
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return where


def tokenizer_of(gguf: Path, cache_dir: Path | None = None):
    """The Hugging Face tokenizer of a GGUF file, read from its metadata once and then from the
    cache (see the module docstring).

    Raises:
        TargetLoadError: transformers cannot read the file's tokenizer or config.
    """
    where = metadata_dir(gguf, cache_dir)
    if (where / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(where)
    gguf = Path(gguf).resolve()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # re-raised as the user-facing error, cause chained
        raise TargetLoadError(f"could not read the tokenizer of {gguf}: {exc}") from exc
    scratch = Path(tempfile.mkdtemp(dir=where.parent, prefix=".tmp-"))
    try:
        tokenizer.save_pretrained(scratch)
        # tokenizer_config.json last: its presence says the tokenizer's files are all there
        for file in sorted(scratch.iterdir(), key=lambda f: f.name == "tokenizer_config.json"):
            os.replace(file, where / file.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return tokenizer


class GGUFMatrix:
    """A ``[V, H]`` matrix of a GGUF file (one token per row), memory-mapped, read by rows."""

    def __init__(self, path: Path, entry: dict) -> None:
        self.type = GGMLQuantizationType(entry["type"])
        self.columns = entry["columns"]
        self.raw = np.memmap(path, dtype=np.uint8, mode="r", offset=entry["offset"],
                             shape=(entry["rows"], entry["row_bytes"]))

    @property
    def rows(self) -> int:
        return int(self.raw.shape[0])

    def read(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows ``token_ids [R]`` long, dequantized: ``[R, H]`` float32."""
        ids = token_ids.detach().reshape(-1).cpu().numpy().astype(np.int64)
        raw = np.asarray(self.raw[ids])
        if self.type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            values = raw.view(np.float32 if self.type == GGMLQuantizationType.F32 else np.float16)
        else:
            values = dequantize(raw, self.type)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(len(ids), self.columns)


class GGUFEmbedding(nn.Module):
    """A GGUF file's token embedding table as an ``nn.Embedding``-like module (no parameters).

    Attributes:
        num_embeddings: rows of the table (V). embedding_dim: H.
        embed_scale: ``sqrt(H)`` for Gemma (HF's ``Gemma3TextScaledWordEmbedding`` multiplies its
            output by it), else absent.
    """

    def __init__(self, table: GGUFMatrix, scale: float | None) -> None:
        super().__init__()
        self._table = table
        self.num_embeddings = table.rows
        self.embedding_dim = table.columns
        if scale is not None:
            self.embed_scale = torch.tensor(scale)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``token_ids [...]`` long -> ``[..., H]`` float32 (scaled where the model scales)."""
        rows = self._table.read(token_ids)
        if hasattr(self, "embed_scale"):
            rows = rows * self.embed_scale
        return rows.reshape(*token_ids.shape, self.embedding_dim).to(token_ids.device)


class GGUFParts:
    """What a drafter borrows from a GGUF file: its text config, input embeddings, LM-head rows.

    Args:
        path: the ``.gguf`` file.
        cache_dir: the specwise cache root (default :func:`default_cache_dir`).

    Raises:
        TargetLoadError: see :func:`metadata_dir`.
    """

    def __init__(self, path: str | Path, cache_dir: Path | None = None) -> None:
        where = metadata_dir(Path(path), cache_dir)
        self.text_config = AutoConfig.from_pretrained(where).get_text_config()
        entries = json.loads((where / "tensors.json").read_text())
        embedding = GGUFMatrix(Path(path), entries["token_embd.weight"])
        self._head = GGUFMatrix(Path(path), entries["output.weight"]) if "output.weight" in entries else embedding
        scaled = str(getattr(self.text_config, "model_type", "")).startswith(_SCALED_EMBEDDINGS)
        self.embeddings = GGUFEmbedding(embedding, math.sqrt(self.text_config.hidden_size) if scaled else None)

    def output_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The LM head's rows of ``token_ids [R]`` long: ``[R, H]`` float32."""
        return self._head.read(token_ids)
