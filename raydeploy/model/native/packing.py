"""Float32 weights that are exactly 4-bit or 8-bit blocks, held packed for the native matmul (`small_matmul.cc`:
`MultiQ4Impl` for layer kernels, `Q8Impl` for a tied embedding table read as the LM head).

A GGUF Q4_1 checkpoint (the demo model's projections) dequantized to float32 holds, down each column of a kernel
[K, N], blocks of 32 weights that are `d * q + m` with q in 0..15 and d, m float16 values: 16 distinct values a
block, 4 bytes each. `pack_q4(w)` finds d, m and q for every block and checks that they rebuild every weight bit
for bit; then the kernel reads 0.75 bytes a weight instead of 4 and computes each block's share of a dot product
as `d * (x . q) + m * sum(x)`. A GGUF Q8_0 table (the demo's embedding) holds, along each row, blocks of 32
weights that are `d * q` with q in -127..127 (`pack_q8`: 1.125 bytes a weight, read as the tied LM head). A
weight that is not such blocks, bit for bit, is not packed (None).

The weights are the float32 weights exactly; what x is multiplied by them depends on the build:
- AVX2: x as it is, the values converted to float32 exactly: only the order of the float32 sums differs from
  multiplying the float32 weight (the demo engine's logprobs within 2.1e-5 of the float32 kernel's over 8
  prompts x 64 greedy tokens, every token equal).
- AVX-512: each row's block of 32 values of x is rounded to 16-bit integers (`rounded_rows`; a step of 1/65534
  of the block's largest |x|) and x . q summed exactly in int32, two products an instruction (`vpdpwssd`;
  figures in docs/performance.md). The demo engine's logprobs are within 3.4e-3 of the float32 kernel's
  (mean 3.4e-4) over the same 8 x 64 tokens, every token equal; `packed_product` gives what each build computes.

Layouts, tiles of 32 weight rows x 32 columns in row-block-major order ([K/32, N/32] tiles):
- `pack_q4`: [L, K/32, N/32, 768] uint8 (`TILE` bytes); a tile is the 32 columns' d (float32), their m
  (float32), then 32 rows of 16 bytes, byte j of a row holding column j in its low nibble and column 16 + j in
  its high one.
- `pack_q8`: [1, K/32, N/32, 1152] uint8 (`Q8_TILE` bytes) of the transposed table [K, N]; a tile is the 32
  columns' d (float32), then 16 row pairs of 64 bytes, column j's two values at bytes 2j and 2j + 1.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
"""Weights a block down a column (Q4_1's block)."""
TILE = 2 * BLOCK * 4 + BLOCK * 16
"""Bytes a packed 4-bit tile of BLOCK weight rows x BLOCK columns."""
Q8_TILE = BLOCK * 4 + BLOCK * BLOCK
"""Bytes a packed 8-bit tile of BLOCK rows x BLOCK columns."""


def pack_q4(w: np.ndarray) -> np.ndarray | None:
    """w [L, K, N] float32 (a stacked in_out kernel) -> packed uint8 [L, K/32, N/32, 768], or None when K or N
    is not a multiple of 32 or any block is not exactly d * q + m (float16 d and m, q in 0..15)."""
    if w.ndim != 3 or w.dtype != np.float32 or w.shape[1] % BLOCK or w.shape[2] % BLOCK or not w.size:
        return None
    layers, k, n = w.shape
    blocks = w.reshape(layers, k // BLOCK, BLOCK, n)
    lo = blocks.min(axis=2)
    hi = blocks.max(axis=2)
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        return None
    m = lo.astype(np.float16).astype(np.float32)
    d = ((hi - m) / np.float32(15)).astype(np.float16).astype(np.float32)
    if not (np.array_equal(m, lo) and np.isfinite(d).all()):
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint((blocks - m[:, :, None]) / d[:, :, None])
    q = np.where(d[:, :, None] > 0, q, 0)
    if q.min() < 0 or q.max() > 15:
        return None
    q = q.astype(np.uint8)
    rebuilt = q.astype(np.float32) * d[:, :, None] + m[:, :, None]
    if not np.array_equal(rebuilt.view(np.uint32), blocks.view(np.uint32)):
        return None
    groups = n // BLOCK
    # q [L, K/32, 32 rows, N] -> per tile [L, K/32, N/32, 32 rows, 16]: column j low nibble, 16 + j high
    qt = q.reshape(layers, k // BLOCK, BLOCK, groups, 2, 16)
    nibbles = qt[..., 0, :] | (qt[..., 1, :] << 4)
    nibbles = nibbles.transpose(0, 1, 3, 2, 4).reshape(layers, k // BLOCK, groups, BLOCK * 16)
    scales = np.concatenate([d.reshape(layers, k // BLOCK, groups, BLOCK),
                             m.reshape(layers, k // BLOCK, groups, BLOCK)], axis=-1)
    out = np.concatenate([scales.view(np.uint8), nibbles], axis=-1)
    return np.ascontiguousarray(out)


def unpack_q4(packed: np.ndarray) -> np.ndarray:
    """The float32 weight [L, K, N] a packed one holds (what the kernel multiplies by)."""
    layers, kb, groups, tile = packed.shape
    if tile != TILE:
        raise ValueError(f"packed weights have tiles of {tile} bytes, expected {TILE}")
    scales = np.ascontiguousarray(packed[..., :2 * BLOCK * 4]).view(np.float32)
    d, m = scales[..., :BLOCK], scales[..., BLOCK:]
    nib = packed[..., 2 * BLOCK * 4:].reshape(layers, kb, groups, BLOCK, 16)
    q = np.stack([nib & 0xF, nib >> 4], axis=-2).reshape(layers, kb, groups, BLOCK, BLOCK)  # [.., row, col]
    w = q.astype(np.float32) * d[:, :, :, None, :] + m[:, :, :, None, :]
    return w.transpose(0, 1, 3, 2, 4).reshape(layers, kb * BLOCK, groups * BLOCK)


def pack_q8(w: np.ndarray) -> np.ndarray | None:
    """w [N, K] float32 (an output-first weight: a tied embedding table as the LM head) -> packed uint8
    [1, K/32, N/32, 1152]: the transposed table [K, N] as `Q8_TILE`-byte tiles of 32 rows x 32 columns (per tile the
    32 columns' d as float32, then 16 row pairs of 64 bytes, column j's two int8 values at bytes 2j, 2j + 1), or
    None when K or N is not a multiple of 32 or any block of 32 along a row of w is not exactly d * q (float16 d,
    q in -127..127)."""
    if w.ndim != 2 or w.dtype != np.float32 or w.shape[1] % BLOCK or w.shape[0] % BLOCK or not w.size:
        return None
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=2)
    if not np.isfinite(amax).all():
        return None
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(blocks / d[:, :, None])
    q = np.where(d[:, :, None] > 0, q, 0)
    if np.abs(q).max() > 127:
        return None
    q = q.astype(np.int8)
    if not np.array_equal((q.astype(np.float32) * d[:, :, None]).view(np.uint32), blocks.view(np.uint32)):
        return None
    groups = n // BLOCK
    # q [N, K/32, 32] -> [K/32, N/32, 16 pairs, 32 columns, 2]
    qt = q.reshape(groups, BLOCK, k // BLOCK, BLOCK // 2, 2).transpose(2, 0, 3, 1, 4)
    values = qt.reshape(k // BLOCK, groups, BLOCK * BLOCK).view(np.uint8)
    scales = d.reshape(groups, BLOCK, k // BLOCK).transpose(2, 0, 1)
    out = np.concatenate([np.ascontiguousarray(scales).view(np.uint8), values], axis=-1)
    return np.ascontiguousarray(out[None])


def unpack_q8(packed: np.ndarray) -> np.ndarray:
    """The float32 weight [N, K] a `pack_q8` packing holds."""
    _, kb, groups, tile = packed.shape
    if tile != Q8_TILE:
        raise ValueError(f"packed tables have tiles of {tile} bytes, expected {Q8_TILE}")
    d = np.ascontiguousarray(packed[0, ..., :BLOCK * 4]).view(np.float32)  # [K/32, N/32, 32 columns]
    q = packed[0, ..., BLOCK * 4:].view(np.int8).reshape(kb, groups, BLOCK // 2, BLOCK, 2)
    w = q.astype(np.float32) * d[:, :, None, :, None]  # [K/32, N/32, pair, column, 2]
    return w.transpose(1, 3, 0, 2, 4).reshape(groups * BLOCK, kb * BLOCK)


X_MAX = 32767
"""The AVX-512 build rounds each row's block of 32 values of x to int16 with the block's largest |x| at this."""


def rounded_rows(x: np.ndarray) -> np.ndarray:
    """x [M, K] float32 as the AVX-512 build's packed kernels multiply it (`small_matmul.cc`, `BlockX`), float64:
    per row and block of 32, c * xq with c = max|x| / 32767 and xq = x * (32767 / max|x|) rounded to the nearest
    integer (ties to even), all in float32 as the kernel computes them."""
    m, k = x.shape
    blocks = x.astype(np.float32).reshape(m, k // BLOCK, BLOCK)
    top = np.abs(blocks).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        f = np.where(top > 0, np.float32(X_MAX) / top, np.float32(0)).astype(np.float32)
    xq = np.clip(np.rint(blocks * f), -X_MAX - 1, X_MAX)
    c = (top / np.float32(X_MAX)).astype(np.float32)
    return (xq.astype(np.float64) * c.astype(np.float64)).reshape(m, k)


def packed_product(x: np.ndarray, w: np.ndarray, rounded: bool, q4: bool = True) -> np.ndarray:
    """What a packed kernel computes for x [M, K] @ w [K, N], in float64: w exactly 4-bit blocks (`pack_q4`) or,
    with q4 False, 8-bit ones (`pack_q8`'s table, transposed). With `rounded` (the AVX-512 build) each block's
    x . (d * q) is taken from `rounded_rows` and a 4-bit block's m * sum(x) from x as it is; else x @ w."""
    x64 = x.astype(np.float64)
    if not rounded:
        return x64 @ w.astype(np.float64)
    xr = rounded_rows(x)
    out = xr @ w.astype(np.float64)
    if q4:
        k, n = w.shape
        mins = w.reshape(k // BLOCK, BLOCK, n).min(axis=1).astype(np.float64)  # each block's m (q = 0 present)
        out += (x64 - xr).reshape(x.shape[0], k // BLOCK, BLOCK).sum(axis=2) @ mins
    return out
