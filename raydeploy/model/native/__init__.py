"""Native CPU kernels the engine's programs call through `jax.ffi`: a matmul of few float32 rows (`small_matmul.cc`;
float32 weights, and bfloat16 weights in the AVX-512 build) and the paged attention of decode rows
(`decode_attention.cc`: it reads each row's keys where they lie in the pool instead of gathering copies of
them), both in one library, built for the CPU's vector unit (`isa`: AVX-512 where the CPU has AVX-512 F and BW, else AVX2). Both builds also multiply float32 weights that are
exactly 4-bit or 8-bit blocks from packed copies (`packing`).

This module builds and registers the library and says what it takes (`isa`, `min_rows`, `max_rows`,
`weight_dtypes`); the engine calls it through its matmul backend `raydeploy.engine.matmul.cpu_native`, chosen
once per engine and handed to the model's projections (and its decode-row attention to the XLA attention
backend).

Built on first use with the machine's C++ compiler (`$CXX`, else `c++`, `g++` or `clang++`) against jax's own
FFI headers, into `$RAYDEPLOY_NATIVE_CACHE` (default `~/.cache/raydeploy/native`) under a key of the source,
the jax version and the flags, and registered with XLA once per process. Where it cannot be built (no compiler,
a CPU without AVX2 and FMA, not x86-64), `unavailable()` says why, one warning of the `raydeploy.native` logger
says it once per process, and the engine keeps XLA's dot (`raydeploy.engine.matmul`). The sources (`SOURCES`,
`HEADERS`) are package data: the wheel carries them (`tests/test_wheel.py`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from raydeploy.model.native import packing  # noqa: F401  (the packed weights' layouts, `native.packing`)

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
