"""Running streams while a long prompt arrives: the mixed-step token budget against decode speed, in one process.

While streams decode, the scheduler prefills a newly arrived prompt in chunks of at most `mixed_step_tokens`
per dp group (decode rows included) beside them, so their tokens keep coming; the engine's default budget is a
quarter of `engine.prefill_chunk`. A smaller budget keeps those steps shorter (the streams' time per output
token, TPOT, stays nearer what it was) and makes the long prompt wait longer for its first token; so does
`engine.max_decode_slowdown`, which holds the prompt's next chunk back for decode-only passes after each chunk
step (0: never). This measures both for several budgets and limits on the demo model, one engine (the same
compiled programs), one CPU device:

- peer: the 7 streams' TPOT in a window of pure decoding before the prompt arrives (plans of
  `engine.decode_steps` decode passes);
- per budget and limit: their TPOT while a ~1500-token prompt prefills (until its first token), and that
  prompt's TTFT.

    .venv/bin/python benchmarks/mixed_step.py [--budgets 16,32,64] [--slowdowns 0,2] [--long-tokens 1500]

Prints the CPU's vector flags and writes benchmarks/results/mixed_step.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from machine import cpu_flags  # benchmarks/machine.py (scripts run with benchmarks/ on sys.path)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "mixed_step.json"
STREAMS = 7


def _tpot(times: list[float], lo: float, hi: float) -> float:
    """A stream's time per output token over (lo, hi]: the window over the tokens that arrived in it. (Not the
    mean gap between arrivals: a plan of n decode passes delivers n tokens at once, so the gaps inside a window
    are n - 1 zeros and one plan time per plan, and their mean undercounts by up to 1 / n per plan.)"""
    n = sum(1 for t in times if lo < t <= hi)
    if not n:
        raise RuntimeError(f"no tokens in the window of {hi - lo:.2f} s")
    return (hi - lo) / n


def run_budget(engine, budget: int, slowdown: float, long_tokens: int,  # type: ignore[no-untyped-def]
               before_plans: int) -> dict:
    from raydeploy.engine.local import LocalRunner
    from raydeploy.engine.request import GenerationRequest
    from raydeploy.engine.scheduler import Paging, Scheduler

    paging = Paging(engine.page_size, engine.pages_per_group, engine.groups, engine.max_step_tokens, False, budget,
                    slowdown)
    sched = Scheduler(engine.max_slots, engine.max_seq_len, (), 16, paging, slot_order=engine.slot_order,
                      decode_steps=engine.decode_steps)
    runner = LocalRunner(engine, sched)
    times: dict[str, list[float]] = {}

    def sink_for(rid: str):  # type: ignore[no-untyped-def]
        times[rid] = []
        return lambda ev: times[rid].append(time.perf_counter()) if ev.token_id is not None else None

    for i in range(STREAMS):  # distinct short prompts, long enough generations to run through the event
        rid = f"s{i}"
        sched.submit(GenerationRequest(rid, tuple(range(200 + 7 * i, 230 + 7 * i)), 1500), sink_for(rid))
    while min(len(times[f"s{i}"]) for i in range(STREAMS)) < 8:  # all streams decoding
        runner.step_once()
    t_before = time.perf_counter()
    for _ in range(before_plans):
        runner.step_once()
    t_arrive = time.perf_counter()
    sched.submit(GenerationRequest("long", tuple(300 + (j * 37) % 20000 for j in range(long_tokens)), 4),
                 sink_for("long"))
    while not times["long"]:
        runner.step_once()
    t_first = times["long"][0]
    t_end = time.perf_counter()  # the end of the plan that gave the long prompt its first token
    # both windows start and end between two plans, so each stream's tokens in a window are exactly those of
    # the window's plans
    before = [_tpot(times[f"s{i}"], t_before, t_arrive) for i in range(STREAMS)]
    during = [_tpot(times[f"s{i}"], t_arrive, t_end) for i in range(STREAMS)]
    sched_steps = sched.steps
    return {"budget_tokens": budget, "max_decode_slowdown": slowdown,
            "tpot_before_ms": 1000 * statistics.mean(before),
            "tpot_during_ms": 1000 * statistics.mean(during),
            "ratio": statistics.mean(during) / statistics.mean(before),
            "long_prompt_ttft_s": t_first - t_arrive, "plans": sched_steps,
            "scheduler_decode_pass_ms": None if sched.decode_pass_s is None else 1000 * sched.decode_pass_s,
            "scheduler_chunk_step_ms": None if sched.chunk_step_s is None else 1000 * sched.chunk_step_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="16,32,64", help="mixed-step token budgets per dp group to compare")
    p.add_argument("--slowdowns", default="0,2",
                   help="engine.max_decode_slowdown values to compare (0: a prompt chunk in every step)")
    p.add_argument("--long-tokens", type=int, default=1500)
    p.add_argument("--before-plans", type=int, default=6, help="pure decode plans in the window before")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from raydeploy.checkpoint.demo import resolve_checkpoint
    from raydeploy.checkpoint.reader import CheckpointReader
    from raydeploy.config import EngineConfig, ModelConfig
    from raydeploy.engine.engine import Engine
    from raydeploy.model.registry import from_hf_config
    from raydeploy.model.sharding import build_mesh, merge_rules

    budgets = [int(b) for b in args.budgets.split(",")]
    path = resolve_checkpoint("demo:smollm2-135m-instruct")
    mesh = build_mesh({"dp": 1}, jax.devices()[:1])
    rules = merge_rules({})
    reader = CheckpointReader(path)
    params, _ = reader.load(reader.param_specs(), mesh, rules, "float32", 4, progress=False)
    engine = Engine(*from_hf_config(reader.hf_config), params, mesh, rules, ModelConfig(max_seq_len=2048),
                    EngineConfig(max_slots=8, max_new_tokens=1536))
    ps = engine.programs_set
    ps.token_buckets = sorted(set(ps.token_buckets) | set(budgets))  # one program per budget, same engine
    engine.warmup()
    flags = cpu_flags()
    print(f"CPU flags: {flags} ({os.cpu_count()} cores), jax {jax.__version__}; token buckets {ps.token_buckets}")
    rows = []
    for k in (float(x) for x in args.slowdowns.split(",")):
        for b in budgets:
            r = run_budget(engine, b, k, args.long_tokens, args.before_plans)
            rows.append(r)
            print(f"budget {b:4d} tokens, max_decode_slowdown {k:g}: TPOT before {r['tpot_before_ms']:6.1f} ms, while "
                  f"the {args.long_tokens}-token prompt prefills {r['tpot_during_ms']:6.1f} ms (x{r['ratio']:.2f}); "
                  f"its TTFT {r['long_prompt_ttft_s']:.2f} s", flush=True)
    out = {"cpu_flags": flags, "cpu_count": os.cpu_count(), "jax": jax.__version__,
           "load_average_1m": round(os.getloadavg()[0], 2), "streams": STREAMS, "long_tokens": args.long_tokens,
           "prefill_chunk": engine.max_step_tokens, "decode_steps": engine.decode_steps, "budgets": rows}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
