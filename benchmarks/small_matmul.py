"""Sizing a native small-row matmul: the demo model's decode matmuls at 1-8 rows in XLA, in numpy's BLAS, and in a
hand-written AVX2 kernel over weights packed once, each at 1 and 2 CPU threads.

A decode pass multiplies a few rows by every weight of the model: the 30 layers' seven projections
([576, 576], [576, 192] x 2, [576, 576], [576, 1536] x 2, [1536, 576]) and the LM head ([576, 49152]), float32,
random weights. Reported per backend, rows and threads: the best of 5 of all 211 matmuls one after another (ms)
and GFLOP/s. The simulated gang of the embedded default runs each host on one thread, so the 1-thread column is
the one that decides its decode passes.

- xla: one jitted program of the 211 dots (what the engine's projections compile to), `PJRT_NPROC` threads;
- blas: numpy's `@` (OpenBLAS), `OPENBLAS_NUM_THREADS` threads;
- kernel: the C kernel below, compiled here with `cc -O3 -mavx2 -mfma` (skipped when no compiler is found): the
  weights packed once into 24-column strips ([N/24, K, 24], read in order), 4 rows x 24 columns of accumulators
  per strip (12 of the 16 AVX2 registers), the rows in blocks of 4; one thread only (it has no threading).

    .venv/bin/python benchmarks/small_matmul.py [--rows 1,2,4,8] [--out benchmarks/results/small_matmul.json]

Nothing here is used by the engine: it measures whether a native matmul for few rows is worth building.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_flags  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "small_matmul.json"
SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)] * 30 + [(576, 49152)]
STRIP = 24

KERNEL_C = r"""
#include <immintrin.h>
#include <stddef.h>
/* y[M, N] = x[M, K] @ W with W packed as [N / 24][K][24]; rows in blocks of 4 */
static void block4(const float *x, int ldx, int rows, const float *w, int K, float *y, int ldy) {
    __m256 a[4][3];
    for (int i = 0; i < 4; i++) for (int j = 0; j < 3; j++) a[i][j] = _mm256_setzero_ps();
    const float *xr[4];
    for (int i = 0; i < 4; i++) xr[i] = x + (size_t)ldx * (i < rows ? i : 0);
    for (int k = 0; k < K; k++) {
        const float *wk = w + (size_t)k * 24;
        __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8), w2 = _mm256_loadu_ps(wk + 16);
        for (int i = 0; i < 4; i++) {
            __m256 b = _mm256_broadcast_ss(xr[i] + k);
            a[i][0] = _mm256_fmadd_ps(b, w0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(b, w1, a[i][1]);
            a[i][2] = _mm256_fmadd_ps(b, w2, a[i][2]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < 3; j++) _mm256_storeu_ps(y + (size_t)i * ldy + 8 * j, a[i][j]);
}
void small_matmul(const float *x, int M, int K, const float *w, int N, float *y) {
    for (int s = 0; s < N / 24; s++)
        for (int m = 0; m < M; m += 4)
            block4(x + (size_t)m * K, K, M - m < 4 ? M - m : 4, w + (size_t)s * K * 24, K, y + (size_t)m * N + s * 24, N);
}
"""


def _inputs(rows: int):
    import numpy as np

    rng = np.random.default_rng(0)
    ws = [rng.standard_normal(s, dtype=np.float32) for s in SHAPES]
    xs = [rng.standard_normal((rows, s[0]), dtype=np.float32) for s in SHAPES]
    return xs, ws


def _best(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def child(backend: str, rows: int, lib: str | None) -> float:
    """Seconds for the 211 matmuls at `rows` rows, in this process (threads set by the parent's environment)."""
    import numpy as np

    xs, ws = _inputs(rows)
    if backend == "blas":
        return _best(lambda: [x @ w for x, w in zip(xs, ws, strict=True)])
    if backend == "xla":
        import jax
        import jax.numpy as jnp

        dws = [jnp.asarray(w) for w in ws]
        dxs = [jnp.asarray(x) for x in xs]
        f = jax.jit(lambda xs, ws: [x @ w for x, w in zip(xs, ws, strict=True)])
        return _best(lambda: jax.block_until_ready(f(dxs, dws)))
    import ctypes

    k = ctypes.CDLL(lib)
    ptr = ctypes.POINTER(ctypes.c_float)
    packed = [np.ascontiguousarray(w.reshape(w.shape[0], -1, STRIP).transpose(1, 0, 2)) for w in ws]
    outs = [np.empty((rows, w.shape[1]), np.float32) for w in ws]
    for x, w, p, y in zip(xs[:8], ws[:8], packed[:8], outs[:8], strict=True):  # the kernel computes x @ W
        k.small_matmul(x.ctypes.data_as(ptr), rows, x.shape[1], p.ctypes.data_as(ptr), w.shape[1], y.ctypes.data_as(ptr))
        np.testing.assert_allclose(y, x @ w, rtol=1e-3, atol=1e-3)

    def run() -> None:
        for x, w, p, y in zip(xs, ws, packed, outs, strict=True):
            k.small_matmul(x.ctypes.data_as(ptr), rows, x.shape[1], p.ctypes.data_as(ptr), w.shape[1],
                           y.ctypes.data_as(ptr))
    return _best(run)


def _compile_kernel(tmp: Path) -> str | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    src, lib = tmp / "small_matmul.c", tmp / "libsmall_matmul.so"
    src.write_text(KERNEL_C)
    subprocess.run([cc, "-O3", "-mavx2", "-mfma", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    return str(lib)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        backend, rows, lib = args.child
        print(json.dumps(child(backend, int(rows), None if lib == "-" else lib)))
        return
    flops_per_row = sum(2 * k * n for k, n in SHAPES)
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        lib = _compile_kernel(Path(tmp))
        for rows in (int(r) for r in args.rows.split(",")):
            for threads in (1, 2):
                for backend in ("xla", "blas", "kernel"):
                    if backend == "kernel" and (lib is None or threads != 1):
                        continue
                    env = {**os.environ, "PJRT_NPROC": str(threads), "OPENBLAS_NUM_THREADS": str(threads),
                           "OMP_NUM_THREADS": str(threads)}
                    out = subprocess.run([sys.executable, __file__, "--child", backend, str(rows), lib or "-"],
                                         env=env, capture_output=True, text=True, check=True)
                    s = json.loads(out.stdout.strip().splitlines()[-1])
                    case = {"rows": rows, "threads": threads, "backend": backend, "ms": round(s * 1e3, 1),
                            "gflops": round(flops_per_row * rows / s / 1e9, 1)}
                    print(json.dumps(case), flush=True)
                    cases.append(case)
    import jax

    result = {"cpu_flags": cpu_flags(), "cores": os.cpu_count(), "jax": jax.__version__,
              "load_average_1m": os.getloadavg()[0], "matmuls": len(SHAPES), "cases": cases}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
