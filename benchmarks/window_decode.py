"""Decode speed of a model with sliding-window layers (a Gemma 3 shape) on a long-context pool: our engine
against transformers `generate`, the same model, the same run.

No weights can be downloaded, so the model is a small Gemma 3 text decoder (12 layers, 10 of them local with a
512-token window, every 6th global; 4096-token vocabulary) with seeded random weights, made by transformers
(`AutoModelForCausalLM.from_config`, float32), saved, converted by our converter and read by the checkpoint
reader. Our engine holds 8 slots of `--max-seq-len` tokens (default 8192), the serving case where the KV pool
is large beside the weights, once per `engine.window_pages` mode given: `ring` (local layers keep rings of
their window's pages) and `all` (every layer keeps every page). Per backend: tokens/s over the decode of 8
greedy rows (`--new-tokens` each, eos ignored) and time per decode pass. transformers runs the same prompts
in one batch with its dynamic cache, 2 threads, float32.

What it watches: the step programs must not copy the KV pool. Before the engine moved Gemma 3's local/global
choice off the K/V write, XLA copied the carried pool in every scanned step: on a 2-core Xeon a pass of 8 rows
took 293 ms (`ring`, 198 MB of pool) and 1596 ms (`all`, 805 MB) against 7-9 ms after. And before the XLA
attention path gathered its blocks from the pool as it lies, its prompt steps copied the pool per query
block and layer (this model has one kv head): 8 prompts took ~7.4 s to prefill with `all` (docs/performance.md).
`run_tok_s` (all tokens over the whole run, prefill included) shows that one.

    .venv/bin/python benchmarks/window_decode.py                 # writes benchmarks/results/window_decode.json
    .venv/bin/python benchmarks/window_decode.py --window-pages ring --new-tokens 32
    .venv/bin/python benchmarks/window_decode.py --layer-kinds traced,static   # also as a GPU scans the layers
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG = dict(model_type="gemma3_text", vocab_size=4096, hidden_size=512, intermediate_size=1024,
              num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
              max_position_embeddings=8192, sliding_window=512, query_pre_attn_scalar=128,
              tie_word_embeddings=True)
BATCH = 8


def _prompts() -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(1, CONFIG["vocab_size"], int(rng.integers(32, 65))).tolist() for _ in range(BATCH)]


def bench_hf(model, prompts: list[list[int]], new_tokens: int) -> dict:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def gen(n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        return time.perf_counter() - t

    gen(4)  # warm up
    first = gen(1)
    total = gen(new_tokens)
    return {"backend": "transformers generate (float32, 2 threads, dynamic cache)",
            "decode_tok_s": BATCH * (new_tokens - 1) / (total - first), "run_tok_s": BATCH * new_tokens / total}


def bench_ours(ckpt: Path, window_pages: str, max_seq_len: int, prompts: list[list[int]], new_tokens: int,
               static_kinds: bool = False) -> dict:
    import jax

    from raydeploy.checkpoint.reader import CheckpointReader
    from raydeploy.config import EngineConfig, ModelConfig
    from raydeploy.engine.attention import Attention, xla
    from raydeploy.engine.engine import Engine
    from raydeploy.engine.step import SamplingParams, StepPlan
    from raydeploy.model.registry import from_hf_config
    from raydeploy.model.sharding import build_mesh, merge_rules

    mesh = build_mesh({"dp": 1}, jax.devices()[:1])
    rules = merge_rules(None)
    reader = CheckpointReader(ckpt)
    family, cfg = from_hf_config(reader.hf_config)
    params, _ = reader.load(reader.param_specs(), mesh, {**family.rules, **rules}, "float32", 2, progress=False)
    engine_cfg = EngineConfig(max_slots=BATCH, page_size=16, prefill_chunk=256, decode_steps=4,
                              compilation_cache_dir=None, window_pages=window_pages)
    # static: the layers scanned in blocks of their local/global pattern, as on a GPU (`Attention.static_layer_kinds`)
    backends = Attention(xla.ragged_paged_attention, static_layer_kinds=True) if static_kinds else None
    engine = Engine(family, cfg, params, mesh, rules, ModelConfig(max_seq_len=max_seq_len), engine_cfg, backends)
    t0 = time.perf_counter()
    engine.warmup()
    warmup_s = time.perf_counter() - t0
    pool_mb = sum(x.nbytes for x in jax.tree.leaves(engine.pool)) / 1e6
    from raydeploy.testing.plans import prefill_and_decode

    items = [(i, p, SamplingParams()) for i, p in enumerate(prompts)]

    def plan(n: int, passes: int) -> float:  # the prompts' first tokens, then `passes` decode passes in one plan
        t = time.perf_counter()
        prefill_and_decode(engine, items, passes, 100 * n)
        wall = time.perf_counter() - t
        engine.step(StepPlan(n + 1, release=tuple(range(BATCH))))
        return wall

    plan(0, new_tokens - 1)  # untimed: first calls
    first = plan(2, 1)
    total = plan(4, new_tokens - 1)
    kinds = "static" if static_kinds else "traced"
    return {"backend": f"raydeploy engine (window_pages {window_pages}, {kinds} layer kinds, max_seq_len "
                       f"{max_seq_len}, float32)", "pool_mb": round(pool_mb, 1), "warmup_s": round(warmup_s, 1),
            "decode_tok_s": BATCH * (new_tokens - 1) / (total - first),
            "run_tok_s": BATCH * new_tokens / total, "pass_ms": 1e3 * (total - first) / (new_tokens - 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window-pages", default="ring,all", help="comma-separated engine.window_pages modes to run")
    ap.add_argument("--layer-kinds", default="traced",
                    help="comma-separated: traced (a per-layer flag and a cond choosing the read: CPU and TPU) and/or "
                         "static (layers scanned in blocks of their pattern: GPU)")
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "window_decode.json")
    args = ap.parse_args()

    import torch
    import transformers

    from benchmarks.machine import cpu_flags
    from raydeploy.checkpoint.convert import convert

    torch.set_num_threads(2)
    torch.manual_seed(0)
    prompts = _prompts()
    result: dict = {"config": CONFIG, "batch": BATCH, "new_tokens": args.new_tokens, "cpu_flags": cpu_flags(),
                    "jax": __import__("jax").__version__,
                    "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**CONFIG),
                                                              dtype=torch.float32).eval()
        model.save_pretrained(Path(tmp) / "hf")
        result["results"].append(bench_hf(model, prompts, args.new_tokens))
        print(json.dumps(result["results"][-1]), flush=True)
        del model
        convert(Path(tmp) / "hf", Path(tmp) / "ckpt", progress=False)
        for mode in args.window_pages.split(","):
            for kinds in args.layer_kinds.split(","):
                if kinds not in ("traced", "static"):
                    ap.error(f"--layer-kinds: unknown {kinds!r} (traced, static)")
                result["results"].append(bench_ours(Path(tmp) / "ckpt", mode, args.max_seq_len, prompts,
                                                    args.new_tokens, kinds == "static"))
                print(json.dumps(result["results"][-1]), flush=True)
    ref = result["results"][0]
    for r in result["results"][1:]:
        r["ratio_vs_hf"] = r["decode_tok_s"] / ref["decode_tok_s"]
        r["run_ratio_vs_hf"] = r["run_tok_s"] / ref["run_tok_s"]
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
