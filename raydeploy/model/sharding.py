"""Sharding rules as data: logical axis names -> mesh axes, and the one global mesh.

Parameters and caches name their dimensions with logical axes (see `raydeploy.model.spec`). One table maps
each logical axis to zero, one or several mesh axes. The table can be overridden from YAML
(`mesh.rules`). Every logical axis a tensor uses must have a rule, a mesh axis may appear at most once per
tensor, and every sharded dimension must divide evenly; violations are errors naming the tensor.
Nothing here allocates device memory, so plans can be checked without hardware.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from raydeploy.config import MESH_AXES, ConfigError

if TYPE_CHECKING:
    import jax

    from raydeploy.model.spec import TensorSpec

Rule = str | Sequence[str] | None

# Defaults fit a model whose heads divide the tp size. For the demo model (9 heads, 3 KV heads) with tp=2,
# replicate attention (q_heads/kv_heads/cache_kv_heads: null) and shard MLP and vocab; configs do this.
DEFAULT_RULES: dict[str, Rule] = {
    # parameters
    "layers": None,
    "vocab": "tp",
    "embed": "fsdp",
    "q_heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "norm": None,
    # mixture-of-experts parameters (raydeploy.model.moe): experts over ep, each expert's units over tp
    "expert": "ep",
    "expert_mlp": "tp",
    "router": None,
    # KV cache
    "cache_batch": "dp",
    "cache_seq": "sp",
    "cache_kv_heads": "tp",
    # activations
    "act_batch": "dp",
    "act_seq": None,
    "act_embed": None,
    "act_vocab": None,
}


def merge_rules(overrides: Mapping[str, Rule] | None) -> dict[str, Rule]:
    rules = dict(DEFAULT_RULES)
    for k, v in (overrides or {}).items():
        if k not in DEFAULT_RULES:
            known = ", ".join(DEFAULT_RULES)
            raise ConfigError(f"unknown logical axis {k!r}; logical axes are: {known}", key=f"mesh.rules.{k}")
        for ax in _as_tuple(v):
            if ax not in MESH_AXES:
                raise ConfigError(f"rule for {k!r} names mesh axis {ax!r}; mesh axes are {', '.join(MESH_AXES)}",
                                  key=f"mesh.rules.{k}")
        rules[k] = v
    return rules


def _as_tuple(rule: Rule) -> tuple[str, ...]:
    if rule is None:
        return ()
    if isinstance(rule, str):
        return (rule,)
    return tuple(rule)


def logical_to_mesh_axes(logical_axes: Iterable[str], rules: Mapping[str, Rule], mesh_shape: Mapping[str, int],
                         what: str = "tensor") -> tuple[tuple[str, ...] | None, ...]:
    """Per dimension, the mesh axes it is sharded over (None = replicated). Axes of size 1 or absent drop out."""
    out: list[tuple[str, ...] | None] = []
    used: dict[str, str] = {}
    for la in logical_axes:
        if la not in rules:
            raise ConfigError(f"{what}: logical axis {la!r} has no sharding rule (add it to mesh.rules)",
                              key="mesh.rules")
        axes = tuple(a for a in _as_tuple(rules[la]) if mesh_shape.get(a, 1) > 1)
        for a in axes:
            if a in used:
                raise ConfigError(f"{what}: mesh axis {a!r} is used by both logical axes {used[a]!r} and {la!r}",
                                  key=f"mesh.rules.{la}")
            used[a] = la
        out.append(axes or None)
    return tuple(out)


def partition_spec(logical_axes: Iterable[str], rules: Mapping[str, Rule], mesh_shape: Mapping[str, int],
                   what: str = "tensor") -> jax.sharding.PartitionSpec:
    from jax.sharding import PartitionSpec

    dims = logical_to_mesh_axes(logical_axes, rules, mesh_shape, what)
    return PartitionSpec(*[None if d is None else (d[0] if len(d) == 1 else d) for d in dims])


def check_divisible(spec: TensorSpec, rules: Mapping[str, Rule], mesh_shape: Mapping[str, int]) -> None:
    """Every sharded dimension must split evenly over its mesh axes."""
    dims = logical_to_mesh_axes(spec.logical_axes, rules, mesh_shape, spec.name)
    for size, la, axes in zip(spec.shape, spec.logical_axes, dims, strict=True):
        if axes is None:
            continue
        n = math.prod(mesh_shape[a] for a in axes)
        if size % n:
            sizes = " x ".join(f"{a}={mesh_shape[a]}" for a in axes)
            raise ConfigError(
                f"tensor {spec.name}: dimension {la!r} of size {size} is not divisible by mesh {sizes} ({n}); "
                f"change mesh.axes or set mesh.rules.{la} to another axis or null", key=f"mesh.rules.{la}")


def shard_shape(spec: TensorSpec, rules: Mapping[str, Rule], mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
    """Shape of one device's shard."""
    dims = logical_to_mesh_axes(spec.logical_axes, rules, mesh_shape, spec.name)
    return tuple(s // (math.prod(mesh_shape[a] for a in d) if d else 1) for s, d in zip(spec.shape, dims, strict=True))


def build_mesh(mesh_shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """The global mesh, identical on every host: devices sorted by (process, id), axis types Auto.

    Sorting by process index first puts the outermost mesh axis across hosts (like DCN on TPU pods), so
    with dp outermost, hosts exchange only the sampled tokens per step.
    """
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    devs = sorted(devices if devices is not None else jax.devices(), key=lambda d: (d.process_index, d.id))
    names = tuple(mesh_shape)
    sizes = tuple(mesh_shape[n] for n in names)
    if math.prod(sizes) != len(devs):
        raise ConfigError(f"mesh {dict(mesh_shape)} needs {math.prod(sizes)} devices, JAX sees {len(devs)}",
                          key="mesh.axes")
    return Mesh(np.array(devs, dtype=object).reshape(sizes), names, axis_types=(AxisType.Auto,) * len(names))
