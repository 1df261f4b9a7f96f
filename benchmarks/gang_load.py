"""Checkpoint loading in the gang: per-host throughput and whole-gang load time, against peers in the same run.

- per host: each host's bytes read, seconds and GB/s during bring-up, versus a raw sequential read of
  the same number of bytes from the same shard files (`os.read` in 16 MiB blocks, warm page cache; the
  median of 3 reads, taken after the gang has stopped). Two peers: every host's raw read run at the same
  time, one process per host (the condition the hosts read under here, where the simulated hosts share
  one machine's cores and memory bandwidth; on a real cluster each host has its own), and one raw read
  alone (the machine's single-stream figure);
- whole gang: the slowest host's read and the bring-up's load phase (all hosts in parallel; the phase also
  builds the engine) versus one process with 4 devices reading the whole checkpoint for the same mesh shape.
The mesh shards weights across hosts (fsdp=2 outermost) so each host reads only its part. The checkpoint
is the one bring-up reads: the demo converted for the config's mesh, so on fsdp x tp its column-sharded
tensors are stored split (format version 2) and each host reads its slices without copying them.

    python benchmarks/gang_load.py [--mesh fsdp=2,tp=2] [--starts 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16 << 20


def overrides(mesh: str) -> list[str]:
    pairs = [kv.split("=") for kv in mesh.split(",")]
    axes = ", ".join(f"{k}: {v}" for k, v in pairs)
    devices = 1
    for _, v in pairs:
        devices *= int(v)
    # 2 hosts share the mesh's devices; the demo model's 9/3 heads do not split over tp, so attention is replicated
    return [f"mesh.axes={{{axes}}}", f"cluster.devices_per_host={devices // 2}",
            "mesh.rules={q_heads: null, kv_heads: null, cache_kv_heads: null}", "model.max_seq_len=256", "engine.prefill_buckets=[256]",
            "engine.max_new_tokens=64", "engine.max_slots=2", "engine.warmup=false", "cluster.init_timeout_s=120",
            # no persistent compile cache: the engine build after the read compiles the same programs every
            # run, whatever another run left in the cache (this measures the read)
            "engine.compilation_cache_dir=null"]


def raw_read_gbps(files: list[str], nbytes: int) -> float:
    """Sequentially read `nbytes` from the start of the files (in order), warm cache; GB/s."""
    for f in files:  # warm
        with open(f, "rb") as fh:
            while fh.read(BLOCK):
                pass
    left, t0 = nbytes, time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            while left > 0:
                chunk = os.read(fd, min(BLOCK, left))
                if not chunk:
                    break
                left -= len(chunk)
        finally:
            os.close(fd)
        if left <= 0:
            break
    return (nbytes - max(left, 0)) / (time.perf_counter() - t0) / 1e9


def _raw_read_worker(args: tuple) -> float:
    files, nbytes, barrier = args
    barrier.wait(timeout=60)
    return raw_read_gbps(files, nbytes)


def concurrent_raw_read_gbps(files: list[str], sizes: list[int]) -> list[float]:
    """One process per host, each reading its byte count at the same time (after a barrier); GB/s per host."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    with ctx.Manager() as mgr:
        barrier = mgr.Barrier(len(sizes))
        with ctx.Pool(len(sizes)) as pool:
            return pool.map(_raw_read_worker, [(files, n, barrier) for n in sizes])


def peer(mesh: str) -> dict:
    import jax

    from raydeploy.checkpoint.reader import CheckpointReader
    from raydeploy.config import load_config
    from raydeploy.gang.gang import resolve_checkpoint_path
    from raydeploy.model.sharding import build_mesh, merge_rules
    from raydeploy.model.spec import param_specs

    cfg = load_config(None, overrides(mesh))
    m = build_mesh(cfg.mesh_shape, jax.local_devices()[:cfg.total_devices])
    reader = CheckpointReader(resolve_checkpoint_path(cfg))
    t0 = time.perf_counter()
    _, stats = reader.load(param_specs(reader.llama_config), m, merge_rules(cfg.mesh.rules), cfg.model.param_dtype,
                           cfg.model.load_threads, progress=False)
    return {"seconds": time.perf_counter() - t0, "bytes_read": stats.bytes_read, "gbps": stats.gbps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="fsdp=2,tp=2")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--starts", type=int, default=3, help="bring-ups to take the median of (default 3)")
    args = ap.parse_args()
    if args.peer:
        print(json.dumps(peer(args.mesh)))
        return 0

    import ray

    from raydeploy.checkpoint.reader import CheckpointReader
    from raydeploy.config import load_config
    from raydeploy.gang.gang import resolve_checkpoint_path, start_gang

    cfg = load_config(None, overrides(args.mesh))
    path = resolve_checkpoint_path(cfg)
    files = [str(Path(path) / f) for f in sorted(CheckpointReader(path).index.files)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PJRT_NPROC="8", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, __file__, "--peer", "--mesh", args.mesh], env=env, check=True,
                          capture_output=True, text=True, cwd=REPO)
    one = json.loads(proc.stdout.strip().splitlines()[-1])

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(num_cpus=2, _temp_dir=f"/tmp/rdl-{os.getpid()}", include_dashboard=False, log_to_driver=False)
    starts = []
    try:
        for _ in range(args.starts):
            g = start_gang(cfg, checkpoint_path=path)
            starts.append(g.wait_ready(1800))
            g.shutdown()
    finally:
        ray.shutdown()
    # a host reads for ~0.1 s here, so one bring-up's figure is mostly noise: per rank, the bring-up with its
    # median read time
    st = dict(starts[0])
    st["hosts"] = [sorted((s["hosts"][r] for s in starts), key=lambda h: h["load"]["seconds"])[len(starts) // 2]
                   for r in range(len(starts[0]["hosts"]))]
    st["phase_s"] = {"load_s": statistics.median(s["phase_s"]["load_s"] for s in starts)}
    sizes = [int(h["load"]["bytes_read"]) for h in st["hosts"]]
    together = [statistics.median(col) for col in zip(*(concurrent_raw_read_gbps(files, sizes) for _ in range(3)))]
    hosts = []
    for h, raw_together in zip(st["hosts"], together):
        ld = h["load"]
        hosts.append({"rank": h["rank"], "bytes_read": ld["bytes_read"], "seconds": ld["seconds"], "gbps": ld["gbps"],
                      # median of 3: one raw read on a shared machine swung 1-5 GB/s
                      "raw_read_gbps": statistics.median(raw_read_gbps(files, int(ld["bytes_read"])) for _ in range(3)),
                      "raw_read_together_gbps": raw_together})
    total = sum(os.path.getsize(f) for f in files)
    out = {"mesh": args.mesh, "checkpoint": str(path), "checkpoint_bytes": total, "hosts": hosts, "gang_load_phase_s": st["phase_s"]["load_s"],
           "gang_read_s": max(h["seconds"] for h in hosts), "one_process": one}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"checkpoint {total / 1e6:.0f} MB ({Path(path).name}), mesh {args.mesh}")
    for h in hosts:
        print(f"host {h['rank']}: read {h['bytes_read'] / 1e6:.0f} MB in {h['seconds']:.3f} s = {h['gbps']:.2f} GB/s "
              f"(raw read of the same bytes with every host reading at once: {h['raw_read_together_gbps']:.2f} GB/s, "
              f"ratio {h['gbps'] / h['raw_read_together_gbps']:.2f}x, target >= 0.8x; "
              f"alone: {h['raw_read_gbps']:.2f} GB/s, ratio {h['gbps'] / h['raw_read_gbps']:.2f}x)")
    print(f"whole gang: slowest host's read {out['gang_read_s']:.2f} s, load phase (read + engine build) "
          f"{out['gang_load_phase_s']:.2f} s; one process reading everything "
          f"{one['seconds']:.2f} s ({one['bytes_read'] / 1e6:.0f} MB, {one['gbps']:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
