"""Per-step control overhead of the gang, and bring-up time by phase.

Runs the same model, mesh shape, batch and requests twice in one run:
- peer: one process with 4 virtual CPU devices driving the Engine with the Scheduler (LocalRunner);
- gang: 2 host processes x 2 devices joined by jax.distributed, rank 0 broadcasting every StepPlan.
Reported: mean step time of each (wall time of the generation / steps), the gang's overhead in percent,
rank 0's broadcast cost per step in microseconds (key-value write + deletes), and the gang's bring-up time
from nothing to ready by phase (placement, actors, fingerprint, init, load, compile).

    python benchmarks/gang_overhead.py [--mesh dp=2,tp=2] [--batch 2] [--tokens 96] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = (1, 9690, 198, 2683, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198)


def overrides(args: argparse.Namespace) -> list[str]:
    axes = ", ".join(f"{k}: {v}" for k, v in (kv.split("=") for kv in args.mesh.split(",")))
    return [f"mesh.axes={{{axes}}}", "model.max_seq_len=256", "engine.prefill_buckets=[64, 256]",
            "engine.max_new_tokens=200", f"engine.max_slots={args.batch}", "cluster.init_timeout_s=120"]


def requests(args: argparse.Namespace, tag: str) -> list:
    from raydeploy.engine.request import GenerationRequest

    return [GenerationRequest(f"{tag}{i}", PROMPT[: len(PROMPT) - i], max_tokens=args.tokens, ignore_eos=True)
            for i in range(args.batch)]


def peer(args: argparse.Namespace) -> dict:
    """One process, 4 devices: the same engine and scheduler without the gang."""
    import jax

    from raydeploy.checkpoint.reader import CheckpointReader
    from raydeploy.config import load_config
    from raydeploy.engine.engine import Engine
    from raydeploy.engine.local import LocalRunner
    from raydeploy.engine.scheduler import Scheduler
    from raydeploy.gang.gang import resolve_checkpoint_path
    from raydeploy.model.sharding import build_mesh, merge_rules
    from raydeploy.model.spec import param_specs

    cfg = load_config(None, overrides(args))
    mesh = build_mesh(cfg.mesh_shape, jax.local_devices()[:4])
    rules = merge_rules(cfg.mesh.rules)
    reader = CheckpointReader(resolve_checkpoint_path(cfg))
    params, _ = reader.load(param_specs(reader.llama_config), mesh, rules, cfg.model.param_dtype, 8,
                            progress=False)
    engine = Engine(reader.llama_config, params, mesh, rules, cfg.model, cfg.engine)
    engine.warmup()
    sched = Scheduler.for_engine(engine, cfg)
    runner = LocalRunner(engine, sched)
    runner.generate(requests(args, "warm"))
    best = None
    for r in range(args.repeat):
        steps0 = sched.steps
        t0 = time.perf_counter()
        runner.generate(requests(args, f"p{r}"))
        wall = time.perf_counter() - t0
        ms = wall / (sched.steps - steps0) * 1e3
        best = ms if best is None else min(best, ms)
    return {"step_ms": best}


def gang(args: argparse.Namespace) -> dict:
    import asyncio

    import ray

    from raydeploy.config import load_config
    from raydeploy.gang.gang import start_gang, stream_events

    cfg = load_config(None, overrides(args))
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(num_cpus=2, _temp_dir=f"/tmp/rdb-{os.getpid()}", include_dashboard=False, log_to_driver=False)
    try:
        t0 = time.perf_counter()
        g = start_gang(cfg)
        st = g.wait_ready(1800)
        ready_s = time.perf_counter() - t0
        coord = g.coordinator()

        async def run_all(tag: str) -> None:
            async def one(req) -> None:
                async for _ in stream_events(coord, req):
                    pass
            await asyncio.gather(*[one(r) for r in requests(args, tag)])

        asyncio.run(run_all("warm"))
        best, bcast = None, None
        for r in range(args.repeat):
            s0 = ray.get(coord.stats.remote())
            t0 = time.perf_counter()
            asyncio.run(run_all(f"g{r}"))
            wall = time.perf_counter() - t0
            s1 = ray.get(coord.stats.remote())
            steps = s1["steps_done"] - s0["steps_done"]
            ms = wall / steps * 1e3
            if best is None or ms < best:
                best, bcast = ms, s1["mean_broadcast_us"]
        g.shutdown()
        return {"step_ms": best, "broadcast_us": bcast, "ready_s": ready_s, "phase_s": st["phase_s"]}
    finally:
        ray.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="dp=2,tp=2")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.peer:
        print(json.dumps(peer(args)))
        return 0
    env = dict(os.environ, JAX_PLATFORMS="cpu", PJRT_NPROC="8",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    cmd = [sys.executable, __file__, "--peer", "--mesh", args.mesh, "--batch", str(args.batch),
           "--tokens", str(args.tokens), "--repeat", str(args.repeat)]
    peer_out = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True,
                                         cwd=REPO).stdout.strip().splitlines()[-1])
    gang_out = gang(args)
    overhead = (gang_out["step_ms"] / peer_out["step_ms"] - 1) * 100
    out = {"mesh": args.mesh, "batch": args.batch, "tokens": args.tokens, "peer_1x4": peer_out,
           "gang_2x2": gang_out, "step_overhead_pct": overhead,
           "broadcast_pct_of_step": gang_out["broadcast_us"] / 1e3 / gang_out["step_ms"] * 100}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"decode step, mesh {args.mesh}, batch {args.batch}: 1 process x 4 devices "
              f"{peer_out['step_ms']:.1f} ms; 2 hosts x 2 devices {gang_out['step_ms']:.1f} ms "
              f"({overhead:+.1f}%)")
        print(f"broadcast per step (rank 0): {gang_out['broadcast_us']:.0f} us "
              f"= {out['broadcast_pct_of_step']:.2f}% of a step")
        print(f"bring-up to ready {gang_out['ready_s']:.1f} s; by phase: "
              + ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in gang_out["phase_s"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
