"""The native CPU kernels as a matmul backend (`engine.cpu_matmul: auto` on CPU): few float32 rows per dp group by
replicated float32 weights (bfloat16 too in the AVX-512 build), and by packed 4-bit layer kernels and an 8-bit tied
table (`raydeploy.model.native.packing`), through `jax.ffi` calls of the library `raydeploy.model.native` builds
and registers. Also the decode rows' paged attention (`decode_attention`), which the engine hands to the XLA
attention backend when it chooses this backend.

XLA CPU multiplies a handful of rows by a weight through a general matrix product made for many rows: on one
thread (each host of the simulated gang) its 2- to 32-row dots take 1.3-2.2x the time of loops that stream every
weight row once (`benchmarks/small_matmul.py`). A `CpuNative` is made per traced step program with that trace's
packed copies; anything the kernels do not take (dtype, shape, rows per group outside [`native.min_rows`,
`native.max_rows`]) goes to XLA's dot (`raydeploy.model.projection.dot`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from raydeploy.model import native
from raydeploy.model.llama import EMBEDDING
from raydeploy.model.native import (
    TARGET,
    TARGET_ATTENTION,
    TARGET_BF16,
    TARGET_MULTI,
    TARGET_MULTI_BF16,
    TARGET_OUT_FIRST,
    TARGET_OUT_FIRST_BF16,
    TARGET_Q4,
    TARGET_Q8,
    packing,
)
from raydeploy.model.projection import LayerSlice, dot


def _call(x: jax.Array, stack: jax.Array, layer: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], stack.shape[2]), jnp.float32)
    return jax.ffi.ffi_call(TARGET_BF16 if stack.dtype == jnp.bfloat16 else TARGET, out)(x, stack, layer)


def _call_out_first(x: jax.Array, stack: jax.Array, layer: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], stack.shape[1]), jnp.float32)
    target = TARGET_OUT_FIRST_BF16 if stack.dtype == jnp.bfloat16 else TARGET_OUT_FIRST
    return jax.ffi.ffi_call(target, out)(x, stack, layer)


def _call_multi(x: jax.Array, layer: jax.Array, *stacks: jax.Array) -> list[jax.Array]:
    outs = [jax.ShapeDtypeStruct((x.shape[0], st.shape[2]), jnp.float32) for st in stacks]
    target = TARGET_MULTI_BF16 if stacks[0].dtype == jnp.bfloat16 else TARGET_MULTI
    return list(jax.ffi.ffi_call(target, outs)(x, layer, *stacks))


def _call_q4(x: jax.Array, layer: jax.Array, *packed: jax.Array) -> list[jax.Array]:
    outs = [jax.ShapeDtypeStruct((x.shape[0], p.shape[2] * packing.BLOCK), jnp.float32) for p in packed]
    return list(jax.ffi.ffi_call(TARGET_Q4, outs)(x, layer, *packed))


def _call_q8(x: jax.Array, table: jax.Array, layer: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], table.shape[2] * packing.BLOCK), jnp.float32)
    return jax.ffi.ffi_call(TARGET_Q8, out)(x, table, layer)




def _stacked(w: Any) -> tuple[jax.Array, jax.Array]:
    """A weight as the kernel takes it: the stack [L, ...] and the layer index."""
    if isinstance(w, LayerSlice):
        return w.stack.reshape(w.stack.shape[0], *w.shape), jnp.asarray(w.layer, jnp.int32)
    return w.reshape(1, *w.shape), jnp.zeros((), jnp.int32)


class CpuNative:
    """The native kernels for the projections of one traced step program: activations' first dim split over
    `row_axes` of `mesh` (one dp group each), every weight replicated (the chooser checks the mesh: each other
    axis of size 1). `packed`: packed copies of weights by name, read for a `LayerSlice` of that name: stacked
    layer kernels' 4-bit tiles (`packing.pack_q4`, [L, K/32, N/32, 768], by path in the layer module) and a tied
    embedding table's 8-bit rows (`packing.pack_q8`, [1, D/32, V/32, 1152], "embed.embedding")."""

    reads_whole = True

    def __init__(self, mesh: jax.sharding.Mesh, row_axes: Sequence[str],
                 packed: Mapping[str, jax.Array] | None = None) -> None:
        self.mesh = mesh
        self.row_axes = tuple(row_axes)
        self.groups = 1
        for a in self.row_axes:
            self.groups *= int(mesh.shape[a])
        self.packed = dict(packed or {})

    def _packed(self, x: jax.Array, w: Any, out_first: bool = False) -> jax.Array | None:
        """The packed copy the kernel reads for x @ w (w a `LayerSlice` named in `packed`: a layer kernel's
        4-bit tiles, or with out_first a table's 8-bit tiles; rows per group within [1, `packed_max_rows()`]),
        else None."""
        if not isinstance(w, LayerSlice) or w.name is None or w.name not in self.packed or len(w.shape) != 2:
            return None
        p = self.packed[w.name]
        n, k = w.shape if out_first else w.shape[::-1]
        fits = (tuple(p.shape[1:3]) == (k // packing.BLOCK, n // packing.BLOCK)
                and p.shape[3] == (packing.Q8_TILE if out_first else packing.TILE))
        if (not fits or x.ndim != 2 or x.dtype != jnp.float32 or x.shape[0] % self.groups
                or not 1 <= x.shape[0] // self.groups <= native.packed_max_rows()):
            return None
        return p

    def applies(self, x: jax.Array, w: Any, out_first: bool = False) -> bool:
        """Whether the (unpacked) kernel takes x @ w: x 2-D float32, w 2-D of a dtype this build multiplies (N a
        multiple of 8 in_out), rows per group within [`native.min_rows`, `native.max_rows`] of w's dtype."""
        return not (x.ndim != 2 or len(w.shape) != 2 or x.dtype != jnp.float32
                    or jnp.dtype(w.dtype).name not in native.weight_dtypes()
                    or (not out_first and w.shape[1] % 8) or x.shape[0] % self.groups
                    or not native.min_rows(w.dtype) <= x.shape[0] // self.groups <= native.max_rows(w.dtype))

    def _per_group(self, fn: Any, x: jax.Array, *operands: jax.Array, outs: int | None = None) -> Any:
        """fn(x, *operands) on each dp group's rows of x (operands replicated), or directly on a one-device mesh."""
        if self.mesh.size == 1:
            return fn(x, *operands)
        spec = PartitionSpec(self.row_axes if len(self.row_axes) > 1 else self.row_axes[0])
        return jax.shard_map(fn, mesh=self.mesh, in_specs=(spec, *(PartitionSpec() for _ in operands)),
                             out_specs=spec if outs is None else [spec] * outs,
                             axis_names=frozenset(self.mesh.axis_names), check_vma=False)(x, *operands)

    def kernel(self, x: jax.Array, w: Any, out_first: bool = False) -> jax.Array | None:
        """x [M, K] @ w through the kernel, w [K, N] or with out_first [N, K] (a tied embedding table as the LM
        head), an array or a `LayerSlice`; None where the kernel does not apply."""
        if (p := self._packed(x, w, out_first)) is not None:
            layer = jnp.asarray(w.layer, jnp.int32)
            if out_first:
                return self._per_group(_call_q8, x, p, layer)  # type: ignore[no-any-return]
            return self._per_group(_call_q4, x, layer, p, outs=1)[0]  # type: ignore[no-any-return]
        if not self.applies(x, w, out_first):
            return None
        stack, layer = _stacked(w)
        return self._per_group(_call_out_first if out_first else _call, x, stack, layer)  # type: ignore[no-any-return]

    def matmul(self, x: jax.Array, w: Any, out_first: bool = False) -> jax.Array:
        y = self.kernel(x, w, out_first)
        return dot(x, w, out_first) if y is None else y

    def matmuls(self, x: jax.Array, ws: Sequence[Any]) -> list[jax.Array] | None:
        """[x @ w for w in ws] in one kernel call (in_out weights [K, N_i] of one dtype, arrays or `LayerSlice`s of
        one layer): a layer's q, k, v or gate and up projections, whose separate calls would each split over the
        threads and start a weight stream of their own. None where `kernel` would be None for any of them."""
        packed = [self._packed(x, w) for w in ws]
        if ws and len(ws) <= 8 and all(p is not None for p in packed) and len({id(w.layer) for w in ws}) == 1:
            return list(self._per_group(_call_q4, x, jnp.asarray(ws[0].layer, jnp.int32), *packed,  # type: ignore[arg-type]
                                        outs=len(ws)))
        if (not ws or len(ws) > 8 or len({jnp.dtype(w.dtype) for w in ws}) != 1
                or not all(self.applies(x, w) for w in ws)):
            return None
        layers = [w.layer for w in ws if isinstance(w, LayerSlice)]
        if layers and (len(layers) != len(ws) or any(lay is not layers[0] for lay in layers)):
            return None  # one layer index for every weight
        stacks = [_stacked(w) for w in ws]
        layer = stacks[0][1]
        return list(self._per_group(_call_multi, x, layer, *(st for st, _ in stacks), outs=len(ws)))

    def tied_head(self, h: jax.Array, table: jax.Array) -> jax.Array:
        """The tied table as a `LayerSlice` named `EMBEDDING`, so the kernel can read its packed copy."""
        return self.matmul(h, LayerSlice(table[None], jnp.zeros((), jnp.int32), name=EMBEDDING), out_first=True)


KV_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # pools the kernel reads


def decode_attention(q_rows: jax.Array, kv_pages: jax.Array, lens: jax.Array, page_indices: jax.Array, *,
                     sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None
                     ) -> jax.Array | None:
    """Each row's one query token against its keys in the page pool -> [S, Hq, D] float32, through the kernel
    (`decode_attention.cc`): q_rows [S, Hq, D], kv_pages [P, page_size, 2*Hkv, D] (K head h at 2h, V at 2h+1),
    lens i32[S] (the row attends to positions [0, lens), or the last `sliding_window` of them; 0 = zeros),
    page_indices i32[S, pages]. Called per shard (the attention backends run inside the engine's shard_map), by
    the XLA attention backend of an engine that chose `CpuNative` (`raydeploy.engine.attention.Attention`'s
    `decode_rows`). None unless q is float32, the pool float32, bfloat16 or float16 (`engine.kv_dtype`; widened
    to float32 as it is read) and the kernel is built: the caller then computes it in XLA."""
    if q_rows.dtype != jnp.float32 or kv_pages.dtype not in KV_DTYPES or native.unavailable() is not None:
        return None
    out = jax.ShapeDtypeStruct(q_rows.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET_ATTENTION, out)(
        q_rows, kv_pages, lens.astype(jnp.int32), page_indices.astype(jnp.int32), sm_scale=np.float32(sm_scale),
        soft_cap=np.float32(soft_cap or 0.0), sliding_window=np.int64(sliding_window or 0))
