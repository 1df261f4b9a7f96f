"""Checkpoint loading in the gang: per-host throughput and whole-gang load time, against peers in the same run.

- per host: each host's bytes read, seconds and GB/s during bring-up, versus a raw sequential read of
  the same number of bytes from the same shard files (`os.readv` into a reused, page-aligned 16 MiB buffer, warm
  page cache; the median of 3 reads, taken after the gang has stopped). The buffer is page-aligned as `cat`'s
  is: on the 2-core EPYC VM of docs/performance.md the kernel copied into a destination 16 bytes off a 64-byte
  boundary at 2.2 GB/s instead of 7.7 (a `bytearray` lands there or not by chance, which made this peer swing
  between 2.5 and 14 GB/s from run to run). Two peers: every host's raw read run at the same
  time, one process per host (the condition the hosts read under here, where the simulated hosts share
  one machine's cores and memory bandwidth; on a real cluster each host has its own), and one raw read
  alone (the machine's single-stream figure);
- whole gang: the slowest host's read and the bring-up's load phase (all hosts in parallel; the phase also
  builds the engine) versus one process with 4 devices reading the whole checkpoint for the same mesh shape.
The mesh shards weights across hosts (fsdp=2 outermost) so each host reads only its part. The checkpoint
is the one bring-up reads: the demo converted for the config's mesh, its layer tensors stacked over the
layers ([L, ...], as the engine holds them), so on fsdp x tp its column-sharded tensors are stored split
(format version 4: the stacked MLP kernels along both cut dims) and each host reads its slices without
copying them, as a few large tensors.

`--model wide` loads a random-weight Llama of width 2048 and 8 layers (2.2 GB in float32, tensors of 8-46 MB
instead of the demo's 0.1-1 MB) written once under /tmp: with the demo, a host reads for ~0.1 s, so fixed
per-tensor costs weigh as much as the bytes; a checkpoint of real proportions shows the per-byte rate.

    python benchmarks/gang_load.py [--mesh fsdp=2,tp=2] [--model demo|wide] [--starts 3] [--load-threads N] [--json]

`--load-threads` sets `model.load_threads` (default: the config's, capped at the CPU count by the reader):
here the two simulated hosts share the machine's cores, so each host's threads compete with the other's.
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

import numpy as np
from machine import cpu_flags  # benchmarks/machine.py (scripts run with benchmarks/ on sys.path)

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
            "mesh.rules={q_heads: null, kv_heads: null, cache_kv_heads: null}", "model.max_seq_len=256",
            "engine.max_new_tokens=64", "engine.max_slots=2", "engine.warmup=false", "cluster.init_timeout_s=120",
            # no persistent compile cache: the engine build after the read compiles the same programs every
            # run, whatever another run left in the cache (this measures the read)
            "engine.compilation_cache_dir=null"]


WIDE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 5632, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
        "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32"}


def wide_checkpoint(mesh: str) -> str:
    """A random-weight Llama of WIDE's shape, converted (once per mesh cut) split for the benchmark's mesh."""
    from safetensors.numpy import save_file

    from raydeploy.checkpoint.convert import convert
    from raydeploy.checkpoint.layout import column_splits, splits_tag
    from raydeploy.config import load_config
    from raydeploy.model.sharding import merge_rules

    cfg = load_config(None, overrides(mesh))
    splits = column_splits(cfg.mesh_shape, merge_rules(cfg.mesh.rules))
    root = Path("/tmp/raydeploy-bench-wide")
    src, dst = root / "hf", root / f"stacked{'@' + splits_tag(splits) if splits else ''}"
    if (dst / "index.json").exists():
        return str(dst)
    if not (src / "model.safetensors").exists():
        src.mkdir(parents=True, exist_ok=True)
        c, rng = WIDE, np.random.default_rng(0)
        d, f, hd = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
        kv = c["num_key_value_heads"] * hd

        def w(*shape: int) -> np.ndarray:
            return (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float32)

        t = {"model.embed_tokens.weight": w(c["vocab_size"], d), "model.norm.weight": np.ones(d, np.float32),
             "lm_head.weight": w(c["vocab_size"], d)}
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            t |= {p + "self_attn.q_proj.weight": w(d, d), p + "self_attn.k_proj.weight": w(kv, d),
                  p + "self_attn.v_proj.weight": w(kv, d), p + "self_attn.o_proj.weight": w(d, d),
                  p + "mlp.gate_proj.weight": w(f, d), p + "mlp.up_proj.weight": w(f, d),
                  p + "mlp.down_proj.weight": w(d, f), p + "input_layernorm.weight": np.ones(d, np.float32),
                  p + "post_attention_layernorm.weight": np.ones(d, np.float32)}
        save_file(t, str(src / "model.safetensors"))
        (src / "config.json").write_text(json.dumps(c))
    convert(src, dst, "safetensors", progress=False, splits=splits or None)
    return str(dst)


def raw_read(files: list[str], nbytes: int) -> tuple[float, float]:
    """Sequentially read `nbytes` from the start of the files (in order) into one reused, page-aligned 16 MiB
    buffer, warm cache; (GB/s, CPU seconds of the timed read). The buffer is reused so that the figure is the copy out of the page cache alone, without
    faulting in fresh memory for every block (what `os.read` returning new bytes objects would add)."""
    from raydeploy.checkpoint.format import aligned_empty

    buf = memoryview(aligned_empty(BLOCK, alignment=4096))
    for f in files:  # warm
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    left, t0, c0 = nbytes, time.perf_counter(), time.process_time()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            while left > 0:
                n = os.readv(fd, [buf[:min(BLOCK, left)]])
                if not n:
                    break
                left -= n
        finally:
            os.close(fd)
        if left <= 0:
            break
    return (nbytes - max(left, 0)) / (time.perf_counter() - t0) / 1e9, time.process_time() - c0


def _raw_read_worker(args: tuple) -> tuple[float, float]:
    files, nbytes, barrier = args
    barrier.wait(timeout=60)
    return raw_read(files, nbytes)


def concurrent_raw_reads(files: list[str], sizes: list[int]) -> list[tuple[float, float]]:
    """One process per host, each reading its byte count at the same time (after a barrier); (GB/s, CPU
    seconds) per host."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    with ctx.Manager() as mgr:
        barrier = mgr.Barrier(len(sizes))
        with ctx.Pool(len(sizes)) as pool:
            return pool.map(_raw_read_worker, [(files, n, barrier) for n in sizes])


def peer(mesh: str, checkpoint: str | None) -> dict:
    import jax

    from raydeploy.checkpoint.reader import CheckpointReader
    from raydeploy.config import load_config
    from raydeploy.gang.gang import resolve_checkpoint_path
    from raydeploy.model.sharding import build_mesh, merge_rules

    cfg = load_config(None, overrides(mesh))
    m = build_mesh(cfg.mesh_shape, jax.local_devices()[:cfg.total_devices])
    reader = CheckpointReader(checkpoint or resolve_checkpoint_path(cfg))
    t0 = time.perf_counter()
    _, stats = reader.load(reader.param_specs(), m, merge_rules(cfg.mesh.rules), cfg.model.param_dtype,
                           cfg.model.load_threads, progress=False)
    return {"seconds": time.perf_counter() - t0, "bytes_read": stats.bytes_read, "gbps": stats.gbps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="fsdp=2,tp=2")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", choices=("demo", "wide"), default="demo")
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    ap.add_argument("--starts", type=int, default=3, help="bring-ups to take the median of (default 3)")
    ap.add_argument("--load-threads", type=int, help="model.load_threads for the gang (default: the config's)")
    args = ap.parse_args()
    if args.peer:
        print(json.dumps(peer(args.mesh, args.checkpoint)))
        return 0

    import ray

    from raydeploy.checkpoint.reader import CheckpointReader
    from raydeploy.config import load_config
    from raydeploy.gang.gang import resolve_checkpoint_path, start_gang

    extra = [] if args.load_threads is None else [f"model.load_threads={args.load_threads}"]
    cfg = load_config(None, overrides(args.mesh) + extra)
    path = resolve_checkpoint_path(cfg) if args.model == "demo" else wide_checkpoint(args.mesh)
    files = [str(Path(path) / f) for f in sorted(CheckpointReader(path).index.files)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PJRT_NPROC="8", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, __file__, "--peer", "--mesh", args.mesh, "--checkpoint", path], env=env, check=True,
                          capture_output=True, text=True, cwd=REPO)
    one = json.loads(proc.stdout.strip().splitlines()[-1])

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(num_cpus=2, _temp_dir=f"/tmp/rdl-{os.getpid()}", include_dashboard=False, log_to_driver=False)
    starts = []
    try:
        for _ in range(args.starts):
            g = start_gang(cfg, checkpoint_path=path)  # the wide model's random weights are never decoded
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
    runs = [concurrent_raw_reads(files, sizes) for _ in range(3)]
    hosts = []
    for r, h in enumerate(st["hosts"]):
        ld = h["load"]
        alone = [raw_read(files, int(ld["bytes_read"])) for _ in range(3)]  # median of 3: a shared machine swings
        hosts.append({"rank": h["rank"], "bytes_read": ld["bytes_read"], "seconds": ld["seconds"], "gbps": ld["gbps"],
                      "cpu_seconds": ld.get("cpu_seconds"),
                      "raw_read_gbps": statistics.median(g for g, _ in alone),
                      "raw_read_cpu_seconds": statistics.median(c for _, c in alone),
                      "raw_read_together_gbps": statistics.median(run[r][0] for run in runs),
                      "raw_read_together_cpu_seconds": statistics.median(run[r][1] for run in runs)})
    total = sum(os.path.getsize(f) for f in files)
    out = {"mesh": args.mesh, "load_threads": cfg.model.load_threads, "cpu_flags": cpu_flags(), "checkpoint": str(path), "checkpoint_bytes": total, "hosts": hosts, "gang_load_phase_s": st["phase_s"]["load_s"],
           "gang_read_s": max(h["seconds"] for h in hosts), "one_process": one}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"checkpoint {total / 1e6:.0f} MB ({Path(path).name}), mesh {args.mesh}, load_threads "
          f"{cfg.model.load_threads}; cpu {cpu_flags()}, "
          f"load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    for h in hosts:
        print(f"host {h['rank']}: read {h['bytes_read'] / 1e6:.0f} MB in {h['seconds']:.3f} s = {h['gbps']:.2f} GB/s "
              f"(raw read of the same bytes with every host reading at once: {h['raw_read_together_gbps']:.2f} GB/s, "
              f"ratio {h['gbps'] / h['raw_read_together_gbps']:.2f}x, target >= 0.8x; "
              f"alone: {h['raw_read_gbps']:.2f} GB/s, ratio {h['gbps'] / h['raw_read_gbps']:.2f}x)")
        if h["cpu_seconds"]:
            print(f"  CPU seconds: load {h['cpu_seconds']:.3f}, raw read at once {h['raw_read_together_cpu_seconds']:.3f} "
                  f"(ratio {h['raw_read_together_cpu_seconds'] / h['cpu_seconds']:.2f}x), alone "
                  f"{h['raw_read_cpu_seconds']:.3f} (ratio {h['raw_read_cpu_seconds'] / h['cpu_seconds']:.2f}x)")
    print(f"whole gang: slowest host's read {out['gang_read_s']:.2f} s, load phase (read + engine build) "
          f"{out['gang_load_phase_s']:.2f} s; one process reading everything "
          f"{one['seconds']:.2f} s ({one['bytes_read'] / 1e6:.0f} MB, {one['gbps']:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
