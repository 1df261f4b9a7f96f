"""x @ w[layer] for a weight stacked over layers, read in place by a Pallas (Triton) kernel on a GPU.

A decode step scans its layers over weights stacked [L, K, N]. XLA GPU copies each layer's slice of such a weight
into a new buffer before a gemm (a dynamic slice is not a library call's operand), so at few rows, where the
step is the weights' read, every weight is written and read twice (Llama-3.2-1B on an H100: 1.21 of 3.86 ms of a
batch-1 pass). This kernel takes the whole stack and the layer index and reads that layer's tiles where they
lie: grid (N / block_n, splits), each program a run of K in `block_k` steps, the splits' partial sums added
after (few rows, so the partials are small).

Rows are padded to 16 (Triton's dot needs 16 on each side); meant for the few rows of a decode step. An engine on
a GPU (`engine.gpu_matmul: auto`) chooses this backend once and hands a `PallasGpu` to the model's projections in
its step programs: it takes a `LayerSlice` of bfloat16 weights and at most `MAX_ROWS` rows per dp group, each
device multiplying its rows by its shard of the weight (summed over the axes that split K), and leaves anything
else to XLA's dot.

Quantized weights (`model.quantization` int8 / fp8, `raydeploy.model.quant.Quantized`: an int8 or float8_e4m3fn
stack and the layer's float32 scale per output column) go through the same kernel: it reads the one-byte values
where they lie, converts each [block_k, block_n] tile to bfloat16 in registers (exact: every int8 and e4m3 value
is a bfloat16 value) and multiplies its float32 sums by the scales of its columns, so HBM reads one byte a weight
and no dequantized copy exists. Triton converts float8_e4m3fn on compute capability 8.9 and newer (H100/H200),
the chips the engine runs fp8 on at all (`raydeploy.model.quant.fp8_support`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec

from raydeploy.model.projection import LayerSlice, dot
from raydeploy.model.quant import Quantized

MIN_ROWS = 16
MAX_ROWS = 64
"""The most rows per dp group `matmul` sends to the kernel; more go to XLA's gemm (whose copy of the layer's weight
is then shared by enough rows)."""
TARGET_PROGRAMS = 264
"""Programs to aim for (two per H100 multiprocessor): the splits of K are chosen to come near it."""


MIN_COMPUTE_CAPABILITY = (8, 0)
"""Triton's bfloat16 dot needs Ampere or newer (sm_80): older GPUs keep XLA's gemm."""


def device_problem(device: Any) -> str | None:
    """Why the kernel cannot run on `device` (a jax GPU device), or None: its compute capability below
    `MIN_COMPUTE_CAPABILITY`. A device that does not say (an older jax) is taken as able."""
    cc = getattr(device, "compute_capability", None)
    if not cc:
        return None
    try:
        have = tuple(int(p) for p in str(cc).split(".")[:2])
    except ValueError:
        return None
    if have < MIN_COMPUTE_CAPABILITY:
        need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
        return (f"the GPU's compute capability is {cc} (the kernel's bfloat16 dot needs {need}, Ampere or "
                f"newer)")
    return None


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def blocks_for(k: int, n: int, block_n: int = 128, block_k: int = 128) -> tuple[int, int, int]:
    """(block_n, block_k, splits) for a [K, N] weight: the largest power-of-two blocks up to the given ones that
    divide N and K, and the power-of-two split of K's steps that brings the grid nearest `TARGET_PROGRAMS`."""
    while n % block_n:
        block_n //= 2
    while k % block_k:
        block_k //= 2
    if block_n < 16 or block_k < 16:
        raise ValueError(f"stacked_matmul: a [{k}, {n}] weight has no power-of-two blocks of at least 16")
    steps = k // block_k
    splits = 1
    while (steps % (2 * splits) == 0 and (n // block_n) * splits * 2 <= TARGET_PROGRAMS):
        splits *= 2
    return block_n, block_k, splits


QUANTIZED_DTYPES = (jnp.int8, jnp.float8_e4m3fn)
"""Weight dtypes the kernel reads quantized, with a float32 scale per output column: converted to bfloat16 in the
kernel (exact: int8 and float8_e4m3fn values are all bfloat16 values), so HBM reads one byte a weight."""


def _kernel(layer_ref, x_ref, w_ref, *refs, block_k: int, steps: int) -> None:
    s_ref, o_ref = refs if len(refs) == 2 else (None, refs[0])
    layer = layer_ref[0]
    split = pl.program_id(1)

    def body(j, acc):
        k0 = pl.multiple_of((split * steps + j) * block_k, block_k)
        xs = x_ref[:, pl.ds(k0, block_k)]
        ws = w_ref[layer, pl.ds(k0, block_k), :]
        return acc + plgpu.dot(xs, ws.astype(xs.dtype))

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, jnp.float32))
    if s_ref is not None:  # the columns' scales (the layer's row of a stack of them); linear, so each split's
        # partial sum takes them
        acc = acc * s_ref[layer if s_ref.shape[0] > 1 else 0, :][None, :]
    o_ref[...] = acc


def compute_dtype(w_dtype: Any) -> Any:
    """The dtype the kernel multiplies in for a weight of `w_dtype`: bfloat16 for a quantized weight, else the
    weight's own."""
    return jnp.bfloat16 if any(w_dtype == d for d in QUANTIZED_DTYPES) else w_dtype


@partial(jax.jit, static_argnames=("interpret", "out_dtype", "num_warps", "num_stages"))
def stacked_matmul(x: jax.Array, w: jax.Array, layer: jax.Array, scale: jax.Array | None = None, *,
                   interpret: bool = False, out_dtype: Any = None, num_warps: int = 4,
                   num_stages: int = 3) -> jax.Array:
    """x [M, K] @ w[layer] for w [L, K, N] -> [M, N] in `out_dtype` (default x's; float32 accumulation); `layer`
    an int32 scalar, traced or not. x is multiplied in w's dtype, as XLA's dot of the model does.

    A quantized w (int8 or float8_e4m3fn, `QUANTIZED_DTYPES`) comes with `scale`, float32, one per output column:
    that layer's [N] (as a layer scan slices it) or every layer's [L, N]. The kernel reads w's bytes as they lie,
    converts each tile to bfloat16 and multiplies the accumulator by the layer's scales, so the product is
    x @ (w[layer] * scale) with x in bfloat16."""
    m, k = x.shape
    n_layers, kw, n = w.shape
    if kw != k:
        raise ValueError(f"stacked_matmul: x [{m}, {k}] against a stacked weight {tuple(w.shape)}")
    quantized = any(w.dtype == d for d in QUANTIZED_DTYPES)
    if quantized != (scale is not None):
        raise ValueError(f"stacked_matmul: a {w.dtype} weight {'needs' if quantized else 'takes no'} scales")
    if scale is not None and tuple(scale.shape) not in ((n,), (n_layers, n)):
        raise ValueError(f"stacked_matmul: scales {tuple(scale.shape)} for a stacked weight {tuple(w.shape)} "
                         f"(expected the layer's {(n,)} or every layer's {(n_layers, n)})")
    rows = max(MIN_ROWS, _pow2_at_least(m))
    block_n, block_k, splits = blocks_for(k, n)
    steps = k // block_k // splits
    xp = jnp.pad(x.astype(compute_dtype(w.dtype)), ((0, rows - m), (0, 0)))
    in_specs = [pl.BlockSpec((1,), lambda i, s: (0,)),
                pl.BlockSpec((rows, k), lambda i, s: (0, 0)),
                pl.BlockSpec((n_layers, k, block_n), lambda i, s: (0, 0, i))]
    operands = [jnp.reshape(layer, (1,)).astype(jnp.int32), xp, w]
    if scale is not None:
        scale = scale.astype(jnp.float32).reshape(-1, n)
        in_specs.append(pl.BlockSpec((scale.shape[0], block_n), lambda i, s: (0, i)))
        operands.append(scale)
    kind = f"_{jnp.dtype(w.dtype).name}" if quantized else ""
    parts = pl.pallas_call(
        partial(_kernel, block_k=block_k, steps=steps),
        grid=(n // block_n, splits),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, rows, block_n), lambda i, s: (s, 0, i)),
        out_shape=jax.ShapeDtypeStruct((splits, rows, n), jnp.float32),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"stacked_matmul{kind}_{block_n}x{block_k}x{splits}",
    )(*operands)
    return parts.sum(axis=0)[:m].astype(out_dtype or x.dtype)


# -- the backend the engine's programs hand to the model -----------------------------------------------------


def _axes(entry: Any) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def merged_spec(entries: Sequence[Any], shape: Sequence[int], to: Sequence[int]) -> tuple[Any, ...] | None:
    """A partition of `shape` (one entry per dim) carried through a reshape to `to` that merges runs of
    consecutive dims (a layer's [embed, heads, head_dim] kernel as [embed, heads * head_dim]): a merged dim
    takes its first dim's entry, and the others must be unsplit. None for any other reshape."""
    out: list[Any] = []
    i = 0
    for size in to:
        group: list[int] = []
        prod = 1
        while i < len(shape) and (not group or prod < size):
            prod *= shape[i]
            group.append(i)
            i += 1
        if prod != size or any(entries[j] is not None for j in group[1:]):
            return None
        out.append(entries[group[0]])
    return tuple(out) if i == len(shape) else None


class PallasGpu:
    """The kernel for the projections of one traced step program: activations' first dim split over `row_axes`
    of `mesh` (`interpret`: Pallas interpret mode, off a GPU). `specs`: each stacked layer weight's partition
    ([L, ...], by its path in the layer module, as `LayerSlice.name`); None when every weight is replicated. A
    weight split over other axes (tp, fsdp) is multiplied per device on its own shard: its columns' split
    carries to the output, a split of its rows (K) is summed over those axes after."""

    reads_whole = True

    def __init__(self, mesh: jax.sharding.Mesh, row_axes: Sequence[str], interpret: bool = False,
                 specs: Mapping[str, PartitionSpec] | None = None) -> None:
        self.mesh = mesh
        self.row_axes = tuple(row_axes)
        self.groups = 1
        for a in self.row_axes:
            self.groups *= int(mesh.shape[a])
        self.interpret = interpret
        self.specs = specs

    def applies(self, x: jax.Array, w: Any, out_first: bool = False) -> bool:
        """Whether the kernel may take x @ w: x 2-D, at most `MAX_ROWS` rows per group, and w a `LayerSlice` of a
        bfloat16 in_out weight (2-D as the layer sees it), or a `Quantized` one (`raydeploy.model.quant`: an int8
        or float8 `LayerSlice` [K, N] with the layer's float32 scales [N]) multiplied by bfloat16 rows. A plain
        array stays with XLA, which reads it in place; float32 weights too, whose dot would round through TF32 in
        the kernel, and quantized weights by float32 rows, which XLA multiplies in float32. (`kernel` also needs
        power-of-two blocks of each device's shard.)"""
        if out_first or x.ndim != 2 or x.shape[0] % self.groups or x.shape[0] // self.groups > MAX_ROWS:
            return False
        if isinstance(w, Quantized):
            data = w.data
            return (isinstance(data, LayerSlice) and len(data.shape) == 2 and w.inputs == 1
                    and any(data.dtype == d for d in QUANTIZED_DTYPES) and x.dtype == jnp.bfloat16
                    and tuple(w.scale.shape) == (data.shape[1],))
        return isinstance(w, LayerSlice) and len(w.shape) == 2 and w.dtype == jnp.bfloat16

    def _weight_split(self, w: LayerSlice) -> tuple[Any, Any] | None:
        """The mesh axes entries of w's (K, N) dims, (None, None) when replicated; None when the kernel cannot
        take its split (its layer dim split, a reshape that moves a split, an axis the rows are split over too)."""
        if self.specs is None:
            return None, None
        spec = self.specs.get(w.name or "")
        if spec is None:
            return None
        entries = tuple(spec) + (None,) * (w.stack.ndim - len(spec))
        if entries[0] is not None:
            return None
        merged = merged_spec(entries[1:], w.stack.shape[1:], w.shape)
        if merged is None or set(_axes(merged[0]) + _axes(merged[1])) & set(self.row_axes):
            return None
        return merged[0], merged[1]

    def kernel(self, x: jax.Array, w: Any, out_first: bool = False) -> jax.Array | None:
        """x [M, K] @ w (a `LayerSlice` [K, N], or a `Quantized` one with its scales [N]) through the kernel on
        each device's rows and weight shard, or None where it does not apply (`applies`, `_weight_split`, blocks
        of the shard). A quantized weight's scales are split like its columns."""
        if not self.applies(x, w, out_first):
            return None
        data, scale = (w.data, w.scale) if isinstance(w, Quantized) else (w, None)
        split = self._weight_split(data)
        if split is None:
            return None
        k_axes, n_axes = _axes(split[0]), _axes(split[1])
        shards = [math.prod(int(self.mesh.shape[a]) for a in axes) for axes in (k_axes, n_axes)]
        k, n = data.shape
        if k % shards[0] or n % shards[1]:
            return None
        try:
            blocks_for(k // shards[0], n // shards[1])
        except ValueError:
            return None
        stack = data.stack.reshape(data.stack.shape[0], *data.shape)
        layer = jnp.asarray(data.layer, jnp.int32)
        scales = () if scale is None else (jnp.asarray(scale, jnp.float32),)
        interpret = self.interpret

        def per_device(xs: jax.Array, st: jax.Array, lay: jax.Array, *sc: jax.Array) -> jax.Array:
            if not k_axes:
                return stacked_matmul(xs, st, lay, *sc, interpret=interpret)  # type: ignore[no-any-return]
            y = stacked_matmul(xs, st, lay, *sc, interpret=interpret, out_dtype=jnp.float32)
            return jax.lax.psum(y, k_axes).astype(xs.dtype)

        if self.mesh.size == 1:
            return per_device(x, stack, layer, *scales)
        rows = self.row_axes
        row = None if not rows else (rows[0] if len(rows) == 1 else rows)
        in_specs = (PartitionSpec(row, split[0]), PartitionSpec(None, split[0], split[1]), PartitionSpec())
        return jax.shard_map(per_device, mesh=self.mesh,  # type: ignore[no-any-return]
                             in_specs=in_specs + (PartitionSpec(split[1]),) * len(scales),
                             out_specs=PartitionSpec(row, split[1]), axis_names=frozenset(self.mesh.axis_names),
                             check_vma=False)(x, stack, layer, *scales)

    def matmul(self, x: jax.Array, w: Any, out_first: bool = False) -> jax.Array:
        y = self.kernel(x, w, out_first)
        return dot(x, w, out_first) if y is None else y

    def matmuls(self, x: jax.Array, ws: Sequence[Any]) -> list[jax.Array] | None:
        return None  # one kernel call per weight

    def tied_head(self, h: jax.Array, table: jax.Array) -> jax.Array:
        return dot(h, table, out_first=True)
