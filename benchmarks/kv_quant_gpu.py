"""The GPU decode attention over an int8 / float8 KV cache against a bfloat16 one, on one GPU, same run.

The engine's single-token path on GPU (`raydeploy.engine.attention.pallas_gpu.single_token_attention`: jax's
Pallas paged attention, compiled by Triton, with per-token scales for a quantized pool) at a Llama-3-8B layer's
shape on one GPU (32 q heads, 8 kv heads, head_dim 128, pages of 16 tokens, bfloat16 queries), `--rows` decode
rows of `--context` cached tokens each:
- correctness first, on a small step: the compiled kernel over a bfloat16, int8 and float8_e4m3fn pool against the
  XLA path over the same pool (the largest absolute difference);
- then the median time of one layer's call over each pool, and the cache bytes that call must read (values and
  scales of every row's pages), as GB/s beside the device's published HBM bandwidth. The XLA path (what a step
  with prompt tokens runs) is timed beside it over the bfloat16 and int8 pools.

    JAX_PLATFORMS=cuda python benchmarks/kv_quant_gpu.py     # writes benchmarks/results/kv_quant_gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results" / "kv_quant_gpu.json"
HBM_BYTES_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


def _step(rows: int, context: int, q_heads: int, kv_heads: int, head_dim: int, page_size: int, seed: int):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    pps = -(-context // page_size)
    num_pages = rows * pps
    q = jnp.asarray(rng.standard_normal((rows, q_heads, head_dim)), jnp.bfloat16)
    pool = jnp.asarray(rng.standard_normal((num_pages, page_size, 2 * kv_heads, head_dim)), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(num_pages).reshape(rows, pps), jnp.int32)
    lens = jnp.asarray(context - rng.integers(0, page_size, rows), jnp.int32)
    cu = jnp.arange(rows + 1, dtype=jnp.int32)
    return q, pool, lens, table, cu, jnp.asarray([rows], jnp.int32)


def _pools(pool):
    from raydeploy.engine.attention import kv_quant

    out = {"bfloat16": pool}
    for dt in ("int8", "float8_e4m3fn"):
        out[dt] = kv_quant.QuantizedPool(*kv_quant.quantize(pool, dt))
    return out


def _time(fn, args, reps: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    import jax
    import numpy as np

    from raydeploy.engine.attention import pallas_gpu, xla

    dev = jax.devices()[0]
    sm = 128 ** -0.5
    kernel = jax.jit(lambda *a: pallas_gpu.single_token_attention(*a, sm_scale=sm))
    plain = jax.jit(lambda *a: xla.ragged_paged_attention(*a, sm_scale=sm))
    small = _step(8, 300, 32, 8, 128, 16, seed=1)
    correct = {}
    for name, pool in _pools(small[1]).items():
        a = (small[0], pool, *small[2:])
        got = np.asarray(kernel(*a), np.float32)
        ref = np.asarray(plain(*a), np.float32)
        correct[name] = float(np.abs(got - ref).max())
    big = _step(args.rows, args.context, 32, 8, 128, 16, seed=2)
    timing = {}
    for name, pool in _pools(big[1]).items():
        a = (big[0], pool, *big[2:])
        nbytes = int(getattr(pool, "nbytes", 0))
        t = _time(kernel, a, args.reps)
        row = {"kernel_ms": round(t * 1e3, 3), "cache_bytes": nbytes, "kernel_gb_s": round(nbytes / t / 1e9, 1)}
        if name != "float8_e4m3fn":
            row["xla_ms"] = round(_time(plain, a, max(3, args.reps // 4)) * 1e3, 3)
        timing[name] = row
    hbm = next((v for k, v in HBM_BYTES_S.items() if k in dev.device_kind), None)
    result = {"device": dev.device_kind, "jax": jax.__version__, "rows": args.rows, "context": args.context,
              "shape": "32 q heads, 8 kv heads, head_dim 128, page 16, bfloat16 q", "hbm_gb_s": hbm and hbm / 1e9,
              "max_abs_kernel_vs_xla": correct, "timing": timing,
              "int8_over_bf16_kernel_time": round(timing["int8"]["kernel_ms"] / timing["bfloat16"]["kernel_ms"], 3)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
