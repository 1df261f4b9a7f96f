"""Qwen3-30B-A3B's routed experts compiled for a TPU v5e 2x2 slice without a TPU (tests/test_families.py runs this).

Run as: python moe_tpu_compile.py TOKENS
One layer's MoE block at the real shapes (hidden 2048, 128 experts of 768 units, 8 per token, bfloat16) with the
experts split over ep=4 (32 per chip): `route` then `expert_ffn_ep` with the grouped matmul (`ragged_dot`),
traced from shapes alone under `jax.set_mesh` and compiled through libtpu. Prints JSON: the device kind,
whether the program holds a ragged dot, its argument bytes per chip, or the error's first line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["TPU_SKIP_MDS_QUERY"] = "1"


def main() -> int:
    tokens = int(sys.argv[1])
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from raydeploy.model.moe import expert_ffn_ep, route
    from raydeploy.model.registry import from_hf_config

    raw = json.loads((Path(__file__).resolve().parents[1] / "configs/models/qwen3-30b-a3b/config.json").read_text())
    fam, cfg = from_hf_config(raw)
    fam.check_mesh(cfg, {"ep": 4})
    topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2", chip_config_name="default",
                                        chips_per_host_bounds=(2, 2, 1), num_slices=1)
    devices = np.array(topo.devices).reshape(4)
    mesh = Mesh(devices, ("ep",))
    e, d, f, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    bf = jnp.bfloat16

    def spec(shape: tuple[int, ...], pspec: P) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, bf, sharding=NamedSharding(mesh, pspec))

    args = (spec((tokens, d), P()), spec((d, e), P()), spec((e, d, f), P("ep")), spec((e, d, f), P("ep")),
            spec((e, f, d), P("ep")))

    def block(x, router, gate, up, down):  # type: ignore[no-untyped-def]
        w, ids = route(x @ router, k, cfg.norm_topk_prob)
        return expert_ffn_ep(x, ids, w, gate, up, down, mesh, method="ragged_dot")

    out: dict = {"device_kind": devices[0].device_kind}
    try:
        with jax.set_mesh(mesh):
            compiled = jax.jit(block).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - report the compiler's own message
        out["error"] = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(json.dumps(out))
        return 0
    text = compiled.as_text()
    out["has_ragged_dot"] = "ragged-dot" in text or "ragged_dot" in text
    out["all_gather"] = "all-gather" in text
    out["argument_bytes"] = compiled.memory_analysis().argument_size_in_bytes
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
