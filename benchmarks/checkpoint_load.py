"""Checkpoint load throughput: `CheckpointReader.load` versus a raw sequential read of the same files.

Both run in the same process and the same run, alternating, with a warm page cache (the files are read
once before timing). The peer is `cat <shard files> > /dev/null`: the fastest a plain sequential reader
gets here. Reported: GB/s of each (best and median of --repeat runs) and the ratio load/cat, for the
default load (mmap + the index's checksum per block: crc32c, or crc32 before format version 3), without checksums, and with `use_mmap=False` (preadv into buffers).
The demo checkpoint is read as the gang would: stored split for the mesh when it shards column dimensions
(`--no-split` reads the plain conversion, whose column slices are copied).

    python benchmarks/checkpoint_load.py [--checkpoint DIR|demo:smollm2-135m-instruct] [--mesh dp=1,tp=4] [--no-split]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="demo:smollm2-135m-instruct")
    ap.add_argument("--mesh", default="tp=1", help="mesh axes, e.g. tp=1 (one device) or dp=2,tp=2")
    ap.add_argument("--devices", type=int, default=4, help="virtual CPU devices for this process")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-verify", action="store_true", help="skip crc32 checks (also reported separately)")
    ap.add_argument("--no-split", action="store_true", help="demo: read the plain conversion, not one split for the mesh")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}").strip()
    os.environ.setdefault("PJRT_NPROC", "8")
    import jax

    from raydeploy.checkpoint.demo import DEMO_PREFIX, ensure_demo_checkpoint, resolve_checkpoint
    from raydeploy.checkpoint.layout import column_splits
    from raydeploy.checkpoint.reader import CheckpointReader
    from raydeploy.model.sharding import build_mesh, merge_rules

    mesh_shape = {k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(","))}
    # attention heads of the demo model (9/3) do not split over 2 or 4: replicate them, shard MLP and vocab
    rules = merge_rules({"q_heads": None, "kv_heads": None, "cache_kv_heads": None})
    if args.checkpoint.startswith(DEMO_PREFIX) and not args.no_split:
        path = ensure_demo_checkpoint(args.checkpoint[len(DEMO_PREFIX):], splits=column_splits(mesh_shape, rules))
    else:
        path = resolve_checkpoint(args.checkpoint)
    reader = CheckpointReader(path)
    specs = reader.param_specs()
    n_dev = 1
    for v in mesh_shape.values():
        n_dev *= v
    mesh = build_mesh(mesh_shape, devices=jax.devices()[:n_dev])
    files = [str(path / f) for f in sorted(reader.index.files)]
    file_bytes = sum(os.path.getsize(f) for f in files)

    def cat_s() -> float:
        t = time.perf_counter()
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
        return time.perf_counter() - t

    def load_s(verify: bool, use_mmap: bool = True) -> tuple[float, int]:
        t = time.perf_counter()
        params, stats = reader.load(specs, mesh, rules, threads=args.threads, progress=False, verify=verify,
                                    use_mmap=use_mmap)
        jax.block_until_ready(params)
        seconds = time.perf_counter() - t
        del params
        return seconds, stats.bytes_read

    cat_s()  # warm the page cache
    load_s(True)
    cats, loads, loads_noverify, loads_pread = [], [], [], []
    bytes_read = 0
    for _ in range(args.repeat):
        cats.append(cat_s())
        s, bytes_read = load_s(not args.no_verify)
        loads.append(s)
        if not args.no_verify:
            loads_noverify.append(load_s(False)[0])
        loads_pread.append(load_s(not args.no_verify, use_mmap=False)[0])

    def gbps(nbytes: int, secs: list[float]) -> dict[str, float]:
        return {"best_gbps": round(nbytes / min(secs) / 1e9, 3), "median_gbps": round(nbytes / statistics.median(secs) / 1e9, 3)}

    out = {
        "checkpoint": str(path), "mesh": mesh_shape, "threads": args.threads, "repeat": args.repeat,
        "file_bytes": file_bytes, "bytes_read_per_load": bytes_read,
        "cat": gbps(file_bytes, cats),
        "load": gbps(bytes_read, loads),
    }
    if loads_noverify:
        out["load_no_verify"] = gbps(bytes_read, loads_noverify)
    out["load_pread"] = gbps(bytes_read, loads_pread)
    out["ratio_best"] = round(out["load"]["best_gbps"] / out["cat"]["best_gbps"], 3)
    out["ratio_median"] = round(out["load"]["median_gbps"] / out["cat"]["median_gbps"], 3)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"checkpoint {path} ({file_bytes / 1e6:.0f} MB in {len(files)} files), mesh {mesh_shape}, "
              f"threads {args.threads}, {args.repeat} runs, warm page cache")
        print(f"  cat > /dev/null      best {out['cat']['best_gbps']:.2f} GB/s  median {out['cat']['median_gbps']:.2f} GB/s")
        print(f"  reader.load          best {out['load']['best_gbps']:.2f} GB/s  median {out['load']['median_gbps']:.2f} GB/s")
        if loads_noverify:
            nv = out["load_no_verify"]
            print(f"  reader.load noverify best {nv['best_gbps']:.2f} GB/s  median {nv['median_gbps']:.2f} GB/s")
        pr = out["load_pread"]
        print(f"  reader.load pread    best {pr['best_gbps']:.2f} GB/s  median {pr['median_gbps']:.2f} GB/s")
        print(f"  ratio load/cat       best {out['ratio_best']:.2f}x  median {out['ratio_median']:.2f}x (target >= 0.8x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
