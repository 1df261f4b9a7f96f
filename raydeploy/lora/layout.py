"""The device-side adapter slots of one engine: which projections they cover, their shapes and logical axes, their
shardings and bytes per chip, and the programs that allocate them and write an adapter into a slot.

`lora.max_adapters` slots of rank `lora.max_rank` per target projection: A [L, slots, r, in] and B [L, slots, r,
out], in the model's dtype (one size class: a smaller adapter is zero-padded, which adds exact zeros). The
targets are the family's dense projections among `TARGETS` (an MoE family's experts are not adapted: its
adapters target q/k/v/o). A's input axis carries the logical axis of the base kernel's first input dim, B's
output axis the one of its first output dim, so a tp mesh splits them exactly as it splits the base kernel
(`raydeploy.lora.batched` says why that keeps the adapter term local).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from raydeploy.lora.batched import TARGETS, LoraWeights
from raydeploy.model.sharding import check_divisible, logical_to_mesh_axes, partition_spec
from raydeploy.model.spec import LAYER_AXIS, TensorSpec, kernel_input_dims

LORA_RULES: dict[str, Any] = {"lora_slots": None, "lora_rank": None}
"""Sharding rules of the slot and rank axes (never split), added to the mesh rules for the stacks."""


@dataclass(frozen=True)
class LoraTarget:
    """One adapted projection: its module name, the base kernel's stacked parameter name, its matmul's input and
    output widths and the logical axes A's input and B's output take from the base kernel."""

    name: str
    param: str
    inputs: int
    outputs: int
    in_axis: str
    out_axis: str


@dataclass(frozen=True)
class LoraLayout:
    """The slots of one engine (see the module docstring)."""

    slots: int
    rank: int
    layers: int
    dtype: str
    targets: tuple[LoraTarget, ...]

    @classmethod
    def for_model(cls, family: Any, cfg: Any, lora_cfg: Any, dtype: str) -> LoraLayout | None:
        """The layout for `lora` of the config over this model (`param_dtype` `dtype`); None when LoRA is off
        (`max_adapters` 0)."""
        if lora_cfg is None or lora_cfg.max_adapters <= 0:
            return None
        if lora_cfg.max_rank < 1:
            raise ValueError(f"lora.max_rank must be at least 1, got {lora_cfg.max_rank}")
        specs = family.stacked_param_specs(cfg)
        targets = []
        for t in TARGETS:
            param = next((f"layers.{part}.{t}.kernel" for part in ("attn", "mlp")
                          if f"layers.{part}.{t}.kernel" in specs), None)
            if param is None:
                continue
            spec = specs[param]
            n = kernel_input_dims(param)
            shape, axes = spec.shape[1:], spec.logical_axes[1:]
            targets.append(LoraTarget(t, param, math.prod(shape[:n]), math.prod(shape[n:]), axes[0], axes[n]))
        return cls(int(lora_cfg.max_adapters), int(lora_cfg.max_rank), int(cfg.num_layers), dtype, tuple(targets))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.targets)

    def target(self, name: str) -> LoraTarget | None:
        return next((t for t in self.targets if t.name == name), None)

    def specs(self) -> dict[str, TensorSpec]:
        """The stacks as TensorSpecs, by name ("a.q_proj", "b.q_proj", ...; "scale")."""
        out: dict[str, TensorSpec] = {}
        for t in self.targets:
            out[f"a.{t.name}"] = TensorSpec(f"lora.a.{t.name}", (self.layers, self.slots, self.rank, t.inputs),
                                            (LAYER_AXIS, "lora_slots", "lora_rank", t.in_axis))
            out[f"b.{t.name}"] = TensorSpec(f"lora.b.{t.name}", (self.layers, self.slots, self.rank, t.outputs),
                                            (LAYER_AXIS, "lora_slots", "lora_rank", t.out_axis))
        out["scale"] = TensorSpec("lora.scale", (self.slots,), ("lora_slots",))
        return out

    def _tree(self, leaf: Any) -> LoraWeights:
        specs = self.specs()
        return LoraWeights({t.name: leaf(specs[f"a.{t.name}"]) for t in self.targets},
                           {t.name: leaf(specs[f"b.{t.name}"]) for t in self.targets}, leaf(specs["scale"]))

    def shardings(self, mesh: jax.sharding.Mesh, rules: Mapping[str, Any]) -> LoraWeights:
        """Each stack's sharding on `mesh` (its logical axes placed by the mesh rules); a dim that does not split
        evenly is a ConfigError naming it."""
        all_rules = {**rules, **LORA_RULES}
        mesh_shape = dict(mesh.shape)

        def place(spec: TensorSpec) -> NamedSharding:
            check_divisible(spec, all_rules, mesh_shape)
            return NamedSharding(mesh, partition_spec(spec.logical_axes, all_rules, mesh_shape, spec.name))

        return self._tree(place)

    def abstract(self, mesh: jax.sharding.Mesh, rules: Mapping[str, Any]) -> LoraWeights:
        """The stacks as ShapeDtypeStructs with their shardings (what the step programs are lowered for)."""
        shardings = self.shardings(mesh, rules)
        dtype = jnp.dtype(self.dtype)
        shapes = self._tree(lambda spec: jax.ShapeDtypeStruct(
            spec.shape, jnp.float32 if spec.name == "lora.scale" else dtype))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)

    def allocate(self, mesh: jax.sharding.Mesh, rules: Mapping[str, Any]) -> LoraWeights:
        """Zeroed stacks on the mesh (every slot empty: scale 0)."""
        abstract = self.abstract(mesh, rules)
        shardings = jax.tree.map(lambda a: a.sharding, abstract)
        return jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract),
                       out_shardings=shardings)()

    def bytes_per_chip(self, mesh_shape: Mapping[str, int], rules: Mapping[str, Any]) -> int:
        """Bytes of the stacks on one chip (the sharded dims divided by their mesh axes), for `raydeploy plan`."""
        all_rules = {**rules, **LORA_RULES}
        itemsize = jnp.dtype(self.dtype).itemsize
        total = 0
        for key, spec in self.specs().items():
            n = 1
            for axes in logical_to_mesh_axes(spec.logical_axes, all_rules, mesh_shape, spec.name):
                n *= math.prod(mesh_shape[a] for a in axes or ())
            total += spec.numel // n * (4 if key == "scale" else itemsize)
        return total

    def write_program(self, mesh: jax.sharding.Mesh, rules: Mapping[str, Any]) -> Any:
        """A jitted program (weights, slot, a, b, scale) -> weights with slot `slot` holding `a` [L, r, in] and `b`
        [L, r, out] per target and `scale` (weights donated: written in place)."""
        shardings = self.shardings(mesh, rules)

        def write(w: LoraWeights, slot: jax.Array, a: dict[str, jax.Array], b: dict[str, jax.Array],
                  scale: jax.Array) -> LoraWeights:
            return LoraWeights({n: x.at[:, slot].set(a[n].astype(x.dtype)) for n, x in w.a.items()},
                               {n: x.at[:, slot].set(b[n].astype(x.dtype)) for n, x in w.b.items()},
                               w.scale.at[slot].set(scale))

        return jax.jit(write, donate_argnums=(0,), out_shardings=shardings)


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
