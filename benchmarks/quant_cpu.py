"""CPU decode speed of the demo model with int8 weights against float32, same run, same machine.

Variants (each a fresh engine over the demo checkpoint, default config otherwise, float32 activations):
- `float32-native`: the default CPU engine (native matmul kernels, packed 4-bit weights where they apply);
- `float32-xla`: float32 weights through XLA's dot (`engine.cpu_matmul: xla`), the int8 engine's peer;
- `int8-xla`: `model.quantization: int8` (quantized while loading; XLA's dot converts each weight in the fusion;
  the native kernels read float weights only, so an int8 CPU engine uses XLA).
Per variant: decode tokens/s at batch 1 and 8 (`--new-tokens` each, eos ignored, greedy), after one warm-up
request per batch size (compiles excluded), in `--rounds` interleaved rounds, medians reported. No CPU kernel for
int8 exists: this is the cost of the quantized path on CPU, where it is the correctness reference, not a target.

    .venv/bin/python benchmarks/quant_cpu.py             # writes benchmarks/results/quant_cpu.json
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
RESULTS = REPO / "benchmarks" / "results" / "quant_cpu.json"
VARIANTS = {
    "float32-native": (),
    "float32-xla": ("engine.cpu_matmul=xla",),
    "int8-xla": ("model.quantization=int8",),
}


def _runner(overrides: tuple[str, ...]):
    import jax

    from raydeploy.checkpoint.demo import resolve_checkpoint
    from raydeploy.config import load_config
    from raydeploy.engine.local import LocalRunner
    from raydeploy.engine.scheduler import Scheduler
    from raydeploy.loading import build_engine
    from raydeploy.model.sharding import build_mesh

    cfg = load_config(None, ["engine.max_slots=8", *overrides])
    built = build_engine(cfg, build_mesh({"dp": 1}, jax.devices()[:1]), resolve_checkpoint(cfg.model.checkpoint))
    return LocalRunner(built.engine, Scheduler.for_engine(built.engine, cfg)), built.engine.matmul


def _decode_tps(runner, batch: int, new_tokens: int) -> float:
    from raydeploy.engine.request import GenerationRequest
    from raydeploy.engine.step import SamplingParams

    reqs = [GenerationRequest(f"r{time.monotonic_ns()}-{i}", tuple(range(200 + i, 216 + i)), new_tokens,
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
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    import jax

    runners = {name: _runner(ov) for name, ov in VARIANTS.items()}
    for runner, _ in runners.values():  # compile every bucket the timed runs use
        for batch in (1, 8):
            _decode_tps(runner, batch, 8)
    samples: dict[str, dict[int, list[float]]] = {n: {1: [], 8: []} for n in VARIANTS}
    for _ in range(args.rounds):
        for name, (runner, _) in runners.items():
            for batch in (1, 8):
                samples[name][batch].append(_decode_tps(runner, batch, args.new_tokens))
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "jax": jax.__version__},
        "new_tokens": args.new_tokens, "rounds": args.rounds,
        "variants": {n: {"matmul": runners[n][1],
                         "tok_s_b1": round(statistics.median(s[1]), 2), "tok_s_b8": round(statistics.median(s[8]), 2),
                         "samples_b1": [round(x, 2) for x in s[1]], "samples_b8": [round(x, 2) for x in s[8]]}
                     for n, s in samples.items()},
    }
    v = result["variants"]
    result["ratios"] = {f"int8_over_{base}_b{b}": round(v["int8-xla"][f"tok_s_b{b}"] / v[base][f"tok_s_b{b}"], 3)
                        for base in ("float32-xla", "float32-native") for b in (1, 8)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
