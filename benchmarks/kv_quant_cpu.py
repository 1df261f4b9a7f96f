"""CPU decode speed of the demo model with an int8 KV cache against float16 and float32 caches, same run.

Variants (each a fresh engine over the demo checkpoint, default config otherwise: float32 weights and
activations, the native matmul kernels), differing only in `engine.kv_dtype`:
- `float32`: the model's dtype; the decode rows' attention in the native CPU kernel;
- `float16`: the embedded default's; the native kernel widens each key and value as it loads it;
- `int8`: a scale per token and head; the native kernel reads float pools only, so the decode rows' attention
  runs XLA's paged path, which dequantizes each block of pages as it gathers it.
Per variant: decode tokens/s at batch 1 and 8 after prompts of `--prompt` tokens (so the cache, not only the
weights, is read every pass), `--new-tokens` each, eos ignored, greedy, after one warm-up request per batch size
(compiles excluded), in `--rounds` interleaved rounds, medians reported. Also the bytes per token per layer of
each pool. No CPU kernel reads int8 KV: the CPU is not its target, this is its cost there.

    .venv/bin/python benchmarks/kv_quant_cpu.py          # writes benchmarks/results/kv_quant_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "kv_quant_cpu.json"
VARIANTS = {"float32": ("engine.kv_dtype=float32",), "float16": ("engine.kv_dtype=float16",),
            "int8": ("engine.kv_dtype=int8",)}


def _runner(overrides: tuple[str, ...]):
    import jax

    from raydeploy.checkpoint.demo import resolve_checkpoint
    from raydeploy.config import load_config
    from raydeploy.engine.kv_cache import kv_bytes_per_token
    from raydeploy.engine.local import LocalRunner
    from raydeploy.engine.scheduler import Scheduler
    from raydeploy.loading import build_engine
    from raydeploy.model.sharding import build_mesh

    cfg = load_config(None, ["engine.max_slots=8", "model.max_seq_len=1024", *overrides])
    built = build_engine(cfg, build_mesh({"dp": 1}, jax.devices()[:1]), resolve_checkpoint(cfg.model.checkpoint))
    e = built.engine
    per_token = kv_bytes_per_token(e.kv_dtype, e.cfg.num_kv_heads, e.cfg.head_dim)
    return LocalRunner(e, Scheduler.for_engine(e, cfg)), per_token


def _decode_tps(runner, batch: int, new_tokens: int, prompt: int) -> float:
    from raydeploy.engine.request import GenerationRequest
    from raydeploy.engine.step import SamplingParams

    reqs = [GenerationRequest(f"r{time.monotonic_ns()}-{i}", tuple((200 + i + 7 * j) % 40000 for j in range(prompt)), new_tokens,
                              SamplingParams(temperature=0.0), ignore_eos=True) for i in range(batch)]
    t0 = time.perf_counter()
    outs = runner.generate(reqs, timeout_s=600)
    total = time.perf_counter() - t0
    first = max(o.first_token_s or 0.0 for o in outs)
    tokens = sum(len(o.token_ids) - 1 for o in outs)
    return tokens / max(total - first, 1e-9)


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt", type=int, default=384)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    import jax

    runners = {name: _runner(ov) for name, ov in VARIANTS.items()}
    for runner, _ in runners.values():  # compile every bucket the timed runs use
        for batch in (1, 8):
            _decode_tps(runner, batch, 4, args.prompt)
    samples: dict[str, dict[int, list[float]]] = {n: {1: [], 8: []} for n in VARIANTS}
    for _ in range(args.rounds):
        for name, (runner, _) in runners.items():
            for batch in (1, 8):
                samples[name][batch].append(_decode_tps(runner, batch, args.new_tokens, args.prompt))
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "jax": jax.__version__},
        "new_tokens": args.new_tokens, "prompt_tokens": args.prompt, "rounds": args.rounds,
        "variants": {n: {"kv_bytes_per_token_per_layer": runners[n][1],
                         "tok_s_b1": round(statistics.median(s[1]), 2), "tok_s_b8": round(statistics.median(s[8]), 2),
                         "samples_b1": [round(x, 2) for x in s[1]], "samples_b8": [round(x, 2) for x in s[8]]}
                     for n, s in samples.items()},
    }
    v = result["variants"]
    result["ratios"] = {f"int8_over_{base}_b{b}": round(v["int8"][f"tok_s_b{b}"] / v[base][f"tok_s_b{b}"], 3)
                        for base in ("float32", "float16") for b in (1, 8)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
