"""The quantized KV cache (`engine.kv_dtype: int8 | float8_e4m3fn`): each token's key and value per kv head with
its own float32 scale, and the pool that holds them.

Quantization is symmetric per (token, combined head): scale = max|x| / QMAX over head_dim (QMAX 127 for int8, 448
for float8 e4m3), x_q = round(x / scale) stored in the pool's dtype, x ~ x_q * scale. A vector of zeros gets scale
0 (and reads back as zeros). The error of one element is at most scale / 2 = max|x| / 254 for int8; float8 e4m3
keeps 3 mantissa bits, a relative error of at most 2^-4 per element (above its subnormals).

`QuantizedPool` is the pool of such a cache: `values` [..., 2*Hkv, D] in the pool's dtype and `scales`
[..., 2*Hkv, 1] float32, the same leading axes, so both take the pool's partition spec and sharding (pages over
dp, heads over the kv-head axes) and a page id addresses the same token in both. It is a registered pytree, and
it answers the few array operations the engine's step programs do on a pool (`shape`, `dtype`, `reshape`, and a
row scatter through `.at[...].set`), so the programs carry it through the layer scan, shard_map and the
donation like the float pools, and a float engine's programs are the ones they were.

On TPU the pool is stored in another layout (`stored_shapes`, chosen by the sharding's platform: `layout_for`).
A TPU array's two minor dimensions are tiled (8 x 128 32-bit words: 32 x 128 int8), and the rows layout's minor
dims are (2*Hkv, D): a shard holding one kv head pads 2 rows to a tile, and the scales' (2*Hkv, 1) pad one float
to 128 lanes. XLA then kept the pool in another layout inside the layer loop and copied it whole in and out of
the loop and at every layer's write (Llama-3-70B on v5e-8: 25.7 GiB a step program against the 14.3 GiB of
weights and cache). The TPU layout stores the values as [..., pages, 1, 2*Hkv, page_size, D] (a tile is a
head's tokens of a page) and the scales as [..., pages / r, 1, 2*Hkv, 1, r * page_size] (the tokens on the minor
axis, r pages a 128-lane row); the engine's write is a scatter of one head_dim row per token and head, and of
one scale lane, and the TPU attention wrapper gathers the table's pages as stored. The compiled programs then hold
no copy of the pool (`tests/test_compile.py`). `values` and `scales` are views in the logical form in either
layout, so the XLA path reads both.

Between the quantization and the write, a step's new K/V travel as one int8 array [T, 2*Hkv, D + 4] (`pack`):
the D value bytes and the scale's 4 bytes, so the write is one scatter of one array per layer, as for a float
pool; `QuantizedPool.at[...].set` unpacks it. The pool itself never stores that layout.

Every attention backend reads a `QuantizedPool`: the XLA path dequantizes in its page gather, the GPU Pallas
kernel multiplies the scales inside the kernel, the TPU wrapper dequantizes the pages a step's table names before
jax's kernel (`raydeploy.engine.attention.pallas_tpu`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
"""The largest magnitude each quantized KV dtype stores: a token's scale maps its head's max|x| onto it."""
SCALE_BYTES = 4
"""Bytes of one token's scale per combined kv head (float32)."""


def is_quantized(dtype: Any) -> bool:
    """Whether `dtype` (a name or a dtype) is a quantized KV dtype, stored with per-token scales."""
    try:
        return jnp.dtype(dtype).name in QMAX
    except TypeError:
        return False


def token_bytes(dtype: Any, kv_heads: int, head_dim: int) -> int:
    """Bytes one token's K and V take in one layer's pool: 2 * kv_heads * head_dim values of `dtype`, plus a
    float32 scale per combined head when `dtype` is quantized."""
    scale = SCALE_BYTES if is_quantized(dtype) else 0
    return 2 * kv_heads * (head_dim * jnp.dtype(dtype).itemsize + scale)


def quantize(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (values [..., D] in `dtype`, scales [..., 1] float32), symmetric over the last axis."""
    name = jnp.dtype(dtype).name
    qmax = QMAX[name]
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    scale = amax / qmax
    q = xf / jnp.where(scale == 0.0, 1.0, scale)
    if name == "int8":
        q = jnp.round(q)
    return jnp.clip(q, -qmax, qmax).astype(dtype), scale


def dequantize(values: jax.Array, scales: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """values [..., D] * scales [..., 1] in `dtype`."""
    return (values.astype(jnp.float32) * scales).astype(dtype)


def pack(x: jax.Array, dtype: Any) -> jax.Array:
    """x [T, 2*Hkv, D] quantized to `dtype`, as one int8 array [T, 2*Hkv, D + 4]: the value bytes, then the
    scale's (the form a step's new K/V take to the pool's write)."""
    values, scales = quantize(x, dtype)
    if values.dtype != jnp.int8:
        values = jax.lax.bitcast_convert_type(values, jnp.int8)
    scale_bytes = jax.lax.bitcast_convert_type(scales[..., 0], jnp.int8)  # [..., 4]
    return jnp.concatenate([values, scale_bytes], axis=-1)


def unpack(packed: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """`pack`'s array -> (values [..., D] in `dtype`, scales [..., 1] float32)."""
    d = packed.shape[-1] - SCALE_BYTES
    values = packed[..., :d]
    if jnp.dtype(dtype) != jnp.int8:
        values = jax.lax.bitcast_convert_type(values, dtype)
    scales = jax.lax.bitcast_convert_type(packed[..., d:], jnp.float32)[..., None]
    return values, scales


TPU_LANES = 128
"""Lanes of a TPU vector register: the minor dimension of a TPU-tiled array is padded to a multiple of it."""


def tpu_pages_per_row(page_size: int, local_pages: int) -> int:
    """Pages whose per-token scales share one 128-lane row of the TPU layout (`QuantizedPool.pages_per_row`), for
    a pool whose shard holds `local_pages` pages; 0 (the rows layout) where the page size does not divide 128 or
    128 the page size, or the pages do not fill whole rows."""
    if TPU_LANES % page_size and page_size % TPU_LANES:
        return 0
    r = max(1, TPU_LANES // page_size)
    return r if local_pages % r == 0 else 0


def stored_shapes(shape: tuple[int, ...], pages_per_row: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(values, scales) shapes a pool of logical values `shape` [..., pages, page_size, 2*Hkv, D] stores.

    Rows layout (`pages_per_row` 0): [..., pages, page_size, 2*Hkv, D] and [..., pages, page_size, 2*Hkv, 1].
    TPU layout (`pages_per_row` r): values [..., pages, 1, 2*Hkv, page_size, D], so a TPU tile (tokens x
    head_dim) holds one head's tokens of a page and is never padded; scales [..., pages / r, 1, 2*Hkv, 1,
    r * page_size], the tokens on the minor axis, r pages a 128-lane row. In both the pages axis is axis 1 of the
    pool and the heads axis axis 3, so the pool's partition spec (pages over dp, heads over tp) shards both."""
    if not pages_per_row:
        return shape, (*shape[:-1], 1)
    *lead, page_size, h2, d = shape
    if not lead or lead[-1] % pages_per_row:
        raise ValueError(f"a TPU-layout quantized pool of {pages_per_row} pages per scale row cannot hold "
                         f"{lead[-1] if lead else 0} pages (shape {tuple(shape)})")
    rows = (*lead[:-1], lead[-1] // pages_per_row)
    return (*lead, 1, h2, page_size, d), (*rows, 1, h2, 1, pages_per_row * page_size)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["stored_values", "stored_scales"],
                   meta_fields=["pages_per_row"])
@dataclasses.dataclass(frozen=True)
class QuantizedPool:
    """A quantized KV pool: values (int8 or float8) and a float32 scale per token and combined kv head, stored in
    one of two layouts (`stored_shapes`): the rows layout everywhere but TPU, and on TPU one that the chip tiles
    without padding (`pages_per_row` > 0; its reasons in the module docstring).

    Whatever the layout, the pool answers as the logical [..., pages, page_size, 2*Hkv, D] pool: `shape` and
    `dtype` are the values'; `values` and `scales` ([..., 2*Hkv, 1]) are views in that form (the stored arrays
    themselves in the rows layout); `reshape` merges or splits the leading axes; `.at[pages, offsets].set(new)`
    scatters tokens into both, from a `pack`ed array or another `QuantizedPool`."""

    stored_values: Any
    stored_scales: Any
    pages_per_row: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        s = tuple(self.stored_values.shape)
        if not self.pages_per_row:
            return s
        *lead, _, h2, page_size, d = s
        return (*lead, page_size, h2, d)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> Any:
        return self.stored_values.dtype

    @property
    def nbytes(self) -> int:
        return int(self.stored_values.nbytes) + int(self.stored_scales.nbytes)

    @property
    def sharding(self) -> Any:
        return self.stored_values.sharding

    @property
    def values(self) -> Any:
        """The values as [..., page_size, 2*Hkv, D] (a transposed view in the TPU layout)."""
        if not self.pages_per_row:
            return self.stored_values
        return jnp.swapaxes(self.stored_values[..., 0, :, :, :], -3, -2)

    @property
    def scales(self) -> Any:
        """The scales as [..., page_size, 2*Hkv, 1] (a rearranged view in the TPU layout)."""
        if not self.pages_per_row:
            return self.stored_scales
        r = self.pages_per_row
        *rows, _, h2, _, lanes = self.stored_scales.shape
        page_size = lanes // r
        s = self.stored_scales[..., 0, :, 0, :].reshape(*rows, h2, r, page_size)
        s = jnp.moveaxis(s, -2, -3).reshape(*rows[:-1], rows[-1] * r, h2, page_size)
        return jnp.swapaxes(s, -1, -2)[..., None]

    def reshape(self, *shape: Any) -> QuantizedPool:
        dims = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        if dims[-3:] != self.shape[-3:]:
            raise ValueError(f"a quantized KV pool reshapes its leading axes only: {self.shape} -> {dims}")
        values, scales = stored_shapes(dims, self.pages_per_row)
        return QuantizedPool(self.stored_values.reshape(values), self.stored_scales.reshape(scales),
                             self.pages_per_row)

    def dequantized(self, dtype: Any = jnp.float32) -> jax.Array:
        """The whole pool as `dtype` (tests, references)."""
        return dequantize(self.values, self.scales, dtype)

    def in_layout(self, pages_per_row: int) -> QuantizedPool:
        """The same pool stored in the layout of `pages_per_row` (0: rows; tests, references)."""
        values, scales = self.values, self.scales
        if not pages_per_row:
            return QuantizedPool(values, scales)
        r = pages_per_row
        *lead, page_size, h2, d = values.shape
        stored_v, stored_s = stored_shapes(tuple(values.shape), r)
        s = jnp.swapaxes(scales[..., 0], -1, -2).reshape(*lead[:-1], lead[-1] // r, r, h2, page_size)
        s = jnp.moveaxis(s, -3, -2).reshape(stored_s)
        return QuantizedPool(jnp.swapaxes(values, -3, -2).reshape(stored_v), s, r)

    def __getitem__(self, index: Any) -> QuantizedPool:
        """Both arrays indexed alike (an index over the leading axes, before head_dim), as a rows-layout pool."""
        return QuantizedPool(self.values[index], self.scales[index])

    @property
    def at(self) -> _PoolAt:
        return _PoolAt(self)


@dataclasses.dataclass(frozen=True)
class _PoolAt:
    pool: QuantizedPool

    def __getitem__(self, index: Any) -> _PoolUpdate:
        return _PoolUpdate(self.pool, index)


@dataclasses.dataclass(frozen=True)
class _PoolUpdate:
    pool: QuantizedPool
    index: Any

    def set(self, new: Any, mode: str | None = None) -> QuantizedPool:
        """Rows of both arrays set from `new`: a `pack`ed int8 array or a `QuantizedPool` of rows. In the TPU
        layout the index is (pages, offsets), one token each (the engine's write)."""
        p = self.pool
        if isinstance(new, QuantizedPool):
            values, scales = new.values, new.scales
        else:
            if new.shape[-1] != p.shape[-1] + SCALE_BYTES or new.dtype != jnp.int8:
                raise ValueError(f"a quantized KV pool of head_dim {p.shape[-1]} ({p.dtype}) takes new K/V packed "
                                 f"as int8 [..., {p.shape[-1] + SCALE_BYTES}] (kv_quant.pack), got {new.dtype} "
                                 f"{tuple(new.shape)}")
            values, scales = unpack(new, p.dtype)
        if not p.pages_per_row:
            return QuantizedPool(p.stored_values.at[self.index].set(values, mode=mode),
                                 p.stored_scales.at[self.index].set(scales, mode=mode))
        if not (isinstance(self.index, tuple) and len(self.index) == 2 and p.ndim == 4):
            raise ValueError(f"a TPU-layout quantized KV pool is written at (pages, offsets) of its flat form "
                             f"[pages, page_size, 2*Hkv, D]; got an index of {self.index!r} on shape {p.shape}")
        pages, offsets = (jnp.asarray(i) for i in self.index)
        r, page_size = p.pages_per_row, p.shape[1]
        # [T] tokens: values [T, 2*Hkv, D] into [pages, 1, 2*Hkv, page_size, D], one head_dim row per (token,
        # head): a scatter whose window is the minor axis alone (a window of [2*Hkv, D] made XLA relay the whole
        # pool out with the heads minor, padded, around the layer loop); scales [T, 2*Hkv] into their rows
        heads = jnp.arange(p.shape[2], dtype=pages.dtype)[None, :]
        sv = p.stored_values.at[pages[:, None], 0, heads, offsets[:, None], :].set(values, mode=mode)
        ss = _scatter_scales(p.stored_scales, pages // r, (pages % r) * page_size + offsets, scales, mode)
        return QuantizedPool(sv, ss, r)


def _scatter_scales(stored: Any, rows: jax.Array, lanes: jax.Array, scales: jax.Array, mode: str | None) -> Any:
    """scales [T, 2*Hkv, 1] into `stored` [rows, 1, 2*Hkv, 1, lanes] at (rows[t], head, lanes[t]): a scatter whose
    window is one element of the minor (lanes) axis, as the values' is their head_dim row."""
    t, h2 = scales.shape[:2]
    heads = jnp.broadcast_to(jnp.arange(h2, dtype=rows.dtype)[None, :], (t, h2))
    idx = jnp.stack([jnp.broadcast_to(rows[:, None], (t, h2)), heads, jnp.broadcast_to(lanes[:, None], (t, h2))],
                    axis=-1)
    dims = jax.lax.ScatterDimensionNumbers(update_window_dims=(2,), inserted_window_dims=(0, 1, 2, 3),
                                           scatter_dims_to_operand_dims=(0, 2, 4))
    clip = jax.lax.GatherScatterMode.CLIP if mode == "clip" else jax.lax.GatherScatterMode.FILL_OR_DROP
    return jax.lax.scatter(stored, idx, scales.astype(stored.dtype), dims, mode=clip)


def layout_for(shape: tuple[int, ...], sharding: Any) -> int:
    """`pages_per_row` of a pool of logical `shape` placed by `sharding`: the TPU layout where the sharding's
    devices are TPUs (and the pages of a shard fill whole scale rows), else 0 (rows)."""
    if sharding is None or len(shape) < 4:
        return 0
    devices = getattr(sharding, "device_set", None) or ()
    if not devices or next(iter(devices)).platform != "tpu":
        return 0
    local = sharding.shard_shape(tuple(shape)) if hasattr(sharding, "shard_shape") else shape
    return tpu_pages_per_row(shape[-3], local[-4])


def zeros_pool(shape: tuple[int, ...], dtype: Any, sharding: Any = None) -> QuantizedPool:
    """A zeroed pool of logical values `shape`, in the layout of `sharding`'s platform (inside jit:
    `allocate_pool`)."""
    r = layout_for(shape, sharding)
    values, scales = stored_shapes(shape, r)
    return QuantizedPool(jnp.zeros(values, dtype), jnp.zeros(scales, jnp.float32), r)


def abstract_pool(shape: tuple[int, ...], dtype: Any, sharding: Any = None) -> QuantizedPool:
    """The pool's ShapeDtypeStructs, in the layout of `sharding`'s platform (both arrays take `sharding`: its
    spec splits the pages and heads axes, which are axes 1 and 3 in both layouts)."""
    r = layout_for(shape, sharding)
    values, scales = stored_shapes(shape, r)
    return QuantizedPool(jax.ShapeDtypeStruct(values, jnp.dtype(dtype), sharding=sharding),
                         jax.ShapeDtypeStruct(scales, jnp.float32, sharding=sharding), r)


def gather_pages(pool: QuantizedPool, ids: Any, heads: Any = slice(None), dtype: Any = jnp.float32) -> jax.Array:
    """pool[ids[:, None], :, heads] dequantized to `dtype` (the XLA backend's page gather)."""
    values = pool.values[ids, :, heads]
    scales = pool.scales[ids, :, heads]
    return dequantize(values, scales, dtype)


def numpy_dequantize(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The host version of `dequantize` (float32; tests)."""
    return values.astype(np.float32) * scales.astype(np.float32)
