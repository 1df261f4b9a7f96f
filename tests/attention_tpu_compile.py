"""The TPU attention backend compiled for a v5e slice without a TPU (tests/test_attention.py runs this).

Run as: python attention_tpu_compile.py HEADS KV_HEADS HEAD_DIM DTYPE [WINDOW]
Builds a v5e 2x2 topology through libtpu, a dp=2 x tp=2 mesh of its devices, and compiles the backend that
`get_backend("auto", "tpu")` returns inside `shard_map` (pages and sequences over dp, heads over tp) from
shapes alone, traced under `jax.set_mesh`. Prints JSON: the device kind, whether the compiled program holds
the Pallas kernel, its argument bytes, or the error's first line.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["TPU_SKIP_MDS_QUERY"] = "1"


def main() -> int:
    heads, kv_heads, head_dim, dtype = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    window = int(sys.argv[5]) if len(sys.argv) > 5 else None
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from raydeploy.engine.attention import get_backend

    topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2", chip_config_name="default",
                                        chips_per_host_bounds=(2, 2, 1), num_slices=1)
    devices = np.array(topo.devices).reshape(2, 2)
    mesh = Mesh(devices, ("dp", "tp"))
    dp = 2
    tokens, rows, pages_per_seq, num_pages, page_size = 128, 16, 32, 512, 16
    dt = jnp.dtype(dtype)

    def spec(shape: tuple[int, ...], dtype: object, pspec: P) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, pspec))

    args = (spec((dp * tokens, heads, head_dim), dt, P("dp", "tp")),
            spec((dp * num_pages, page_size, 2 * kv_heads, head_dim), dt, P("dp", None, "tp")),
            spec((dp * rows,), jnp.int32, P("dp")),
            spec((dp * rows, pages_per_seq), jnp.int32, P("dp")),
            spec((dp * (rows + 1),), jnp.int32, P("dp")),
            spec((dp,), jnp.int32, P("dp")))
    backend = get_backend("auto", devices.flat[0].platform)

    def step(q, kv, lens, pages, cu, n):  # type: ignore[no-untyped-def]
        return backend(q, kv, lens, pages, cu, n, sm_scale=head_dim ** -0.5, sliding_window=window)

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=tuple(a.sharding.spec for a in args),
                              out_specs=P("dp", "tp"), check_vma=False))
    out: dict = {"device_kind": devices.flat[0].device_kind, "backend": f"{backend.__module__}.{backend.__name__}"}
    try:
        with jax.set_mesh(mesh):
            compiled = f.lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - report the compiler's own message
        out["error"] = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(json.dumps(out))
        return 0
    text = compiled.as_text()
    out["has_kernel"] = "ragged_paged_attention_kernel" in text
    out["argument_bytes"] = compiled.memory_analysis().argument_size_in_bytes
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
