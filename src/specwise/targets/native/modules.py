"""Linear and embedding layers that keep GGUF weights packed and multiply with torch's int4 kernel.

:class:`PackedLinear` hands the planes of :mod:`specwise.targets.native.blocks` to
``torch.ops.aten._weight_int4pack_mm_for_cpu`` (torch's CPU kernel for 4-bit weights with a scale
and a zero per group: ``w = scale * (v - 8) + zero``). A weight of P planes is one kernel call: the
planes are laid side by side along K and the input repeated P times, so the kernel accumulates the
whole product in float32 and rounds once. :class:`PackedEmbedding` keeps the integer codes (int8)
and their group factors and dequantizes only the rows it looks up.

Both reproduce the dense weight exactly as the GGUF dequantizes it, up to the rounding of the
group factors to the activation dtype (bfloat16: a relative 2^-9) that the kernel requires.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from specwise.targets.native.blocks import GROUP, Affine, Planes

#: bytes: torch's AVX-512 int8 kernel (``_weight_int8pack_mm``) reads its input and its codes with
#: aligned vector loads and crashes the process on an operand that starts elsewhere (a tensor
#: mapped from a file, a slice of a larger one); torch's own allocations start on this boundary
ALIGNMENT = 64


#: input rows above which an int8 layer multiplies by a dense bfloat16 copy of its weight on AVX-512:
#: torch's int8 kernel reads the whole weight again for every 4 rows, so its cost grows with the rows
#: (a verification forward of a draft tree has 10-30), while a dense product reads the weight once;
#: measured in docs/native.md (the LM head of a 262k vocabulary dominates a tree's verification)
DENSE_ROWS = 8
#: a weight of at least this many elements does not stay in the CPU's caches between the kernel's
#: passes, so each pass streams it from memory again and the dense product wins from the second
#: pass (more than 4 rows) on; smaller weights are re-read from cache and keep :data:`DENSE_ROWS`
STREAMED_WEIGHT = 1 << 24
DENSE_ROWS_STREAMED = 4


def _dense_for_many_rows() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 builds of torch's kernels; measured
    faster there for many rows; on AVX2 only the int8 kernel is used, as before)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself if its data starts on an :data:`ALIGNMENT` boundary, else a copy that does."""
    return tensor if tensor.data_ptr() % ALIGNMENT == 0 else tensor.clone()


class PackedLinear(nn.Module):
    """``y = x W^T (+ b)`` with W held as 4-bit planes.

    Args:
        planes: the weight ``[N, K]`` (:class:`~specwise.targets.native.blocks.Planes`).
        bias: ``[N]`` or ``None``.
        dtype: activation dtype (bfloat16, float16 or float32): the kernel takes its group factors
            in the dtype of its input.

    Raises:
        ValueError: K not a multiple of 32, N not a multiple of 16 (the kernel's tiles), or a dtype
            the kernel does not take.
    """

    def __init__(self, planes: Planes, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"packed weights compute in bfloat16, float16 or float32, not {dtype}.")
        n, k = planes.shape
        if k % GROUP or n % 16:
            raise ValueError(f"int4 weights need multiples of {GROUP} input and 16 output features, not [{n}, {k}].")
        self.in_features, self.out_features, self.num_planes = k, n, len(planes.values)
        # w = sum_p scale_p * v_p + constant, written as the kernel's scale * (v - 8) + zero per plane.
        # A plane of fewer than 4 bits (v <= 7) is stored as v + 8, so its own term is exact with
        # zero 0; the constant and the 8 * scale of full planes go to plane 0. This keeps every zero
        # near the size of the weights it offsets: rounded to bfloat16 (relative 2^-9), a large zero
        # would shift every weight of its group by far more than bfloat16 rounds the weight itself.
        widths = planes.widths or (4,) * len(planes.values)
        shifts = [8 if width < 4 else 0 for width in widths]
        total = planes.constant + sum(8.0 * s for s, shift in zip(planes.scales, shifts) if not shift)
        zeros = [total if p == 0 else np.zeros_like(total) for p in range(len(planes.values))]
        values = [plane.astype(np.int32) + shift for plane, shift in zip(planes.values, shifts)]
        side_by_side = torch.from_numpy(np.concatenate(values, axis=1))  # shape: [N, P*K] int32
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(side_by_side, 1)  # [N, P*K/2] uint8
        scale = torch.from_numpy(np.concatenate(list(planes.scales), axis=1))  # shape: [N, P*K/32]
        zero = torch.from_numpy(np.concatenate(zeros, axis=1))
        self.register_buffer("packed", packed)
        self.register_buffer("scale_and_zero", torch.stack([scale.T, zero.T], dim=-1).to(dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., K] -> [..., N]`` in the activation dtype."""
        rows = x.reshape(-1, self.in_features)
        if self.num_planes > 1:
            rows = rows.repeat(1, self.num_planes)  # shape: [M, P*K]
        elif not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows.to(self.scale_and_zero.dtype), self.packed, GROUP, self.scale_and_zero)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """``[N, K]`` dense weight in the activation dtype, computed by the kernel itself (for code
        that reads a head's rows: drafters borrowing the LM head, feature extraction, export)."""
        eye = torch.eye(self.in_features, dtype=self.scale_and_zero.dtype)
        bias, self.bias = self.bias, None
        try:
            return self.forward(eye).T.contiguous()
        finally:
            self.bias = bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, planes={self.num_planes}"


class PackedEmbedding(nn.Module):
    """Embedding lookup from integer codes: only the rows looked up are dequantized.

    Args:
        affine: the table ``[V, H]`` (:class:`~specwise.targets.native.blocks.Affine`, codes of at
            most 8 bits).
        dtype: output dtype.
        scale: a factor the rows are multiplied by after lookup (Gemma's ``sqrt(H)``), or ``None``.
    """

    def __init__(self, affine: Affine, dtype: torch.dtype, scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = (int(s) for s in affine.codes.shape)
        self.dtype = dtype
        self.register_buffer("codes", torch.from_numpy(np.ascontiguousarray(affine.codes, dtype=np.int8 if affine.bits == 8 else np.uint8)))
        self.register_buffer("group_scale", torch.from_numpy(affine.scale))  # shape: [V, H/32] float32
        self.register_buffer("group_offset", torch.from_numpy(affine.offset))
        self.register_buffer("embed_scale", None if scale is None else scale.detach().clone())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[...]`` long -> ``[..., H]`` in ``dtype`` (rounded from float32, as a dense table is)."""
        rows = input_ids.reshape(-1)
        codes = self.codes[rows].view(rows.numel(), -1, GROUP).float()  # shape: [R, H/32, 32]
        values = codes * self.group_scale[rows][..., None] + self.group_offset[rows][..., None]
        out = values.reshape(*input_ids.shape, self.embedding_dim).to(self.dtype)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(self.dtype)
        return out

    @property
    def weight(self) -> torch.Tensor:
        """``[V, H]`` dense table in ``dtype`` (without the lookup scale), for code that copies it."""
        codes = self.codes.view(self.num_embeddings, -1, GROUP).float()
        values = codes * self.group_scale[..., None] + self.group_offset[..., None]
        return values.reshape(self.num_embeddings, self.embedding_dim).to(self.dtype)


class Int8Linear(nn.Module):
    """``y = x W^T (+ b)`` with W as int8 codes and one scale per output row
    (``torch.ops.aten._weight_int8pack_mm``): the form torch's kernels take for weights of more
    than 4 bits, whose GGUF blocks scale every 32 values separately.

    Args:
        codes: ``[N, K]`` int8, the weight requantized per row (:func:`int8_rows`).
        scale: ``[N]`` float, the row factors: ``w = codes * scale``.
        bias: ``[N]`` or ``None``.
        dtype: activation dtype (bfloat16, float16 or float32).
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = (int(s) for s in codes.shape)
        self.register_buffer("codes", aligned(codes.to(torch.int8).contiguous()))
        self.register_buffer("row_scale", scale.to(dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype).clone())
        self._dense: tuple[int, torch.Tensor] | None = None  # (codes' address, their dense copy), on first use
        streamed = self.out_features * self.in_features >= STREAMED_WEIGHT
        self._dense_rows = ((DENSE_ROWS_STREAMED if streamed else DENSE_ROWS)
                            if dtype == torch.bfloat16 and _dense_for_many_rows() else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., K] -> [..., N]`` in the activation dtype."""
        rows = aligned(x.reshape(-1, self.in_features).to(self.row_scale.dtype).contiguous())
        if self._dense_rows is not None and rows.shape[0] > self._dense_rows:
            if self._dense is None or self._dense[0] != self.codes.data_ptr():
                self._dense = (self.codes.data_ptr(), self.weight)
            out = rows @ self._dense[1].T
            return (out if self.bias is None else out + self.bias).reshape(*x.shape[:-1], self.out_features)
        if self.codes.data_ptr() % ALIGNMENT:  # replaced since (a state loaded by assignment)
            self.codes = aligned(self.codes)
        out = torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.row_scale)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """``[N, K]`` dense weight in the activation dtype."""
        return (self.codes.float() * self.row_scale.float()[:, None]).to(self.row_scale.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rows"


def int8_rows(weight: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 codes of a float32 ``[N, K]`` weight: ``(codes int8, scale float32 [N])``.

    ``codes = round(w / s)`` with ``s = max|w_row| / 127``: each value moves by at most ``s / 2``.
    """
    dense = torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32))
    scale = dense.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    codes = torch.round(dense / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale
