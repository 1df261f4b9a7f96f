"""The demo model's decode matmuls at few rows in XLA, in the engine's native CPU kernel and in numpy's BLAS, at 1
and 2 CPU threads.

A decode pass multiplies a few rows by every weight of the model: the 30 layers' seven projections
([576, 576], [576, 192] x 2, [576, 576], [576, 1536] x 2, [1536, 576]) and the LM head ([576, 49152]), float32,
random weights. Reported per backend, rows and threads: the best of 5 of all 211 matmuls one after another (ms)
and GFLOP/s. The simulated gang of the embedded default runs each host on one thread, so the 1-thread column is
the one that decides its decode passes.

- xla: one jitted program of the 211 dots, `PJRT_NPROC` threads (what `engine.cpu_matmul: xla` runs);
- native: one jitted program of the 211 calls of `raydeploy.model.native` (what the engine's step programs
  run on CPU for 2-32 rows per device), the same threads;
- blas: numpy's `@` (OpenBLAS), `OPENBLAS_NUM_THREADS` threads, the peer outside XLA.

`--backends native,chain,joined` adds how the engine's step programs meet the kernel: chain, the same 211 calls
with each one's rows depending on the last one's result (a decode pass is such a chain; without the
dependency XLA may run independent calls side by side); joined, that chain with each layer's q/k/v and
gate/up as one call (`CpuNative.matmuls`, what the engine does: 121 calls).

With `--weights bfloat16` the weights are bfloat16 and the rows float32, as the engine holds them with
`model.param_dtype: bfloat16`: xla multiplies as the model's XLA path does (rows cast to bfloat16, float32
accumulation), native runs the kernel's bfloat16 handler (AVX-512 build only), blas multiplies the same weights
widened to float32 (twice the bytes). The report gives each case's weight GB/s too.

With `--weights packed` the float32 weights are exactly 4-bit blocks (the layers, as a GGUF Q4_1 checkpoint's
dequantization makes them) and 8-bit blocks (the head, Q8_0), as the demo model's are: xla and blas multiply the
float32 values, native (each call chained on the last) and joined read the packed copies the engine holds (`engine.pack_weights: auto`;
`raydeploy.model.native.packing`; both builds), the head as the tied table's 8-bit rows.

    .venv/bin/python benchmarks/small_matmul.py [--rows 1,2,4,8,16,32,64] [--weights float32|bfloat16|packed]
        [--backends xla,native,blas] [--out benchmarks/results/small_matmul.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_flags  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "small_matmul.json"
SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)] * 30 + [(576, 49152)]

def _inputs(rows: int, weights: str = "float32"):
    import numpy as np

    rng = np.random.default_rng(0)
    ws = [rng.standard_normal(s, dtype=np.float32) for s in SHAPES]
    if weights == "packed":  # d * q + m down each column's blocks of 32 (the layers), d * q along the head's rows
        def blocks(k: int, n: int, q_range: tuple[int, int], offset: bool) -> np.ndarray:
            d = rng.uniform(1e-3, 3e-2, (k // 32, 1, n)).astype(np.float16).astype(np.float32)
            m = (-8 * d).astype(np.float16).astype(np.float32) if offset else np.zeros_like(d)
            q = rng.integers(*q_range, (k // 32, 32, n))
            q[:, 0], q[:, 1] = q_range[0], q_range[1] - 1
            return (q.astype(np.float32) * d + m).reshape(k, n)

        ws = [blocks(k, n, (0, 16), True) for k, n in SHAPES[:-1]]
        ws.append(blocks(*SHAPES[-1], (-127, 128), False))  # [K, N]: blocks down K, along the table's rows
    if weights == "bfloat16":  # the bfloat16 values, held as float32 here
        import ml_dtypes

        ws = [w.astype(ml_dtypes.bfloat16).astype(np.float32) for w in ws]
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


@functools.cache
def _chain_fn(joined: bool, packed: bool = False):
    import jax
    import jax.numpy as jnp

    from raydeploy.engine.matmul import cpu_native
    from raydeploy.engine.matmul.cpu_native import CpuNative
    from raydeploy.model.projection import LayerSlice

    def layer_groups(n: int) -> list[list[int]]:  # per layer: [q, k, v], [o], [gate, up], [down]; then the head
        groups = []
        for layer in range(0, n - 1, 7):
            groups += [[layer, layer + 1, layer + 2], [layer + 3], [layer + 4, layer + 5], [layer + 6]]
        return groups + [[n - 1]]

    def run(xs, ws, copies=None):
        mesh = jax.make_mesh((1,), ("dp",))
        out, carry = [], jnp.zeros((), jnp.float32)
        layer = jnp.zeros((), jnp.int32)
        mm = CpuNative(mesh, ("dp",), copies if packed else None)
        groups = layer_groups(len(ws)) if joined else [[i] for i in range(len(ws))]
        for g in groups:
            x = xs[g[0]] + carry  # each call waits for the one before it
            if packed:  # layer slices named as their packed copies; the head as the tied table (out_first)
                head = g == [len(ws) - 1]
                named = [LayerSlice(ws[i], layer, name=str(i)) for i in g]
                ys = [mm.kernel(x, named[0], True)] if head else mm.matmuls(x, named)
                assert ys is not None and all(y is not None for y in ys), f"rows {x.shape[0]}: no packed call"
            else:
                ys = mm.matmuls(x, [ws[i][0] for i in g]) if len(g) > 1 else None
            if ys is None:  # one weight, or rows the joined call does not take
                ys = [cpu_native._call(x, ws[i], jnp.int32(0)) for i in g]
            carry = 0.0 * ys[0][0, 0]
            out += ys
        return out

    return jax.jit(run)


def child(backend: str, rows: int, weights: str = "float32") -> float:
    """Seconds for the 211 matmuls at `rows` rows, in this process (threads set by the parent's environment)."""
    import numpy as np

    xs, ws = _inputs(rows, weights)
    if backend == "blas":
        return _best(lambda: [x @ w for x, w in zip(xs, ws, strict=True)])
    if backend == "xla":
        import jax
        import jax.numpy as jnp

        dws = [jnp.asarray(w, "float32" if weights == "packed" else weights) for w in ws]
        dxs = [jnp.asarray(x) for x in xs]
        f = jax.jit(lambda xs, ws: [jax.lax.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)
                                    for x, w in zip(xs, ws, strict=True)])
        return _best(lambda: jax.block_until_ready(f(dxs, dws)))
    import jax
    import jax.numpy as jnp

    from raydeploy.engine.matmul import cpu_native
    from raydeploy.model import native

    if (problem := native.unavailable()) is not None:
        raise SystemExit(problem)
    if weights == "packed":
        from raydeploy.model.native import packing

        if (problem := native.packs_weights()) is not None:
            raise SystemExit(problem)
        if backend not in ("native", "joined"):
            raise SystemExit("packed weights: backends xla, blas, native, joined")
        native.PACKED_MAX_ROWS = max(native.PACKED_MAX_ROWS, rows)  # time every row count asked for
        native.PACKED_MAX_ROWS_AVX2 = max(native.PACKED_MAX_ROWS_AVX2, rows)
        copies = {str(i): jnp.asarray(packing.pack_q4(w[None])) for i, w in enumerate(ws[:-1])}
        copies[str(len(ws) - 1)] = jnp.asarray(packing.pack_q8(np.ascontiguousarray(ws[-1].T)))
        dws = [jnp.asarray(w).reshape(1, *w.shape) for w in ws[:-1]] + [jnp.asarray(ws[-1].T)[None]]
        dxs = [jnp.asarray(x) for x in xs]
        chained = _chain_fn(backend == "joined", packed=True)
        ys = chained(dxs, dws, copies)
        rounded = native.isa() == "avx512"  # x rounded to 16 bits a block (`packing.rounded_rows`)
        for i in (0, 3, 4, 6, len(ws) - 1):  # a joined call's weights share its first one's rows
            want = packing.packed_product(xs[i], ws[i], rounded, q4=i < len(ws) - 1)
            np.testing.assert_allclose(np.asarray(ys[i]), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        return _best(lambda: jax.block_until_ready(chained(dxs, dws, copies)))
    if weights not in native.weight_dtypes():
        raise SystemExit(f"the kernel's {native.isa()} build multiplies {native.weight_dtypes()} weights")
    dws = [jnp.asarray(w, weights).reshape(1, *w.shape) for w in ws]
    dxs = [jnp.asarray(x) for x in xs]
    if backend in ("chain", "joined"):
        chained = _chain_fn(backend == "joined")
        return _best(lambda: jax.block_until_ready(chained(dxs, dws)))
    f = jax.jit(lambda xs, ws: [cpu_native._call(x, w, jnp.int32(0)) for x, w in zip(xs, ws, strict=True)])
    for y, x, w in zip(f(dxs, dws)[:8], xs[:8], ws[:8], strict=True):
        np.testing.assert_allclose(np.asarray(y), x @ w, rtol=1e-3, atol=1e-3)
    return _best(lambda: jax.block_until_ready(f(dxs, dws)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--weights", default="float32", choices=["float32", "bfloat16", "packed"])
    ap.add_argument("--backends", default="xla,native,blas", help="of xla, native, blas, chain, joined")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        backend, rows = args.child
        print(json.dumps(child(backend, int(rows), args.weights)))
        return
    flops_per_row = sum(2 * k * n for k, n in SHAPES)
    weight_bytes = sum(k * n for k, n in SHAPES) * (2 if args.weights == "bfloat16" else 4)
    if args.weights == "packed":  # what the packed kernels read: 0.75 bytes a layer weight, 1.125 a head weight
        weight_bytes = sum(k * n for k, n in SHAPES[:-1]) * 3 // 4 + SHAPES[-1][0] * SHAPES[-1][1] * 9 // 8
    cases = []
    for rows in (int(r) for r in args.rows.split(",")):
        for threads in (1, 2):
            for backend in args.backends.split(","):
                env = {**os.environ, "JAX_PLATFORMS": "cpu", "PJRT_NPROC": str(threads), "OPENBLAS_NUM_THREADS": str(threads),
                       "OMP_NUM_THREADS": str(threads)}
                out = subprocess.run([sys.executable, __file__, "--child", backend, str(rows), "--weights",
                                      args.weights], env=env, capture_output=True, text=True)
                if out.returncode != 0:
                    print(f"{backend}: {(out.stdout + out.stderr).strip().splitlines()[-1]}", flush=True)
                    continue
                s = json.loads(out.stdout.strip().splitlines()[-1])
                case = {"rows": rows, "threads": threads, "backend": backend, "ms": round(s * 1e3, 1),
                        "gflops": round(flops_per_row * rows / s / 1e9, 1),
                        "weight_gb_per_s": round(weight_bytes / s / 1e9, 1)}
                print(json.dumps(case), flush=True)
                cases.append(case)
    import jax

    from raydeploy.model import native

    result = {"cpu_flags": cpu_flags(), "cores": os.cpu_count(), "jax": jax.__version__, "weights": args.weights,
              "native_build": native.isa(),
              "load_average_1m": os.getloadavg()[0], "matmuls": len(SHAPES), "cases": cases}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
