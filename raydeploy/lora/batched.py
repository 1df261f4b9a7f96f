"""Batched LoRA inside the step: every token of a step names an adapter slot (or none), and each adapted projection
adds `(x @ A[slot]) @ B[slot] * scale[slot]` to its output, for all tokens in one computation over every slot.

The BGMV/Punica idea written in JAX: the adapters of one size class (every slot holds `lora.max_rank`, a smaller
adapter zero-padded) are stacked, A [slots, r, in] and B [slots, r, out] per layer and target. Instead of
gathering each token's A and B (a copy of in x r values per token, per projection), the step multiplies its
tokens by every slot's A at once (x [N, in] . A -> [N, slots x r], one matmul of width slots x r), keeps each
token's own slot's columns scaled by that slot's alpha / r (`LoraRows.weight`, [N, slots]: zero outside the
token's slot, so a token without an adapter adds exactly zero) and multiplies by every slot's B
([N, slots x r] . B -> [N, out]). Both products are plain dots XLA partitions like the base kernel: A's input
axis and B's output axis carry the base kernel's logical axes (`raydeploy.lora.layout`), so under tp a
column-parallel projection (q/k/v, gate/up) splits B's output and a row-parallel one (o, down) A's input, and
the [N, slots x r] product is all-reduced where the base output is. A step none of whose tokens has an adapter
skips the term (`LoraRows.active`, one `lax.cond` per group of projections of one input: q/k/v, gate/up, o,
down): base-model steps read no adapter weight.

`LoraRows` travels through the family's forward as an argument next to the matmul backend (never ambient
state): `Llama.ragged(..., lora=)` gives each layer of its scan the step's `LoraRows` at that layer (`at_layer`)
and hands it to the projections (`raydeploy.model.projection.project(..., lora=, names=)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from raydeploy.model.projection import LayerSlice

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target, by their module name (PEFT's `target_modules` and ours)."""


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoraWeights:
    """The device-resident adapter slots: per target, A [L, slots, r, in] (PEFT's lora_A, [r, in] per slot) and B
    [L, slots, r, out] (lora_B transposed), in the model's dtype, and each slot's scale [slots] float32 (alpha / r,
    or alpha / sqrt(r) for rsLoRA; 0 for an empty slot). A layer's A and B reshape to [slots * r, in] and
    [slots * r, out] for free, so each product is one plain dot."""

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]
    scale: jax.Array


@dataclass(frozen=True)
class LoraRows:
    """One step's adapters as the forward reads them: the slots' A/B stacks (every layer) and `weight`
    [N, slots * r] float32, each token's slot scale in its slot's r columns (zeros elsewhere, and everywhere for a
    token without an adapter)."""

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]
    weight: jax.Array
    active: jax.Array
    """bool[]: some token of the step has an adapter. A step of base-model rows only skips every adapter term
    (`lax.cond`): it neither reads the stacks nor multiplies by them."""
    layer: jax.Array | None = None
    """The layer the projections are in (`at_layer`); its slices of the stacks are read inside the `lax.cond`, so
    a step without adapters slices nothing (a scan's per-layer slice of a stack is a copy on XLA CPU)."""
    matmul: Any = None
    """The step's matmul backend (`raydeploy.model.projection.Matmul`). One that reads stacked weights whole
    (`reads_whole`: the native CPU kernels) multiplies by each layer's A and B in place (a `LayerSlice`), so no
    per-layer copy of the stacks is made; otherwise the layer's slices are taken and multiplied by XLA's dot."""
    skip_inactive: bool = True
    """Put the adapter terms under `lax.cond` on `active` (CPU: a base-model step then pays nothing). False on
    accelerators: XLA TPU copies a conditional's large operands (the stacks), so the terms are always computed
    there (the per-layer slices fuse into the dots)."""

    @classmethod
    def for_tokens(cls, weights: LoraWeights, token_adapter: jax.Array, skip_inactive: bool = True,
                   matmul: Any = None) -> LoraRows:
        """The rows of a step whose tokens use adapter slots `token_adapter` [N] (-1: none), multiplied with
        `matmul` (None: XLA's dot)."""
        slots = weights.scale.shape[0]
        rank = next(iter(weights.a.values())).shape[2] if weights.a else 1
        onehot = (token_adapter[:, None] == jnp.arange(slots, dtype=token_adapter.dtype)[None, :])
        weight = jnp.where(onehot, weights.scale[None, :], 0.0).astype(jnp.float32)
        return cls(weights.a, weights.b, jnp.repeat(weight, rank, axis=1), jnp.any(token_adapter >= 0),
                   matmul=matmul, skip_inactive=skip_inactive)

    def at_layer(self, layer: jax.Array) -> LoraRows:
        """This step's rows at one layer of the stacks (the traced layer index the scan gives its body)."""
        return LoraRows(self.a, self.b, self.weight, self.active, layer, self.matmul, self.skip_inactive)

    def add_all(self, names: Sequence[str], x: jax.Array, ys: Sequence[jax.Array]) -> list[jax.Array]:
        """Each y of `ys` (projection `names[i]`'s output for the shared input x, any shape with N leading) plus
        its adapters' term; the targets the engine holds no stack for unchanged. One `lax.cond` for them all."""
        held = [i for i, n in enumerate(names) if n in self.a]
        if not held:
            return list(ys)
        if self.layer is None:
            raise ValueError("LoraRows needs the layer: call at_layer first")
        layer = self.layer
        a = [self.a[names[i]] for i in held]
        b = [self.b[names[i]] for i in held]
        xf = x.reshape(x.shape[0], a[0].shape[-1])

        mm = self.matmul if self.matmul is not None and getattr(self.matmul, "reads_whole", False) else None

        def term(xf: jax.Array, a: list[jax.Array], b: list[jax.Array], weight: jax.Array) -> list[jax.Array]:
            out = []
            for ai, bi in zip(a, b, strict=True):
                if mm is not None:  # the kernels read the layer's [slots x r, in] and [slots x r, out] in place
                    sr = ai.shape[1] * ai.shape[2]
                    h = mm.matmul(xf.astype(jnp.float32), LayerSlice(ai, layer, (sr, ai.shape[3])), out_first=True)
                    h = h.astype(jnp.float32) * weight
                    out.append(mm.matmul(h, LayerSlice(bi, layer, (sr, bi.shape[3]))).astype(jnp.float32))
                    continue
                al = jax.lax.dynamic_index_in_dim(ai, layer, keepdims=False)  # [slots, r, in]
                bl = jax.lax.dynamic_index_in_dim(bi, layer, keepdims=False)  # [slots, r, out]
                al = al.reshape(-1, al.shape[-1])
                bl = bl.reshape(-1, bl.shape[-1])
                h = jax.lax.dot_general(xf.astype(al.dtype), al, (((1,), (1,)), ((), ())),
                                        preferred_element_type=jnp.float32) * weight  # [N, slots * r]
                out.append(jnp.dot(h.astype(bl.dtype), bl, preferred_element_type=jnp.float32))
            return out

        def skip(xf: jax.Array, a: list[jax.Array], b: list[jax.Array], weight: jax.Array) -> list[jax.Array]:
            return [jnp.zeros((xf.shape[0], bi.shape[-1]), jnp.float32) for bi in b]

        if self.skip_inactive:
            deltas = jax.lax.cond(self.active, term, skip, xf, a, b, self.weight)
        else:
            deltas = term(xf, a, b, self.weight)
        out = list(ys)
        for i, d in zip(held, deltas, strict=True):
            out[i] = out[i] + d.reshape(out[i].shape).astype(out[i].dtype)
        return out

    def add(self, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
        """y (projection `name`'s output for input x, any shape with N leading) plus its adapters' term."""
        return self.add_all((name,), x, (y,))[0]


def adapt(lora: LoraRows | None, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """`LoraRows.add` where the forward has adapters, else y."""
    return y if lora is None else lora.add(name, x, y)


def at_layer(lora: LoraRows | None, layer: jax.Array) -> LoraRows | None:
    """`LoraRows.at_layer` where the forward has adapters, else None."""
    return None if lora is None else lora.at_layer(layer)
