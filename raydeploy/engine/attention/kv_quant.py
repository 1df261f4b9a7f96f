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

Between the quantization and the write, a step's new K/V travel as one int8 array [T, 2*Hkv, D + 4] (`pack`):
the D value bytes and the scale's 4 bytes, so the write is one scatter of one array per layer, as for a float
pool; `QuantizedPool.at[...].set` unpacks it. The pool itself never stores that layout.

Every attention backend reads a `QuantizedPool`: the XLA path dequantizes in its page gather, the GPU Pallas
kernel multiplies the scales inside the kernel, the TPU wrapper dequantizes the pages a step's table names before
jax's kernel (`raydeploy.engine.attention.pallas_tpu`).
"""

from __future__ import annotations

import dataclasses
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPool:
    """A quantized KV pool: `values` [..., 2*Hkv, D] (int8 or float8) and `scales` [..., 2*Hkv, 1] float32 with the
    same leading axes. Its `shape` and `dtype` are the values'; `reshape` reshapes both; `.at[idx].set(new)`
    scatters rows of both, from a `pack`ed array or another `QuantizedPool`."""

    values: Any
    scales: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def dtype(self) -> Any:
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes) + int(self.scales.nbytes)

    @property
    def sharding(self) -> Any:
        return self.values.sharding

    def reshape(self, *shape: Any) -> QuantizedPool:
        dims = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        return QuantizedPool(self.values.reshape(dims), self.scales.reshape(*dims[:-1], 1))

    def dequantized(self, dtype: Any = jnp.float32) -> jax.Array:
        """The whole pool as `dtype` (tests, references)."""
        return dequantize(self.values, self.scales, dtype)

    def __getitem__(self, index: Any) -> QuantizedPool:
        """Both arrays indexed alike (an index over the leading axes, before head_dim)."""
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
        """Rows of both arrays set from `new`: a `pack`ed int8 array or a `QuantizedPool` of rows."""
        p = self.pool
        if isinstance(new, QuantizedPool):
            values, scales = new.values, new.scales
        else:
            if new.shape[-1] != p.shape[-1] + SCALE_BYTES or new.dtype != jnp.int8:
                raise ValueError(f"a quantized KV pool of head_dim {p.shape[-1]} ({p.dtype}) takes new K/V packed "
                                 f"as int8 [..., {p.shape[-1] + SCALE_BYTES}] (kv_quant.pack), got {new.dtype} "
                                 f"{tuple(new.shape)}")
            values, scales = unpack(new, p.dtype)
        return QuantizedPool(p.values.at[self.index].set(values, mode=mode),
                             p.scales.at[self.index].set(scales, mode=mode))


def zeros_pool(shape: tuple[int, ...], dtype: Any) -> QuantizedPool:
    """A zeroed pool of values `shape` (inside jit: `allocate_pool`)."""
    return QuantizedPool(jnp.zeros(shape, dtype), jnp.zeros((*shape[:-1], 1), jnp.float32))


def abstract_pool(shape: tuple[int, ...], dtype: Any, sharding: Any = None) -> QuantizedPool:
    """The pool's ShapeDtypeStructs (both take `sharding`: the scales' trailing axis is never split)."""
    return QuantizedPool(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding),
                         jax.ShapeDtypeStruct((*shape[:-1], 1), jnp.float32, sharding=sharding))


def gather_pages(pool: QuantizedPool, ids: Any, heads: Any = slice(None), dtype: Any = jnp.float32) -> jax.Array:
    """pool[ids[:, None], :, heads] dequantized to `dtype` (the XLA backend's page gather)."""
    values = pool.values[ids, :, heads]
    scales = pool.scales[ids, :, heads]
    return dequantize(values, scales, dtype)


def numpy_dequantize(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The host version of `dequantize` (float32; tests)."""
    return values.astype(np.float32) * scales.astype(np.float32)
