"""Per-step control overhead of the gang, and bring-up time by phase.

Runs the same model, mesh shape, batch and requests on both, alternating repeats so that both see the
same machine load:
- peer: one process holding all the mesh's virtual CPU devices (4 by default) driving the Engine with the
  Scheduler (LocalRunner), kept alive in a subprocess that runs one timed generation per line it reads;
- gang: --hosts processes (2) sharing the devices (2 each) joined by jax.distributed, rank 0 broadcasting
  every StepPlan.
Reported: step time of each (wall time of the generation / steps; median and best of the repeats), the
gang's overhead in percent, rank 0's broadcast cost per step in microseconds (key-value write and the
amortised deletes; also on the stand-in engine, where steps are tiny), and the gang's bring-up time from
nothing to ready by phase (placement, actors, fingerprint, init, load, compile).

    python benchmarks/gang_overhead.py [--mesh dp=4] [--hosts 2] [--batch 4] [--tokens 96] [--decode-steps 4] [--json]

With a tp axis (--mesh dp=2,tp=2) the gang pays for XLA CPU's multi-process collectives: once a process
is part of a jax.distributed job, every collective, even between two devices of that process, goes through
gloo over TCP (measured ~4 ms per all-reduce vs ~0.4 ms in one process), i.e. 30 per decode step here.
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


def mesh_devices(args: argparse.Namespace) -> int:
    n = 1
    for kv in args.mesh.split(","):
        n *= int(kv.split("=")[1])
    return n


def overrides(args: argparse.Namespace) -> list[str]:
    axes = ", ".join(f"{k}: {v}" for k, v in (kv.split("=") for kv in args.mesh.split(",")))
    n = mesh_devices(args)
    if n % args.hosts:
        raise SystemExit(f"--mesh {args.mesh} has {n} devices, which do not split over --hosts {args.hosts}")
    return [f"mesh.axes={{{axes}}}", f"cluster.num_hosts={args.hosts}", f"cluster.devices_per_host={n // args.hosts}",
            "model.max_seq_len=256",
            "engine.max_new_tokens=200", f"engine.max_slots={args.batch}", "cluster.init_timeout_s=120",
            f"engine.decode_steps={args.decode_steps}"]


def requests(args: argparse.Namespace, tag: str) -> list:
    from raydeploy.engine.request import GenerationRequest

    return [GenerationRequest(f"{tag}{i}", PROMPT[: len(PROMPT) - i], max_tokens=args.tokens, ignore_eos=True)
            for i in range(args.batch)]


def peer(args: argparse.Namespace) -> dict:
    """One process holding every device of the mesh: the same engine and scheduler without the gang."""
    import jax

    from raydeploy.config import load_config
    from raydeploy.engine.local import LocalRunner
    from raydeploy.engine.scheduler import Scheduler
    from raydeploy.gang.gang import resolve_checkpoint_path
    from raydeploy.loading import build_engine
    from raydeploy.model.sharding import build_mesh

    cfg = load_config(None, overrides(args))
    mesh = build_mesh(cfg.mesh_shape, jax.local_devices()[:mesh_devices(args)])
    engine = build_engine(cfg, mesh, resolve_checkpoint_path(cfg), load_threads=8).engine
    engine.warmup()
    sched = Scheduler.for_engine(engine, cfg)
    runner = LocalRunner(engine, sched)
    runner.generate(requests(args, "warm"))
    print(json.dumps({"ready": True}), flush=True)
    for r, line in enumerate(sys.stdin):  # one timed generation per line
        if line.strip() != "run":
            break
        t0 = time.perf_counter()
        runner.generate(requests(args, f"p{r}"))
        wall = time.perf_counter() - t0
        print(json.dumps({"step_ms": wall / args.tokens * 1e3}), flush=True)  # per decode step (token)
    return {}


class Peer:
    """The single-process peer as a subprocess that runs one generation per request."""

    def __init__(self, args: argparse.Namespace) -> None:
        env = dict(os.environ, JAX_PLATFORMS="cpu", PJRT_NPROC="8",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={mesh_devices(args)}")
        cmd = [sys.executable, __file__, "--peer", "--mesh", args.mesh, "--hosts", str(args.hosts),
               "--decode-steps", str(args.decode_steps), "--batch", str(args.batch),
               "--tokens", str(args.tokens)]
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self._read()  # {"ready": true} after load, compile and a warm-up generation

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"peer process ended (exit {self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def run(self) -> float:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read()["step_ms"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def gang_run(coord: object, args: argparse.Namespace, tag: str) -> tuple[float, float]:
    """One timed generation on the gang: (step ms, mean broadcast us over the gang's life)."""
    import asyncio

    import ray

    from raydeploy.gang.feed import stream_events

    async def run_all() -> None:
        async def one(req) -> None:
            async for _ in stream_events(coord, req):
                pass
        await asyncio.gather(*[one(r) for r in requests(args, tag)])

    s0 = ray.get(coord.stats.remote())
    t0 = time.perf_counter()
    asyncio.run(run_all())
    wall = time.perf_counter() - t0
    s1 = ray.get(coord.stats.remote())
    # per decode step: every request generates args.tokens tokens; plans carry up to engine.decode_steps each
    return wall / args.tokens * 1e3, s1["mean_broadcast_us"], args.tokens / (s1["steps_done"] - s0["steps_done"])


def toy_broadcast(args: argparse.Namespace) -> dict:
    """Broadcast cost and step time on the stand-in engine (steps of about a millisecond)."""
    from raydeploy.config import load_config
    from raydeploy.gang.gang import start_gang

    cfg = load_config(None, overrides(args))
    g = start_gang(cfg, engine="toy")
    try:
        g.wait_ready(600)
        coord = g.coordinator()
        step_ms, bcast_us, _ = gang_run(coord, argparse.Namespace(**{**vars(args), "tokens": 500}), "toy")
        return {"step_ms": step_ms, "broadcast_us": bcast_us}
    finally:
        g.shutdown()


def measure(args: argparse.Namespace) -> dict:
    import statistics

    import ray

    from raydeploy.config import load_config
    from raydeploy.gang.gang import start_gang

    cfg = load_config(None, overrides(args))
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    peer_proc = Peer(args)
    ray.init(num_cpus=2, _temp_dir=f"/tmp/rdb-{os.getpid()}", include_dashboard=False, log_to_driver=False)
    try:
        t0 = time.perf_counter()
        g = start_gang(cfg)
        st = g.wait_ready(3600)
        ready_s = time.perf_counter() - t0
        coord = g.coordinator()
        gang_run(coord, args, "warm")
        peer_ms, gang_ms, bcast, per_plan = [], [], None, None
        for r in range(args.repeat):  # alternate so both see the same load
            peer_ms.append(peer_proc.run())
            ms, bcast, per_plan = gang_run(coord, args, f"g{r}")
            gang_ms.append(ms)
        g.shutdown()
        toy = toy_broadcast(args)
    finally:
        peer_proc.close()
        ray.shutdown()
    return {"peer_step_ms": peer_ms, "gang_step_ms": gang_ms, "peer_median_ms": statistics.median(peer_ms),
            "gang_median_ms": statistics.median(gang_ms), "broadcast_us": bcast, "tokens_per_plan": per_plan,
            "toy": toy,
            "ready_s": ready_s, "phase_s": st["phase_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="dp=4", help="mesh axes, e.g. dp=4 or dp=2,tp=2")
    ap.add_argument("--hosts", type=int, default=2, help="host processes of the gang (the peer is one process)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--decode-steps", type=int, default=4, help="engine.decode_steps: decode steps per plan")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.peer:
        peer(args)
        return 0
    m = measure(args)
    overhead = (m["gang_median_ms"] / m["peer_median_ms"] - 1) * 100
    bcast_per_token_ms = m["broadcast_us"] / 1e3 / m["tokens_per_plan"]
    out = {"mesh": args.mesh, "hosts": args.hosts, "batch": args.batch, "tokens": args.tokens,
           "decode_steps": args.decode_steps, **m, "step_overhead_pct": overhead,
           "broadcast_pct_of_step": bcast_per_token_ms / m["gang_median_ms"] * 100}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"decode step (ms per token), mesh {args.mesh}, batch {args.batch}, decode_steps {args.decode_steps} "
              f"(median of {args.repeat}, alternating): "
              f"1 process x {mesh_devices(args)} devices {m['peer_median_ms']:.1f} ms; {args.hosts} hosts x "
              f"{mesh_devices(args) // args.hosts} devices "
              f"{m['gang_median_ms']:.1f} ms ({overhead:+.1f}%)")
        print(f"broadcast per plan (rank 0): {m['broadcast_us']:.0f} us, {m['tokens_per_plan']:.2f} decode steps per "
              f"plan: {out['broadcast_pct_of_step']:.2f}% of a step; stand-in engine: "
              f"{m['toy']['broadcast_us']:.0f} us per step of "
              f"{m['toy']['step_ms']:.2f} ms")
        print(f"bring-up to ready {m['ready_s']:.1f} s; by phase: "
              + ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in m["phase_s"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
