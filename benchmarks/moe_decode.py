"""MoE decode step against a dense model of the same active parameter count, on this machine, in one run.

Both models are random-weight, built from the same shapes: the MoE (Qwen3-MoE layout: q/k head norms, a router,
`--experts` experts of `--expert-ffn` hidden units, `--top-k` per token) and a dense Qwen3 whose MLP has
top_k x expert_ffn hidden units, so each token reads the same number of parameters in both. A decode step is
the engine's path: `ragged` over `--batch` sequences of `--context` cached tokens, one new token each,
attention by the xla backend over a paged pool, logits at every token, greedy argmax; jitted, median of
`--iters` after a warm-up.

At batch 8 it also reports the bytes of expert weights a step reads per token: the distinct experts the batch
routes to in each layer (what the sorted grouped matmul reads: each routed expert once) and what the CPU form
reads (`tiled_grouped_matmul`: each routed expert once per tile of its rows), against the bytes of all experts.

    .venv/bin/python benchmarks/moe_decode.py
    .venv/bin/python benchmarks/moe_decode.py --batches 1,8 --experts 32 --top-k 4

Writes benchmarks/results/moe_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "moe_decode.json"


def hf_dicts(a: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    common = dict(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                  num_key_value_heads=a.kv_heads, head_dim=a.head_dim, max_position_embeddings=4096,
                  tie_word_embeddings=False, rms_norm_eps=1e-6)
    moe = dict(common, model_type="qwen3_moe", intermediate_size=a.expert_ffn * a.top_k,
               moe_intermediate_size=a.expert_ffn, num_experts=a.experts, num_experts_per_tok=a.top_k,
               norm_topk_prob=True)
    dense = dict(common, model_type="qwen3", intermediate_size=a.expert_ffn * a.top_k)
    return moe, dense


def random_state(fam: Any, cfg: Any, seed: int) -> tuple[Any, Any]:
    import flax.nnx as nnx

    model = fam.module(cfg, rngs=nnx.Rngs(seed))
    return nnx.split(model)


def decode_step(graphdef: Any, cfg: Any, batch: int, context: int, page_size: int) -> tuple[Any, Any]:
    """(jitted step(state, pool, tokens) -> next tokens, pool): one token per sequence after `context` cached."""
    import flax.nnx as nnx
    import jax
    import jax.numpy as jnp

    from raydeploy.engine.attention import get_backend

    attn = get_backend("xla", "cpu")
    pages_per_seq = -(-(context + 1) // page_size)
    pages = batch * pages_per_seq
    table = jnp.arange(pages, dtype=jnp.int32).reshape(batch, pages_per_seq)
    kv_lens = jnp.full((batch,), context + 1, jnp.int32)
    cu = jnp.arange(batch + 1, dtype=jnp.int32)
    positions = jnp.full((batch,), context, jnp.int32)
    write_page = table[:, context // page_size]
    scale = cfg.head_dim ** -0.5

    @jax.jit
    def step(state: Any, pool: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        model = nnx.merge(graphdef, state)

        def attend(layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, c: Any) -> tuple[jax.Array, Any]:
            kv = jnp.stack([k, v], axis=2).reshape(batch, 2 * k.shape[1], k.shape[2])
            flat = pool.reshape(-1, *pool.shape[2:])  # stacked pool, page ids offset by the layer
            flat = flat.at[layer * pages + write_page, context % page_size].set(kv)
            out = attn(q, flat, kv_lens, table + layer * pages, cu, jnp.asarray([batch], jnp.int32), sm_scale=scale)
            return out, c

        h, ks, vs, _ = model.ragged(tokens, positions, attend)
        new = jax.vmap(lambda k, v: jnp.stack([k, v], axis=2).reshape(batch, 2 * k.shape[1], k.shape[2]))(ks, vs)
        pool = pool.at[:, write_page, context % page_size].set(new)
        return jnp.argmax(model.logits(h), axis=-1).astype(jnp.int32), pool

    pool = jax.random.normal(jax.random.key(1), (cfg.num_layers, pages, page_size, 2 * cfg.num_kv_heads,
                                                 cfg.head_dim), jnp.float32) * 0.1
    return step, pool


def time_step(step: Any, state: Any, pool: Any, batch: int, iters: int) -> float:
    import jax.numpy as jnp

    tokens = jnp.arange(batch, dtype=jnp.int32) * 7 + 3
    for _ in range(2):
        out, _ = step(state, pool, tokens)
        out.block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out, _ = step(state, pool, tokens)
        out.block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def routed_experts(graphdef: Any, state: Any, cfg: Any, batch: int, context: int, page_size: int
                   ) -> list[list[int]]:
    """Rows each routed expert gets, per layer (recorded from the router inside one decode step)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from raydeploy.model import moe

    seen: list[list[int]] = []
    original = moe.expert_ffn

    def record(ids: np.ndarray) -> None:
        seen.append(np.unique(ids, return_counts=True)[1].tolist())

    def wrapped(x, expert_ids, *args, **kw):  # type: ignore[no-untyped-def]
        jax.debug.callback(record, expert_ids)
        return original(x, expert_ids, *args, **kw)

    moe.expert_ffn = wrapped
    try:
        step, pool = decode_step(graphdef, cfg, batch, context, page_size)
        out, _ = step(state, pool, jnp.arange(batch, dtype=jnp.int32) * 7 + 3)
        out.block_until_ready()
        jax.effects_barrier()
    finally:
        moe.expert_ffn = original
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-ffn", type=int, default=512)
    a = p.parse_args()

    from raydeploy.model.registry import from_hf_config

    moe_raw, dense_raw = hf_dicts(a)
    moe_fam, moe_cfg = from_hf_config(moe_raw)
    dense_fam, dense_cfg = from_hf_config(dense_raw)
    models = {"moe": (moe_fam, moe_cfg, *random_state(moe_fam, moe_cfg, 0)),
              "dense": (dense_fam, dense_cfg, *random_state(dense_fam, dense_cfg, 0))}
    result: dict[str, Any] = {
        "load_average_at_start": os.getloadavg(),  # 1, 5, 15 min: a shared machine's timings need this
        "shapes": vars(a),
        "params": {k: {"total": f.param_count(c), "active_per_token": f.active_param_count(c)}
                   for k, (f, c, _, _) in models.items()},
        "decode": {},
    }
    print(json.dumps(result["params"]))
    for b in (int(x) for x in a.batches.split(",")):
        row: dict[str, Any] = {}
        for name, (_, cfg, graphdef, state) in models.items():
            step, pool = decode_step(graphdef, cfg, b, a.context, a.page_size)
            dt = time_step(step, state, pool, b, a.iters)
            row[name] = {"step_ms": round(dt * 1e3, 2), "tok_s": round(b / dt, 1)}
        row["moe_vs_dense"] = round(row["moe"]["tok_s"] / row["dense"]["tok_s"], 3)
        result["decode"][str(b)] = row
        print(f"batch {b}: {json.dumps(row)}")
    if 8 in (int(x) for x in a.batches.split(",")):
        _, cfg, graphdef, state = models["moe"]
        from raydeploy.model.moe import tile_rows

        rows = routed_experts(graphdef, state, cfg, 8, a.context, a.page_size)
        t = tile_rows(8 * cfg.num_experts_per_tok, cfg.num_experts)
        expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4  # float32 gate, up, down
        result["expert_bytes_per_token_batch8"] = {
            "distinct_experts_per_layer": [len(r) for r in rows],
            "grouped_matmul_reads": int(sum(len(r) for r in rows) * expert_bytes / 8),
            "cpu_tiled_reads": int(sum(-(-c // t) for r in rows for c in r) * expert_bytes / 8),
            "cpu_tile_rows": t,
            "all_experts": int(cfg.num_layers * cfg.num_experts * expert_bytes / 8),
        }
        print(json.dumps(result["expert_bytes_per_token_batch8"]))
    result["load_average_at_end"] = os.getloadavg()
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
