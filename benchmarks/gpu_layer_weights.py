"""How a scanned decode step reads one layer's MLP weights out of the stacked ones, on a GPU.

A decode pass runs the layers in a `lax.scan` over weights stacked [L, ...]. On an H100 (jax 0.11.2) the profile
of a batch-1 pass showed XLA copying each layer's three MLP weights out of the stack into new buffers before its
gemms (`loop_dynamic_slice_fusion`, 1.21 of 3.86 ms of device time, Llama-3.2-1B's shape): every weight is
written and read twice. This script times the MLP half of a decode pass alone (L layers of
h += down(silu(gate(h)) * up(h)), bfloat16, rows of 1 and 8) in the ways a program can read the weights:

- `scan_dot`: `lax.scan` over the layer index, each weight `dynamic_index_in_dim` then `dot_general` (what the
  engine does today; the peer);
- `unrolled_dot`: the layers unrolled, each weight a static slice `w[i]` of the stack;
- `scan_pallas`: `lax.scan`, each matmul a Pallas (Triton) kernel that takes the whole stack and the layer index
  and reads the layer's tiles in place (`raydeploy.engine.matmul.pallas_gpu`);
- with `--flags`, `scan_dot` and `unrolled_dot` again in a child process under
  `--xla_gpu_enable_dynamic_slice_fusion=true`.

Per form and rows: ms per pass (median of `--reps`), the weights' effective read rate (GB/s: bytes of all
layers' MLP weights over the time), and the largest difference from a float32 reference (the same bfloat16
weights and input, every product and sum in float32, full precision), beside the output's largest value: each
bfloat16 form rounds differently, and the random layers carry its rounding forward.

    JAX_PLATFORMS=cuda python benchmarks/gpu_layer_weights.py --flags --out gpu_layer_weights.json
    JAX_PLATFORMS=cpu python benchmarks/gpu_layer_weights.py --shape tiny --rows 1,4   # a dry run (interpret)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {"llama-1b": (16, 2048, 8192), "llama-8b": (32, 4096, 14336), "tiny": (3, 64, 256)}
FLAGS = "--xla_gpu_enable_dynamic_slice_fusion=true"


def run(shape: str, rows: list[int], forms: list[str], reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    from raydeploy.engine.matmul.pallas_gpu import stacked_matmul

    n_layers, d, f = SHAPES[shape]
    interpret = jax.default_backend() == "cpu"
    keys = jax.random.split(jax.random.key(0), 4)
    gate = (jax.random.normal(keys[0], (n_layers, d, f)) * d ** -0.5).astype(jnp.bfloat16)
    up = (jax.random.normal(keys[1], (n_layers, d, f)) * d ** -0.5).astype(jnp.bfloat16)
    down = (jax.random.normal(keys[2], (n_layers, f, d)) * f ** -0.5).astype(jnp.bfloat16)
    weight_bytes = 3 * n_layers * d * f * 2

    def mlp(h, wg, wu, wd, mm):
        return h + mm(jax.nn.silu(mm(h, wg)) * mm(h, wu), wd)

    def dot(x, w):
        return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=x.dtype)

    def scan_dot(h, g, u, dn):
        def body(h, i):
            at = lambda w: jax.lax.dynamic_index_in_dim(w, i, keepdims=False)  # noqa: E731
            return mlp(h, at(g), at(u), at(dn), dot), None
        return jax.lax.scan(body, h, jnp.arange(n_layers, dtype=jnp.int32))[0]

    def unrolled_dot(h, g, u, dn):
        for i in range(n_layers):
            h = mlp(h, g[i], u[i], dn[i], dot)
        return h

    def scan_pallas(h, g, u, dn):
        def body(h, i):
            mm = lambda x, w: stacked_matmul(x, w, i, interpret=interpret)  # noqa: E731
            return h + mm(jax.nn.silu(mm(h, g)) * mm(h, u), dn), None
        return jax.lax.scan(body, h, jnp.arange(n_layers, dtype=jnp.int32))[0]

    def reference(h, g, u, dn):
        with jax.default_matmul_precision("highest"):
            return scan_dot(h.astype(jnp.float32), g.astype(jnp.float32), u.astype(jnp.float32),
                            dn.astype(jnp.float32))

    fns = {"scan_dot": scan_dot, "unrolled_dot": unrolled_dot, "scan_pallas": scan_pallas}
    out: dict = {"shape": shape, "layers": n_layers, "hidden": d, "intermediate": f, "weight_mb": weight_bytes / 1e6,
                 "jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
                 "xla_flags": os.environ.get("XLA_FLAGS", ""), "forms": {}}
    for b in rows:
        h0 = (jax.random.normal(keys[3], (b, d)) * 0.5).astype(jnp.bfloat16)
        ref = jax.jit(reference)(h0, gate, up, down)
        for name in forms:
            fn = jax.jit(fns[name])
            t = time.perf_counter()
            y = fn(h0, gate, up, down).block_until_ready()
            compile_s = time.perf_counter() - t
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                fn(h0, gate, up, down).block_until_ready()
                times.append(time.perf_counter() - t)
            ms = 1e3 * statistics.median(times)
            diff = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref.astype(jnp.float32))))
            scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
            out["forms"].setdefault(name, {})[str(b)] = {"ms": ms, "gb_s": weight_bytes / ms / 1e6,
                                                        "compile_s": compile_s, "max_diff": diff, "ref_max": scale}
            print(f"{name:14s} rows {b:3d}: {ms:8.3f} ms  {weight_bytes / ms / 1e6:8.1f} GB/s  "
                  f"compile {compile_s:5.1f} s  max diff {diff:.3g} (of {scale:.3g})", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--forms", default="scan_dot,unrolled_dot,scan_pallas")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--flags", action="store_true", help=f"also run scan_dot and unrolled_dot under XLA_FLAGS={FLAGS}")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    result = {"default": run(args.shape, rows, args.forms.split(","), args.reps)}
    if args.flags:  # XLA reads its flags once per process: the same forms again in a child under them
        env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + FLAGS).strip()}
        with tempfile.TemporaryDirectory() as tmp:
            child_out = Path(tmp) / "flags.json"
            child = subprocess.run([sys.executable, __file__, "--shape", args.shape, "--rows", args.rows, "--forms",
                                    "scan_dot,unrolled_dot", "--reps", str(args.reps), "--out", str(child_out)],
                                   env=env, capture_output=True, text=True, timeout=600)
            print(child.stdout[-2000:], child.stderr[-2000:] if child.returncode else "", flush=True)
            result["flags"] = (json.loads(child_out.read_text())["default"] if child_out.exists()
                               else {"error": child.stderr[-2000:]})
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
