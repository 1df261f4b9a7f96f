"""Native CPU kernels the engine's programs call through `jax.ffi`: a matmul of few float32 rows (`small_matmul.cc`;
float32 weights, and bfloat16 weights in the AVX-512 build) and the paged attention of decode rows
(`decode_attention.cc`, `decode_attention`, which the XLA attention backend asks first: it reads each row's keys
where they lie in the pool instead of gathering copies of them), both in one library, built for the CPU's vector
unit (`isa`: AVX-512 where the CPU has AVX-512 F and BW, else AVX2). Both builds also multiply float32 weights that are
exactly 4-bit or 8-bit blocks from packed copies (`packing`; `rows_over(..., packed=)`).

XLA CPU multiplies a handful of rows by a weight through a general matrix product made for many rows: on one
thread (each host of the simulated gang) its 2- to 32-row dots take 1.3-2.2x the time of loops that stream
every weight row once (`benchmarks/small_matmul.py`). The engine's step programs on CPU call the kernel for
projections of `min_rows` to `max_rows` rows per device when the weights are replicated over the mesh (a dp-only
mesh, the CPU default): `rows_over` marks the traced step, `matmul` is what the model's matmul asks first.

Built on first use with the machine's C++ compiler (`$CXX`, else `c++`, `g++` or `clang++`) against jax's own
FFI headers, into `$RAYDEPLOY_NATIVE_CACHE` (default `~/.cache/raydeploy/native`) under a key of the source,
the jax version and the flags, and registered with XLA once per process. Where it cannot be built (no compiler,
a CPU without AVX2 and FMA, not x86-64), `unavailable()` says why, one warning of the `raydeploy.native` logger
says it once per process, and the model keeps XLA's dot. The sources (`SOURCES`, `HEADERS`) are package data:
the wheel carries them (`tests/test_wheel.py`).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from raydeploy.model.native import packing

HERE = Path(__file__).parent
SOURCES = (HERE / "small_matmul.cc", HERE / "decode_attention.cc")
HEADERS = (HERE / "split.h",)
TARGET = "raydeploy_small_matmul"
TARGET_OUT_FIRST = "raydeploy_small_matmul_out_first"
TARGET_ATTENTION = "raydeploy_decode_attention"
TARGET_MULTI = "raydeploy_small_matmul_multi"
TARGET_BF16 = "raydeploy_small_matmul_bf16"
TARGET_MULTI_BF16 = "raydeploy_small_matmul_multi_bf16"
TARGET_OUT_FIRST_BF16 = "raydeploy_small_matmul_out_first_bf16"
TARGET_Q4 = "raydeploy_small_matmul_q4"
TARGET_Q8 = "raydeploy_small_matmul_q8"
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-shared", "-fPIC", "-w")
BUILD_TIMEOUT_S = 300.0

log = logging.getLogger("raydeploy.native")


def min_rows(weight_dtype: Any) -> int:
    """The fewest rows per device the kernel takes for weights of `weight_dtype`. One row of float32 weights stays
    with XLA in the AVX2 build, whose matrix-vector product streams them as fast (19.5 ms for the demo's 211
    matmuls against 21.1 chained in the kernel, 2 threads); the AVX-512 build takes it (the demo engine's batch-1
    decode 38.7 -> 49.8 tok/s, the same 2-thread Xeon). bfloat16 weights go to the kernel from one row (XLA CPU's
    bfloat16 matrix-vector product is several times slower than float32)."""
    return 1 if jnp.dtype(weight_dtype) == jnp.bfloat16 or isa() == "avx512" else 2


def max_rows(weight_dtype: Any) -> int:
    """The most rows per device the kernel takes for weights of `weight_dtype`. float32: 32, from 64 rows XLA's
    dot is as fast (the demo's 211 matmuls, 2 threads: 100.6 ms in the kernel against 97.4 at 64 rows). bfloat16
    (the AVX-512 build): 128, where XLA's bfloat16 dot is slower than the kernel up to 128 rows (64 / 128 rows,
    2 threads: 113.2 / 230.2 ms against 136.9 / 248.9) and faster from 256 (507.2 against 461.5)."""
    return 128 if jnp.dtype(weight_dtype) == jnp.bfloat16 else 32


PACKED_MAX_ROWS = 256
"""The most rows per device the kernel multiplies by packed weights (`packing`): every prompt step of the default
`engine.prefill_chunk`; more go to XLA's dot over the float32 weights. Past 8 rows the kernel converts each tile's
nibbles once for all its row groups, and with several threads and at least 64 rows a thread, splits the rows
rather than the weight. A layer scan's XLA dot also copies each layer's weight slice first (the packed copy is
read in place). The demo engine's prompt step on one thread (the simulated gang's hosts): 96 / 128 / 192 / 256
tokens 234 / 276 / 386 / 484 ms through XLA against 179 / 224 / 336 / 446 packed; on two threads 163 / 254 / 335
against 132-146 / 249 / 303."""
PACKED_MAX_ROWS_AVX2 = 64
"""The same in the AVX2 build, whose rows pass a converted tile in groups of 3: on one thread its 211 packed matmuls
take 121 / 239 / 493 ms at 32 / 64 / 128 rows against XLA's dot at 123 / 218 / 371 (`benchmarks/small_matmul.py`,
XLA without the scan's slice copies), so from 64 rows XLA's dot is as fast or faster."""


def packed_max_rows() -> int:
    """The most rows per device this CPU's build multiplies by packed weights."""
    return PACKED_MAX_ROWS if isa() == "avx512" else PACKED_MAX_ROWS_AVX2


def cache_dir() -> Path:
    return Path(os.environ.get("RAYDEPLOY_NATIVE_CACHE") or "~/.cache/raydeploy/native").expanduser()


def _cpu_flags() -> list[str]:
    """The CPU's feature flags (/proc/cpuinfo); raises OSError where they cannot be read."""
    return next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("flags")), [])


def _cpu_problem() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU is {platform.machine()}, the kernel is written for x86-64 (AVX2, FMA, F16C)"
    try:
        have = _cpu_flags()
    except OSError as e:
        return f"cannot read /proc/cpuinfo for the CPU's flags: {e}"
    missing = [f for f in ("avx2", "fma", "f16c") if f not in have]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def _requested_isa() -> str:
    """`RAYDEPLOY_NATIVE_ISA`: "avx2", "avx512" (without VNNI), or "" for everything the CPU has."""
    return os.environ.get("RAYDEPLOY_NATIVE_ISA", "").lower()


@functools.cache
def isa() -> str:
    """The vector extension the kernels are built for on this CPU: "avx512" where it has AVX-512 F and BW (the matmul's
    register-blocked strips, `small_matmul.cc`), else "avx2"; `RAYDEPLOY_NATIVE_ISA=avx2` keeps the AVX2 build
    on an AVX-512 CPU (and `avx512` the AVX-512 build without VNNI: `flags`)."""
    if _requested_isa() == "avx2":
        return "avx2"
    try:
        have = _cpu_flags()
        return "avx512" if "avx512f" in have and "avx512bw" in have else "avx2"
    except OSError:
        return "avx2"


def flags() -> tuple[str, ...]:
    """The compiler flags of this CPU's build: AVX-512 F and BW, and VNNI where the CPU has it (`vpdpwssd` for the
    packed weights' integer sums; without it, or with `RAYDEPLOY_NATIVE_ISA=avx512`, `vpmaddwd` and `vpaddd`: the
    same sums)."""
    if isa() != "avx512":
        return FLAGS
    try:
        vnni = "avx512_vnni" in _cpu_flags() and _requested_isa() != "avx512"
    except OSError:
        vnni = False
    return FLAGS + ("-mavx512f", "-mavx512bw") + (("-mavx512vnni",) if vnni else ())


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def build(out_dir: Path | None = None) -> Path:
    """The kernel's shared library, compiled unless a build of this source, jax version and flags exists.
    Raises RuntimeError saying what failed (no compiler, a compile error with its output, a timeout)."""
    if (problem := _cpu_problem()) is not None:
        raise RuntimeError(problem)
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++, g++ or clang++)")
    key = hashlib.sha256(b"\0".join([*(f.read_bytes() for f in (*SOURCES, *HEADERS)), jax.__version__.encode(),
                                     cxx.encode(), " ".join(flags()).encode()])).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"kernels-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # several host processes may build at once: each into its own file, then one atomic rename wins
    fd, tmp = tempfile.mkstemp(prefix=".kernels-", suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [cxx, *flags(), f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{' '.join(cmd)} did not finish in {BUILD_TIMEOUT_S:.0f} s") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def _register() -> str | None:
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
    except (RuntimeError, OSError) as e:
        why = f"native CPU kernels unavailable: {e}"
        log.warning("%s; the model keeps XLA's dot and attention", why)  # once per process (cached)
        return why
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.RaydeploySmallMatmul), platform="cpu")
    jax.ffi.register_ffi_target(TARGET_OUT_FIRST, jax.ffi.pycapsule(lib.RaydeploySmallMatmulOutFirst), platform="cpu")
    jax.ffi.register_ffi_target(TARGET_ATTENTION, jax.ffi.pycapsule(lib.RaydeployDecodeAttention), platform="cpu")
    jax.ffi.register_ffi_target(TARGET_MULTI, jax.ffi.pycapsule(lib.RaydeploySmallMatmulMulti), platform="cpu")
    jax.ffi.register_ffi_target(TARGET_Q4, jax.ffi.pycapsule(lib.RaydeploySmallMatmulQ4), platform="cpu")
    jax.ffi.register_ffi_target(TARGET_Q8, jax.ffi.pycapsule(lib.RaydeploySmallMatmulQ8), platform="cpu")
    if isa() == "avx512":
        jax.ffi.register_ffi_target(TARGET_MULTI_BF16, jax.ffi.pycapsule(lib.RaydeploySmallMatmulMultiBf16),
                                    platform="cpu")
        jax.ffi.register_ffi_target(TARGET_BF16, jax.ffi.pycapsule(lib.RaydeploySmallMatmulBf16), platform="cpu")
        jax.ffi.register_ffi_target(TARGET_OUT_FIRST_BF16, jax.ffi.pycapsule(lib.RaydeploySmallMatmulOutFirstBf16),
                                    platform="cpu")
    return None


def unavailable() -> str | None:
    """None once the kernel is built and registered in this process, else why it cannot be."""
    return _register()


def packs_weights() -> str | None:
    """None where the kernel multiplies packed 4-bit layer weights and 8-bit tables (`raydeploy.model.native.packing`;
    both builds), else why not."""
    return unavailable()


def weight_dtypes() -> tuple[str, ...]:
    """The weight dtypes the matmul kernel multiplies float32 rows by: float32, and bfloat16 in the AVX-512 build."""
    return ("float32", "bfloat16") if isa() == "avx512" else ("float32",)


# -- one layer of a stacked weight, passed whole ------------------------------------------------------------


class LayerSlice:
    """Layer `layer` of a stacked weight `stack` [L, ...], not sliced out: the kernel takes the stack and the
    index, so a layer scan passes the weights through untouched (XLA CPU copies a layer's slice of a stacked
    weight into a new buffer before any library call reads it). Reads as the layer's own array would
    (`shape`, `dtype`, `[...]`, `reshape`); `materialize()` is that array, for whatever the kernel does not run.
    `name`: the stacked parameter's path in the layer module ("attn.q_proj.kernel"), by which a kernel that
    needs the weight's sharding looks it up."""

    def __init__(self, stack: jax.Array, layer: jax.Array, shape: Sequence[int] | None = None,
                 name: str | None = None) -> None:
        self.stack, self.layer, self.name = stack, layer, name
        self.shape = tuple(stack.shape[1:] if shape is None else shape)

    @property
    def dtype(self) -> Any:
        return self.stack.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, key: Any) -> Any:
        return self if key is Ellipsis else self.materialize()[key]

    def reshape(self, *shape: Any) -> LayerSlice:
        dims = list(shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)
        size = 1
        for d in self.shape:
            size *= d
        if -1 in dims:
            known = 1
            for d in dims:
                known *= d if d != -1 else 1
            dims[dims.index(-1)] = size // known
        return LayerSlice(self.stack, self.layer, dims, self.name)

    def materialize(self) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(self.stack, self.layer, keepdims=False).reshape(self.shape)


# -- where the engine's programs use it ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Rows:
    mesh: jax.sharding.Mesh
    row_axes: tuple[str, ...]
    groups: int
    packed: Mapping[str, jax.Array]


_ROWS: contextvars.ContextVar[_Rows | None] = contextvars.ContextVar("raydeploy_native_rows", default=None)


@contextlib.contextmanager
def rows_over(mesh: jax.sharding.Mesh, row_axes: Sequence[str],
              packed: Mapping[str, jax.Array] | None = None) -> Iterator[None]:
    """While tracing a program inside this block, `matmul` runs the kernel: activations' first dim split over
    `row_axes`, every weight replicated (the caller checks the mesh: each other axis of size 1). `packed`: packed
    copies of weights by name, read for a `LayerSlice` of that name: stacked layer kernels' 4-bit tiles
    (`packing.pack_q4`, [L, K/32, N/32, 768], by path in the layer module) and a tied embedding table's 8-bit rows
    (`packing.pack_q8`, [1, D/32, V/32, 1152], "embed.embedding")."""
    groups = 1
    for a in row_axes:
        groups *= int(mesh.shape[a])
    token = _ROWS.set(_Rows(mesh, tuple(row_axes), groups, dict(packed or {})))
    try:
        yield
    finally:
        _ROWS.reset(token)


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


def _packed(x: jax.Array, w: Any, rows: _Rows | None, out_first: bool = False) -> jax.Array | None:
    """The packed copy the kernel reads for x @ w (w a `LayerSlice` named in `rows.packed`: a layer kernel's
    4-bit tiles, or with out_first a table's 8-bit tiles; rows per device within [1, `packed_max_rows()`]), else
    None."""
    if rows is None or not isinstance(w, LayerSlice) or w.name is None or w.name not in rows.packed or len(w.shape) != 2:
        return None
    p = rows.packed[w.name]
    n, k = w.shape if out_first else w.shape[::-1]
    fits = (tuple(p.shape[1:3]) == (k // packing.BLOCK, n // packing.BLOCK)
            and p.shape[3] == (packing.Q8_TILE if out_first else packing.TILE))
    if (not fits or x.ndim != 2 or x.dtype != jnp.float32 or x.shape[0] % rows.groups
            or not 1 <= x.shape[0] // rows.groups <= packed_max_rows()):
        return None
    return p


def _applies(x: jax.Array, w: Any, out_first: bool, rows: _Rows | None) -> bool:
    return not (rows is None or x.ndim != 2 or len(w.shape) != 2 or x.dtype != jnp.float32
                or jnp.dtype(w.dtype).name not in weight_dtypes()
                or (not out_first and w.shape[1] % 8) or x.shape[0] % rows.groups
                or not min_rows(w.dtype) <= x.shape[0] // rows.groups <= max_rows(w.dtype))


def _stacked(w: Any) -> tuple[jax.Array, jax.Array]:
    """A weight as the kernel takes it: the stack [L, ...] and the layer index."""
    if isinstance(w, LayerSlice):
        return w.stack.reshape(w.stack.shape[0], *w.shape), jnp.asarray(w.layer, jnp.int32)
    return w.reshape(1, *w.shape), jnp.zeros((), jnp.int32)


def _per_group(rows: _Rows, fn: Any, x: jax.Array, *operands: jax.Array, outs: int | None = None) -> Any:
    """fn(x, *operands) on each dp group's rows of x (operands replicated), or directly on a one-device mesh."""
    if rows.mesh.size == 1:
        return fn(x, *operands)
    spec = PartitionSpec(rows.row_axes if len(rows.row_axes) > 1 else rows.row_axes[0])
    return jax.shard_map(fn, mesh=rows.mesh, in_specs=(spec, *(PartitionSpec() for _ in operands)),
                         out_specs=spec if outs is None else [spec] * outs,
                         axis_names=frozenset(rows.mesh.axis_names), check_vma=False)(x, *operands)


def matmul(x: jax.Array, w: Any, out_first: bool = False) -> jax.Array | None:
    """x [M, K] @ w through the kernel, w [K, N] or with out_first [N, K] (a tied embedding table as the LM
    head), an array or a `LayerSlice`, float32 or (AVX-512 build) bfloat16; None when this trace is not inside
    `rows_over` or the kernel does not apply (dtype, shape, rows per device outside [`min_rows`,
    `max_rows`]): the caller then multiplies in XLA."""
    rows = _ROWS.get()
    if (p := _packed(x, w, rows, out_first)) is not None:
        layer = jnp.asarray(w.layer, jnp.int32)
        if out_first:
            return _per_group(rows, _call_q8, x, p, layer)  # type: ignore[arg-type,no-any-return]
        return _per_group(rows, _call_q4, x, layer, p, outs=1)[0]  # type: ignore[arg-type,no-any-return]
    if rows is None or not _applies(x, w, out_first, rows):
        return None
    stack, layer = _stacked(w)
    return _per_group(rows, _call_out_first if out_first else _call, x, stack, layer)


def matmuls(x: jax.Array, ws: Sequence[Any]) -> list[jax.Array] | None:
    """[x @ w for w in ws] in one kernel call (in_out weights [K, N_i] of one dtype, arrays or `LayerSlice`s of one
    layer): a layer's q, k, v or gate and up projections, whose separate calls would each split over the threads
    and start a weight stream of their own. None where `matmul` would be None for any of them."""
    rows = _ROWS.get()
    packed = [_packed(x, w, rows) for w in ws]
    if ws and len(ws) <= 8 and all(p is not None for p in packed) and len({id(w.layer) for w in ws}) == 1:
        return list(_per_group(rows, _call_q4, x, jnp.asarray(ws[0].layer, jnp.int32), *packed,  # type: ignore[arg-type]
                               outs=len(ws)))
    if (rows is None or not ws or len(ws) > 8 or len({jnp.dtype(w.dtype) for w in ws}) != 1
            or not all(_applies(x, w, False, rows) for w in ws)):
        return None
    layers = [w.layer for w in ws if isinstance(w, LayerSlice)]
    if layers and (len(layers) != len(ws) or any(lay is not layers[0] for lay in layers)):
        return None  # one layer index for every weight
    stacks = [_stacked(w) for w in ws]
    layer = stacks[0][1]
    return list(_per_group(rows, _call_multi, x, layer, *(st for st, _ in stacks), outs=len(ws)))


def active() -> bool:
    """Whether the program being traced runs inside `rows_over`."""
    return _ROWS.get() is not None


KV_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # pools the kernel reads


def decode_attention(q_rows: jax.Array, kv_pages: jax.Array, lens: jax.Array, page_indices: jax.Array, *,
                     sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None
                     ) -> jax.Array | None:
    """Each row's one query token against its keys in the page pool -> [S, Hq, D] float32, through the kernel
    (`decode_attention.cc`): q_rows [S, Hq, D], kv_pages [P, page_size, 2*Hkv, D] (K head h at 2h, V at 2h+1),
    lens i32[S] (the row attends to positions [0, lens), or the last `sliding_window` of them; 0 = zeros),
    page_indices i32[S, pages]. Called per shard (the attention backends run inside the engine's shard_map).
    None unless this trace is inside `rows_over`, q is float32 and the pool float32, bfloat16 or float16
    (`engine.kv_dtype`; widened to float32 as it is read): the caller then computes it in XLA."""
    if (not active() or q_rows.dtype != jnp.float32 or kv_pages.dtype not in KV_DTYPES
            or unavailable() is not None):
        return None
    out = jax.ShapeDtypeStruct(q_rows.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET_ATTENTION, out)(
        q_rows, kv_pages, lens.astype(jnp.int32), page_indices.astype(jnp.int32), sm_scale=np.float32(sm_scale),
        soft_cap=np.float32(soft_cap or 0.0), sliding_window=np.int64(sliding_window or 0))
