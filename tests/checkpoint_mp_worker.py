"""One process of the multi-process checkpoint load test (tests/test_checkpoint.py).

Run as: python checkpoint_mp_worker.py CKPT COORDINATOR_ADDR NUM_PROCESSES PROCESS_ID [tp4|fsdp_tp]
Joins jax.distributed (2 CPU devices per process), builds one mesh over all processes' devices (tp=4, or
fsdp=2 x tp=2 with attention heads replicated, as configs/cpu-fsdp.yaml), loads the checkpoint, checks
every local shard against the whole tensor read directly, and prints JSON stats.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"


def main() -> int:
    ckpt, addr, nproc, pid = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    mode = sys.argv[5] if len(sys.argv) > 5 else "tp4"
    import jax
    import numpy as np

    jax.distributed.initialize(addr, nproc, pid, initialization_timeout=60, coordinator_bind_address=addr)
    from raydeploy.checkpoint.reader import CheckpointReader
    from raydeploy.model.sharding import build_mesh, merge_rules

    r = CheckpointReader(ckpt)
    specs = r.param_specs()
    if mode == "fsdp_tp":
        rules = merge_rules({"q_heads": None, "kv_heads": None})
        mesh = build_mesh({"fsdp": 2, "tp": 2})
    else:
        rules = merge_rules({"embed": None, "q_heads": None, "kv_heads": None})
        mesh = build_mesh({"tp": 4})
    params, stats = r.load(specs, mesh, rules, progress=False)
    checked = 0
    for name, arr in params.items():
        full = r.read_tensor(name)
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index], err_msg=name)
            checked += 1
    planned = sum(b - a for rs in r.byte_ranges(specs, mesh, rules).values() for a, b in rs)
    # independently: tensors whose dim 0 is vocab or mlp are split 4 ways over tp; this process's two
    # devices (the mesh orders devices by process) hold rows [pid/2, (pid+1)/2) of them; the rest is read whole
    bb, expected = r.index.block_bytes, 0
    if mode == "fsdp_tp":  # the union of the local devices' slices, element by element (blocks of 1 element)
        from jax.sharding import NamedSharding

        from raydeploy.model.sharding import partition_spec

        for name, spec in specs.items():
            need = np.zeros(spec.shape, bool)
            sharding = NamedSharding(mesh, partition_spec(spec.logical_axes, rules, dict(mesh.shape)))
            for idx in sharding.addressable_devices_indices_map(spec.shape).values():
                need[idx] = True
            expected += int(need.sum()) * r.index.tensors[name].itemsize
        specs = {}
    for name, spec in specs.items():
        e = r.index.tensors[name]
        if spec.logical_axes[0] in ("vocab", "mlp"):
            half = spec.shape[0] // 2
            a, b = pid * half * e.row_bytes, (pid + 1) * half * e.row_bytes
        else:
            a, b = 0, e.length
        expected += min(-(-b // bb) * bb, e.length) - (a // bb) * bb
    print(json.dumps({"process": pid, "bytes_read": stats.bytes_read, "expected_bytes": expected, "planned_bytes": planned,
                      "total_bytes": r.index.total_bytes, "shards_checked": checked,
                      "local_devices": len(jax.local_devices()), "fingerprint": r.fingerprint()}))
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
