"""Decode attention on XLA CPU: the paged XLA backend against the contiguous slot-window formulation it replaces.

Both run the attention of every layer of a model step in one jitted program (a loop over layers, each layer's
cache sliced from the stacked one, the queries carried so the loop cannot be hoisted), on the demo model's
attention shapes (9 query heads, 3 kv heads, head_dim 64, 30 layers, float32) unless told otherwise:

- `contiguous`: the previous engine's decode attention: a [rows, kv, window, head_dim] window sliced from a
  per-slot cache and the broadcast-multiply-reduce of `_attend_one` (copied here so the comparison stays).
- `paged`: `raydeploy.engine.attention.xla.ragged_paged_attention` over a shuffled page pool, page tables cut
  to the window's page count (as the engine's page-count buckets do); the stacked pool of all layers is passed
  whole with page ids offset by layer (`--sliced` also times slicing each layer's pool out, which XLA copies).
- `paged-mixed` (with --chunk): one prefill chunk of that many tokens in the same step as rows-1 decode rows.
- `native`: the native decode-row kernel (`raydeploy.engine.matmul.cpu_native.decode_attention`, what the
  engine's CPU decode passes run in place of `paged`) over the same pool and tables, where it can be built.
- with `--kv-dtypes float32,bfloat16,float16`: `native`, `paged` and `paged-mixed` again over the pool stored in
  each 16-bit dtype (`engine.kv_dtype`): half the bytes to read, widened to float32 as they are read.

    .venv/bin/python benchmarks/attention_cpu.py
    .venv/bin/python benchmarks/attention_cpu.py --rows 1,8,32 --contexts 256,1024 --chunk 256
    .venv/bin/python benchmarks/attention_cpu.py --rows 4 --contexts 384,768 --kv-dtypes float32,bfloat16,float16

Prints the CPU's vector flags and writes benchmarks/results/attention_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

from machine import cpu_flags  # benchmarks/machine.py (scripts run with benchmarks/ on sys.path)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "attention_cpu.json"


def contiguous_attend_one(q_bnh, k_bksh, v_bksh, mask_bs, k_new_bkh, v_new_bkh):  # type: ignore[no-untyped-def]
    """The previous engine's decode attention (model/llama.py `_attend_one`), verbatim."""
    import jax
    import jax.numpy as jnp

    b, n, h = q_bnh.shape
    kv = k_bksh.shape[1]
    q = q_bnh.reshape(b, kv, n // kv, 1, h).astype(jnp.float32)
    scores = jnp.sum(q * k_bksh[:, :, None].astype(jnp.float32), axis=-1) / math.sqrt(h)
    scores = jnp.where(mask_bs[:, None, None], scores, jnp.finfo(jnp.float32).min)
    own = jnp.sum(q[..., 0, :] * k_new_bkh[:, :, None].astype(jnp.float32), axis=-1)[..., None] / math.sqrt(h)
    probs = jax.nn.softmax(jnp.concatenate([scores, own], axis=-1), axis=-1)
    out = jnp.sum(probs[..., :-1, None] * v_bksh[:, :, None].astype(jnp.float32), axis=3)
    out = out + probs[..., -1:] * v_new_bkh[:, :, None].astype(jnp.float32)
    return out.reshape(b, n, h).astype(q_bnh.dtype)


def timed(calls: dict, iters: int) -> dict:  # type: ignore[type-arg]
    """Median milliseconds of one call of each entry {name: (fn, args)}, after a compile-and-warm call; the
    entries take turns, so a busy moment of the machine hits them alike."""
    import jax

    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))
    times: dict = {name: [] for name in calls}
    for _ in range(iters):
        for name, (fn, args) in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: round(statistics.median(ts), 3) for name, ts in times.items()}


def native_program(pool, scale: float, layers: int, args: tuple):  # type: ignore[no-untyped-def]
    """The decode rows' native kernel (`raydeploy.engine.matmul.cpu_native.decode_attention`, what the engine's CPU
    decode passes run) over the same stacked pool, compiled as the engine compiles it; None where it cannot be
    built."""
    import jax

    from raydeploy.engine.matmul.cpu_native import decode_attention
    from raydeploy.model import native

    if native.unavailable() is not None:
        return None

    def decode(q, pool, lens, table):  # type: ignore[no-untyped-def]
        flat = pool.reshape(-1, *pool.shape[2:])

        def layer(i, q):  # type: ignore[no-untyped-def]
            out = decode_attention(q, flat, lens, table + i * pool.shape[1], sm_scale=scale)
            return q + 1e-3 * out
        return jax.lax.fori_loop(0, layers, layer, q)

    return jax.jit(decode).lower(*args).compile()


def run_case(rows: int, context: int, chunk: int, a: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from raydeploy.engine.attention import xla

    rng = np.random.default_rng(0)
    hq, hkv, d, layers, ps = a.q_heads, a.kv_heads, a.head_dim, a.layers, a.page_size
    window = max(256, -(-context // 256) * 256)          # the previous engine's windows: multiples of 256
    scale = 1.0 / math.sqrt(d)
    res: dict = {"rows": rows, "context": context, "window": window}

    # -- contiguous slot window: caches [L, rows, K, S, H]
    k_cache = jnp.asarray(rng.standard_normal((layers, rows, hkv, window, d)), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal((layers, rows, hkv, window, d)), jnp.float32)
    q0 = jnp.asarray(rng.standard_normal((rows, hq, d)), jnp.float32)
    new_kv = jnp.asarray(rng.standard_normal((rows, hkv, d)), jnp.float32)
    mask = jnp.broadcast_to(jnp.arange(window)[None, :] < context - 1, (rows, window))

    @jax.jit
    def contiguous(q, kc, vc, m, kn):  # type: ignore[no-untyped-def]
        def layer(i, q):  # type: ignore[no-untyped-def]
            kw = jax.lax.dynamic_index_in_dim(kc, i, keepdims=False)
            vw = jax.lax.dynamic_index_in_dim(vc, i, keepdims=False)
            return q + 1e-3 * contiguous_attend_one(q, kw, vw, m, kn, kn)
        return jax.lax.fori_loop(0, layers, layer, q)

    calls = {"contiguous_ms": (contiguous, (q0, k_cache, v_cache, mask, new_kv))}

    # -- paged pool [L, P, ps, 2K, H], tables cut to the window's pages, pages shuffled
    pps = window // ps
    chunk_rows = 1 if chunk else 0
    num_pages = rows * pps + 16
    pool = jnp.asarray(rng.standard_normal((layers, num_pages, ps, 2 * hkv, d)), jnp.float32)
    table = jnp.asarray(rng.permutation(num_pages)[: rows * pps].reshape(rows, pps), jnp.int32)

    def paged_program(tokens: int, slice_layer: bool = False):  # type: ignore[no-untyped-def]
        # The stacked pool is passed whole as [L*P, ...] with page ids offset by layer; `slice_layer` instead
        # slices the layer's pool out in the loop, which XLA materialises (a copy of the layer's pool per layer).
        @jax.jit
        def paged(q, pool, lens, table, cu, n):  # type: ignore[no-untyped-def]
            flat = pool.reshape(-1, *pool.shape[2:])

            def layer(i, q):  # type: ignore[no-untyped-def]
                if slice_layer:
                    kv, ids = jax.lax.dynamic_index_in_dim(pool, i, keepdims=False), table
                else:
                    kv, ids = flat, table + i * pool.shape[1]
                return q + 1e-3 * xla.ragged_paged_attention(q, kv, lens, ids, cu, n, sm_scale=scale)
            return jax.lax.fori_loop(0, layers, layer, q)
        return paged

    lens = jnp.full((rows,), context, jnp.int32)
    cu = jnp.arange(rows + 1, dtype=jnp.int32)
    n = jnp.asarray([rows], jnp.int32)
    calls["paged_ms"] = (paged_program(rows), (q0, pool, lens, table, cu, n))
    native_decode = native_program(pool, scale, layers, (q0, pool, lens, table))
    if native_decode is not None:
        calls["native_ms"] = (native_decode, (q0, pool, lens, table))
    if a.sliced:
        calls["paged_sliced_ms"] = (paged_program(rows, slice_layer=True), (q0, pool, lens, table, cu, n))
    if chunk:
        tokens = chunk + rows - chunk_rows
        q_mixed = jnp.asarray(rng.standard_normal((tokens, hq, d)), jnp.float32)
        q_lens = np.array([chunk] + [1] * (rows - 1), np.int32)
        cu_m = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
        res["chunk"] = chunk
        calls["paged_mixed_ms"] = (paged_program(tokens), (q_mixed, pool, lens, table, cu_m, n))
    for dtype in (x for x in a.kv_dtypes.split(",") if x != "float32"):  # the same pool in 16 bits
        half = pool.astype(dtype)
        calls[f"paged_{dtype}_ms"] = (paged_program(rows), (q0, half, lens, table, cu, n))
        native_half = native_program(half, scale, layers, (q0, half, lens, table))
        if native_half is not None:
            calls[f"native_{dtype}_ms"] = (native_half, (q0, half, lens, table))
        if chunk:
            calls[f"paged_mixed_{dtype}_ms"] = (paged_program(tokens), (q_mixed, half, lens, table, cu_m, n))
    res.update(timed(calls, a.iters))
    res["paged_vs_contiguous"] = round(res["contiguous_ms"] / res["paged_ms"], 3)
    if "native_ms" in res:
        res["native_vs_paged"] = round(res["paged_ms"] / res["native_ms"], 3)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8", help="decode rows per step, comma-separated")
    p.add_argument("--contexts", default="256,1024", help="tokens in each row's cache, comma-separated")
    p.add_argument("--chunk", type=int, default=0, help="also time a step with a prefill chunk of this many tokens")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--kv-dtypes", default="float32",
                   help="pool dtypes, comma-separated (float32, bfloat16, float16): each 16-bit one timed beside float32")
    p.add_argument("--sliced", action="store_true",
                   help="also time the paged step with each layer's pool sliced out of the stacked cache")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    flags = cpu_flags()
    print(f"CPU flags: {flags} ({os.cpu_count()} cores), jax {jax.__version__}")
    out: dict = {"cpu_flags": flags, "cores": os.cpu_count(), "jax": jax.__version__, "cases": []}
    for rows in (int(x) for x in a.rows.split(",")):
        for ctx in (int(x) for x in a.contexts.split(",")):
            r = run_case(rows, ctx, a.chunk, a)
            out["cases"].append(r)
            line = (f"rows {rows:3d} context {ctx:5d}: contiguous {r['contiguous_ms']:7.2f} ms  paged "
                    f"{r['paged_ms']:7.2f} ms  contiguous/paged x{r['paged_vs_contiguous']}")
            if "paged_sliced_ms" in r:
                line += f"  (layer pool sliced: {r['paged_sliced_ms']:7.2f} ms)"
            if "native_ms" in r:
                line += f"  native {r['native_ms']:7.2f} ms (paged/native x{r['native_vs_paged']})"
            if "paged_mixed_ms" in r:
                line += f"  mixed (+{a.chunk}-token chunk) {r['paged_mixed_ms']:7.2f} ms"
            for dtype in (x for x in a.kv_dtypes.split(",") if x != "float32"):
                line += f"\n    {dtype} pool: paged {r[f'paged_{dtype}_ms']:7.2f} ms"
                if f"native_{dtype}_ms" in r:
                    line += f"  native {r[f'native_{dtype}_ms']:7.2f} ms"
                if f"paged_mixed_{dtype}_ms" in r:
                    line += f"  mixed {r[f'paged_mixed_{dtype}_ms']:7.2f} ms"
            print(line, flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
