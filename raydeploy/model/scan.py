"""Running a body over a stacked layer module: `lax.scan` over its per-layer slices (`scan_layers`), in blocks of a
static per-layer kind, or unrolled over per-layer arrays (`unroll_layers`: the engine's one-token CPU programs).

A matmul backend that reads stacked kernels whole (`raydeploy.model.projection.Matmul.reads_whole`) asks for
`whole=True`: each in_out projection kernel then reaches the layer as a `LayerSlice` (the stack and the layer
index) instead of a sliced copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp

from raydeploy.model.projection import Dense, HeadsProj, LayerSlice, OutProj

UNROLLED_LAYERS = "_unrolled_layers"
"""Attribute of a stacked layer module (set with `unroll_layers`) holding one unstacked module per layer: its
`scan` then runs the body once per layer, in order, on those modules."""


def unroll_layers(stack: nnx.Module, per_layer: Sequence[Sequence[jax.Array]]) -> None:
    """Make `stack.scan` run unrolled over `per_layer`: for each layer, its arrays in the order of the stack's own
    state leaves, one layer each (the stack's graphdef merged with them gives that layer's module).

    Why: XLA CPU copies each layer's slice of a stacked weight into a new buffer before its matmul (a
    dynamic slice cannot be a library call's operand), so a scanned decode step writes and rereads every
    weight. At one token that copy is a quarter of the step (demo model: 23 ms scanned, 17 ms unrolled over
    per-layer arrays); from about four tokens the scanned step is as fast or faster, and an unrolled program
    compiles several times longer, so the engine unrolls only its one-token CPU programs."""
    graphdef, state = nnx.split(stack)
    stacked, treedef = jax.tree.flatten(state)
    layers = []
    for i, leaves in enumerate(per_layer):
        shapes = [tuple(x.shape) for x in leaves]
        if shapes != [tuple(x.shape[1:]) for x in stacked]:
            raise ValueError(f"layer {i}: arrays of shapes {shapes} do not match the stacked layer parameters "
                             f"{[tuple(x.shape) for x in stacked]} without their layer axis")
        layers.append(nnx.merge(graphdef, jax.tree.unflatten(treedef, list(leaves))))
    object.__setattr__(stack, UNROLLED_LAYERS, layers)


def scan_layers(stack: nnx.Module, body: Any, carry: Any, xs: Any = None,
                kinds: Sequence[Any] | None = None, whole: bool = False) -> tuple[Any, Any]:
    """body(layer, carry, x) -> (carry, y) over a stacked layer module: `lax.scan` over its per-layer slices,
    or, after `unroll_layers`, a loop over the per-layer modules. ys come back stacked either way.

    `kinds`: one static (hashable) value per layer, passed to the body as a fourth argument,
    body(layer, carry, x, kind). The layers are then scanned in blocks of the kinds' period, the block's
    layers unrolled in the body, and the layers past the last whole block unrolled after it (`_scan_blocks`),
    so every layer's kind is a Python value in the program: nothing chooses on data.

    `whole`: the caller's matmul backend reads stacked kernels whole (`Matmul.reads_whole`): the in_out
    projection kernels reach the body as `LayerSlice`s, scanned in blocks as with `kinds`."""
    layers = stack.__dict__.get(UNROLLED_LAYERS)
    if layers is not None:
        ys = []
        for i, layer in enumerate(layers):
            x = None if xs is None else jax.tree.map(lambda a, i=i: a[i], xs)
            carry, y = body(layer, carry, x) if kinds is None else body(layer, carry, x, kinds[i])
            ys.append(y)
        return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)
    graphdef, state = nnx.split(stack)
    whole_kernels = _whole_kernels(stack, state) if whole else None
    if kinds is not None:
        return _scan_blocks(graphdef, state, whole_kernels, body, carry, xs, kinds)
    if whole_kernels is not None:  # the kernels read whole: one kind, blocks of one layer
        n = jax.tree.leaves(state)[0].shape[0]
        return _scan_blocks(graphdef, state, whole_kernels, lambda layer, c, x, _: body(layer, c, x), carry, xs, [None] * n)

    def step(c: Any, per_layer: Any) -> tuple[Any, Any]:
        layer_state, x = per_layer
        return body(nnx.merge(graphdef, layer_state), c, x)

    return jax.lax.scan(step, carry, (state, xs))


def kinds_period(kinds: Sequence[Any]) -> int:
    """The smallest p with kinds[i] == kinds[i % p] for every layer i (len(kinds) when none is shorter)."""
    n = len(kinds)
    return next(p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n)))


def _scan_blocks(graphdef: Any, state: nnx.State, whole: Sequence[str | None] | None, body: Any, carry: Any,
                 xs: Any, kinds: Sequence[Any]) -> tuple[Any, Any]:
    """`scan_layers` with a static kind per layer: `lax.scan` over blocks of `kinds_period(kinds)` layers, each
    block's layers unrolled in the body with their own kind, then the remaining layers unrolled. Each layer
    reads its slices of the stacked leaves by index (what `lax.scan` does with its xs; no leaf is sliced or
    reshaped whole, which would copy the weights), kernels a matmul backend reads whole as `LayerSlice`s."""
    leaves, treedef = jax.tree.flatten(state)
    n = leaves[0].shape[0]
    if len(kinds) != n:
        raise ValueError(f"{len(kinds)} layer kinds for a stack of {n} layers")
    period = kinds_period(kinds)
    blocks = n // period
    names = list(whole) if whole is not None else [None] * len(leaves)

    def at(a: jax.Array, i: Any) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(a, i, keepdims=False)

    def layer(c: Any, i: Any, kind: Any) -> tuple[Any, Any]:
        per = [LayerSlice(x, i, name=w) if w else at(x, i) for x, w in zip(leaves, names, strict=True)]
        x = None if xs is None else jax.tree.map(lambda a: at(a, i), xs)
        return body(nnx.merge(graphdef, jax.tree.unflatten(treedef, per)), c, x, kind)  # type: ignore[no-any-return]

    def block(c: Any, b: jax.Array) -> tuple[Any, Any]:
        ys = []
        for j in range(period):
            c, y = layer(c, b * period + j, kinds[j])
            ys.append(y)
        return c, jax.tree.map(lambda *a: jnp.stack(a), *ys)

    carry, ys = jax.lax.scan(block, carry, jnp.arange(blocks, dtype=jnp.int32))
    ys = jax.tree.map(lambda a: a.reshape(blocks * period, *a.shape[2:]), ys)
    tail = []
    for i in range(blocks * period, n):
        carry, y = layer(carry, jnp.int32(i), kinds[i])
        tail.append(y)
    if tail:
        ys = jax.tree.map(lambda a, *t: jnp.concatenate([a, jnp.stack(t)]), ys, *tail)
    return carry, ys


def _whole_kernels(stack: nnx.Module, state: nnx.State) -> list[str | None] | None:
    """Per state leaf of a stacked layer module, its path ("attn.q_proj.kernel") when it is the kernel of an
    in_out projection (`Dense`, `HeadsProj`, `OutProj`), which a backend with `reads_whole` reads whole with a
    layer index, else None; None when there is no such kernel or the module's scan is not this one
    (`unrollable`)."""
    if not getattr(type(stack), "unrollable", False):
        return None
    paths = _leaf_paths(state)
    kernels = in_out_kernels(stack, paths)
    found = [path if path in kernels else None for path in paths]
    return found if any(found) else None


def _leaf_paths(state: nnx.State) -> list[str]:
    return [".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
            for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def in_out_kernels(stack: nnx.Module, paths: Sequence[str] | None = None) -> dict[str, int]:
    """The in_out projection kernels (`Dense`, `HeadsProj`, `OutProj`) of a stacked layer module, by path
    ("attn.q_proj.kernel"): how many of the kernel's dims after the layer's make its matmul's K (OutProj's
    [heads, head_dim, embed]: 2, else 1). `paths`: the module's leaf paths, where the caller has them."""
    found: dict[str, int] = {}
    for path in _leaf_paths(nnx.state(stack)) if paths is None else paths:
        names = path.split(".")
        owner: Any = stack
        for name in names[:-1]:
            owner = getattr(owner, name, None)
        if names[-1:] == ["kernel"] and isinstance(owner, (Dense, HeadsProj, OutProj)):
            found[path] = 2 if isinstance(owner, OutProj) else 1
    return found
