"""Batched LoRA inside the step: every token of a step names an adapter slot (or none), and each adapted projection
adds `(x @ A[slot]) @ B[slot] * scale[slot]` to its output, for all tokens in one computation over every slot.

The BGMV/Punica idea written in JAX: the adapters of one size class (every slot holds `lora.max_rank`, a smaller
adapter zero-padded) are stacked, A [slots, in, r] and B [slots, r, out] per layer and target. Instead of
gathering each token's A and B (a copy of in x r values per token, per projection), the step multiplies its
tokens by every slot's A at once (x [N, in] . A -> [N, slots, r], one matmul of width slots x r), keeps each
token's own slot's columns scaled by that slot's alpha / r (`LoraRows.weight`, [N, slots]: zero outside the
token's slot, so a token without an adapter adds exactly zero) and multiplies by every slot's B
([N, slots, r] . B -> [N, out]). Both products are plain dots XLA partitions like the base kernel: A's input
axis and B's output axis carry the base kernel's logical axes (`raydeploy.lora.layout`), so under tp a
column-parallel projection (q/k/v, gate/up) splits B's output and a row-parallel one (o, down) A's input, and
the [N, slots, r] product is all-reduced where the base output is. A step none of whose tokens has an adapter
skips the term (`LoraRows.active`, a `lax.cond` per projection): base-model steps read no adapter weight.

`LoraRows` travels through the family's forward as an argument next to the matmul backend (never ambient
state): `Llama.ragged(..., lora=)` scans the per-layer stacks with the layers (`layer_xs`, `at_layer`) and
hands each layer's `LoraRows` to the projections (`raydeploy.model.projection.project(..., lora=, names=)`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target, by their module name (PEFT's `target_modules` and ours)."""


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoraWeights:
    """The device-resident adapter slots: per target, A [L, slots, in, r] and B [L, slots, r, out] (model dtype),
    and each slot's scale [slots] float32 (alpha / r, or alpha / sqrt(r) for rsLoRA; 0 for an empty slot)."""

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]
    scale: jax.Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoraRows:
    """One step's adapters as the forward reads them: the slots' A/B stacks (with the layer axis before the
    scan, one layer's inside it) and `weight` [N, slots] float32, each token's slot scale in its slot's column
    (zeros for a token without an adapter)."""

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]
    weight: jax.Array
    active: jax.Array
    """bool[]: some token of the step has an adapter. A step of base-model rows only skips every adapter term
    (`lax.cond`): it neither reads the stacks nor multiplies by them."""

    @classmethod
    def for_tokens(cls, weights: LoraWeights, token_adapter: jax.Array) -> LoraRows:
        """The rows of a step whose tokens use adapter slots `token_adapter` [N] (-1: none)."""
        slots = weights.scale.shape[0]
        onehot = (token_adapter[:, None] == jnp.arange(slots, dtype=token_adapter.dtype)[None, :])
        return cls(weights.a, weights.b, jnp.where(onehot, weights.scale[None, :], 0.0).astype(jnp.float32),
                   jnp.any(token_adapter >= 0))

    def layer_xs(self) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
        """The stacks a layer scan slices per layer (its `xs`)."""
        return self.a, self.b

    def at_layer(self, ab: tuple[Mapping[str, jax.Array], Mapping[str, jax.Array]]) -> LoraRows:
        """This step's rows with one layer's slices of the stacks (what the scan hands the layer)."""
        return LoraRows(dict(ab[0]), dict(ab[1]), self.weight, self.active)

    def delta(self, name: str, x: jax.Array) -> jax.Array | None:
        """The adapters' term of projection `name` for its input x [N, ...] (flattened to [N, in]): [N, out]
        float32, or None when no slot targets it (the engine holds no stack for it)."""
        a = self.a.get(name)
        if a is None:
            return None
        b = self.b[name]
        xf = x.reshape(x.shape[0], a.shape[-2])

        def term(xf: jax.Array, a: jax.Array, b: jax.Array, weight: jax.Array) -> jax.Array:
            h = jnp.einsum("ni,sir->nsr", xf.astype(a.dtype), a, preferred_element_type=jnp.float32)
            h = h * weight[:, :, None]
            return jnp.einsum("nsr,sro->no", h.astype(b.dtype), b, preferred_element_type=jnp.float32)

        def skip(xf: jax.Array, a: jax.Array, b: jax.Array, weight: jax.Array) -> jax.Array:
            return jnp.zeros((xf.shape[0], b.shape[-1]), jnp.float32)

        return jax.lax.cond(self.active, term, skip, xf, a, b, self.weight)

    def add(self, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
        """y (projection `name`'s output for input x, any shape with N leading) plus its adapters' term."""
        d = self.delta(name, x)
        return y if d is None else y + d.reshape(y.shape).astype(y.dtype)


def adapt(lora: LoraRows | None, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """`LoraRows.add` where the forward has adapters, else y."""
    return y if lora is None else lora.add(name, x, y)


def scan_xs(xs: Any, lora: LoraRows | None) -> Any:
    """A family's layer-scan xs with the adapters' per-layer stacks beside them (unchanged without adapters, so
    an engine without LoRA traces exactly its programs of before)."""
    return xs if lora is None else (xs, lora.layer_xs())


def split_xs(xs: Any, lora: LoraRows | None) -> tuple[Any, LoraRows | None]:
    """Inside the scan body: (the family's own xs, this layer's `LoraRows` or None)."""
    if lora is None:
        return xs, None
    own, ab = xs
    return own, lora.at_layer(ab)
