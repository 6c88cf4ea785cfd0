"""Read GGUF quantized blocks as integer planes that torch's int4 kernel multiplies exactly.

A GGUF weight row of K values is stored in blocks; every block type used for linear layers below
dequantizes, per group of 32 consecutive values, as an affine map of small unsigned integers:

    w = sum_p scale_p * v_p + constant,   v_p in [0, 15]

with ``scale_p`` and ``constant`` per group. A type of b bits per value needs ceil(b / 4) such
*planes*: Q4_0, Q4_1, Q4_K one; Q5_0, Q5_1, Q5_K and Q8_0 two (the low nibble and the high bits).
This is exact: :func:`affine_from_blocks` reproduces the GGUF's own dequantization
(``gguf.quants.dequantize``) to float32 rounding, and :func:`planes_from_affine` splits its codes
into nibbles without loss. Q6_K groups its scales per 16 values, which torch's kernel (groups of 32
or more) cannot express without more bits than bfloat16 costs, so it and every other type have no
plane form here (:data:`PLANE_TYPES` lists what is read; the int8 form reads any type).

Block layouts are ggml's (``ggml-common.h``, ``ggml-quants.c``): fp16 factors first, then packed
bytes; value j and j + 16 of a 32-block share a byte (low and high nibble); K-quants hold a
256-value super-block with 8 groups whose 6-bit scales and mins are packed into 12 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32  # values per affine group: the smallest group torch's int4 kernel accepts

# block type -> (values per block, bytes per block, bits per value)
BLOCK_SIZES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (32, 18, 4), "Q4_1": (32, 20, 4), "Q5_0": (32, 22, 5), "Q5_1": (32, 24, 5), "Q8_0": (32, 34, 8),
    "Q4_K": (256, 144, 4), "Q5_K": (256, 176, 5),
}
PLANE_TYPES: frozenset[str] = frozenset(BLOCK_SIZES)


@dataclass(frozen=True)
class Affine:
    """A weight ``[N, K]`` as integer codes with one affine map per group of 32 values.

    Attributes:
        codes: ``[N, K]``: int8 for Q8_0, else uint8 in ``[0, 2^bits - 1]``.
        scale: ``[N, K // 32]`` float32.
        offset: ``[N, K // 32]`` float32; ``w = scale * codes + offset`` per group.
        bits: bits per code (4, 5 or 8).
    """

    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    bits: int

    def dequantize(self) -> np.ndarray:
        """``[N, K]`` float32, ggml's dequantization of the blocks."""
        n, k = self.codes.shape
        grouped = self.codes.reshape(n, -1, GROUP).astype(np.float32)
        return (grouped * self.scale[..., None] + self.offset[..., None]).reshape(n, k)


@dataclass(frozen=True)
class Planes:
    """A weight ``[N, K]`` as 4-bit planes: ``w = sum_p scales[p] * values[p] + constant``.

    Attributes:
        values: ``[P, N, K]`` uint8 in ``[0, 15]``.
        scales: ``[P, N, K // 32]`` float32, one factor per plane and group of 32 values.
        constant: ``[N, K // 32]`` float32, added to every value of a group.
        widths: bits held by each plane (4, except a last plane of the fifth bit: 1).
    """

    values: np.ndarray
    scales: np.ndarray
    constant: np.ndarray
    widths: tuple[int, ...] = ()

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.values.shape[1]), int(self.values.shape[2])


def affine_from_blocks(raw: np.ndarray, block_type: str, shape: tuple[int, int]) -> Affine:
    """Read GGUF blocks as integer codes with a per-group affine map.

    Args:
        raw: the tensor's bytes as stored (uint8, any shape with ``N * K / block * bytes`` items).
        block_type: a name from :data:`PLANE_TYPES` (``gguf.GGMLQuantizationType`` names).
        shape: ``(N, K)``, rows (output features) by values per row (input features).

    Returns:
        :class:`Affine`; its dequantization equals ggml's to float32 rounding.

    Raises:
        ValueError: an unsupported block type, or ``raw`` does not hold ``shape`` in it.
    """
    if block_type not in BLOCK_SIZES:
        raise ValueError(f"GGUF block type {block_type} has no exact 4-bit plane form.")
    per_block, nbytes, bits = BLOCK_SIZES[block_type]
    n, k = shape
    if k % per_block or np.asarray(raw).size != n * (k // per_block) * nbytes:
        raise ValueError(f"{block_type} data of {np.asarray(raw).size} bytes does not hold a [{n}, {k}] weight.")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // per_block, nbytes)
    if per_block == GROUP:
        values, scale, offset = _legacy_block(blocks, block_type)  # [N, B, 32] ints, [N, B] float32
    else:
        values, scale, offset = _k_block(blocks, block_type)
        values = values.reshape(n, -1, GROUP)
    return Affine(codes=values.reshape(n, k).astype(np.int8 if bits == 8 else np.uint8), scale=scale.reshape(n, -1).astype(np.float32),
                  offset=offset.reshape(n, -1).astype(np.float32), bits=bits)


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 factor at byte ``start`` of every block, as float32 ``[N, B]``."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes -> ``[..., 32]`` values: low nibbles are values 0-15, high 16-31."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _legacy_block(blocks: np.ndarray, block_type: str):
    """32-value blocks as ``(q [N, B, 32] int32, scale, offset)`` with ``w = scale * q + offset``."""
    d = _half(blocks, 0)
    if block_type == "Q8_0":
        q = blocks[..., 2:].view(np.int8).astype(np.int32)
        return q, d, np.zeros_like(d)
    has_min = block_type in ("Q4_1", "Q5_1")
    start = 4 if has_min else 2
    offset = _half(blocks, 2) if has_min else None
    if block_type.startswith("Q5"):
        high_bits = np.ascontiguousarray(blocks[..., start:start + 4]).view(np.uint32)  # [N, B, 1]
        high = ((high_bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32)
        q = _nibbles(blocks[..., start + 4:]).astype(np.int32) | (high << 4)
        centre = 16
    else:
        q = _nibbles(blocks[..., start:]).astype(np.int32)
        centre = 8
    if offset is None:  # symmetric types: w = d * (q - centre)
        offset = -centre * d
    return q, d, offset


def _k_block(blocks: np.ndarray, block_type: str):
    """256-value super-blocks as ``(q [N, S, 256] int32, scale [N, S, 8], offset [N, S, 8])``."""
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    scales, mins = _k_scales(blocks[..., 4:16])  # [N, S, 8] each
    if block_type == "Q4_K":
        packed = blocks[..., 16:144].reshape(*blocks.shape[:2], 4, 32)
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int32)  # [N, S, 4, 64]
    else:  # Q5_K: 32 bytes of fifth bits, then the nibbles
        high_bytes = blocks[..., 16:48]  # [N, S, 32]: bit 2c (2c+1) is the fifth bit of chunk c's first (second) 32
        packed = blocks[..., 48:176].reshape(*blocks.shape[:2], 4, 32)
        low = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int32)
        bit = np.arange(8).reshape(4, 2)  # chunk, half -> bit index
        high = (high_bytes[..., None, None, :] >> bit[..., None]) & 1  # [N, S, 4, 2, 32]
        q = low | (high.reshape(*blocks.shape[:2], 4, 64).astype(np.int32) << 4)
    q = q.reshape(*blocks.shape[:2], 256)
    return q, d[..., None] * scales, -dmin[..., None] * mins


def _k_scales(packed: np.ndarray):
    """The 8 six-bit scales and mins of a K-quant super-block (ggml's ``get_scale_min_k4``)."""
    packed = packed.astype(np.int32)  # [N, S, 12]
    low, high = packed[..., 0:4], packed[..., 4:8]
    tail = packed[..., 8:12]
    scales = np.concatenate([low & 63, (tail & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 63, (tail >> 4) | ((high >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def planes_from_affine(affine: Affine) -> Planes:
    """Codes of b bits -> ceil(b / 4) planes of nibbles, low nibble first; signed codes shifted."""
    q, offset = affine.codes.astype(np.int32), affine.offset
    if affine.bits == 8:  # Q8_0 codes are signed: shift to [0, 255] and fold the shift into the constant
        q = q + 128
        offset = offset - 128 * affine.scale
    count = (affine.bits + 3) // 4
    values = np.stack([(q >> (4 * p)) & 0x0F for p in range(count)]).astype(np.uint8)  # [P, N, K]
    scales = np.stack([affine.scale * float(16 ** p) for p in range(count)]).astype(np.float32)
    widths = tuple(min(4, affine.bits - 4 * p) for p in range(count))
    return Planes(values=values, scales=scales, constant=offset.astype(np.float32), widths=widths)
