"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) as a Flax NNX decoder, built from `LlamaConfig`.

The module's NNX state paths are exactly the names of `raydeploy.model.spec.param_specs` (for example
`layers.3.attn.q_proj.kernel`), in the same "input dims first" layouts, so a flat {name: jax.Array} dict from
the checkpoint reader goes straight in: build the module abstractly (`abstract_model`, no allocation), then
`raydeploy.model.state.params_to_state` fills it with the loaded (already sharded) arrays. The engine keeps
`(graphdef, state)` and merges them inside its jitted programs, so no Python runs per layer at serving time.

Two forward paths, both pure and jittable:
- `Llama.ragged(tokens_n, positions_n, attend)`: the engine's path. A flat batch of tokens of many sequences at
  explicit positions; the caller's `attend` owns the KV cache and the ragged layout (the model knows no cache),
  and the new K/V of every layer come back stacked for the caller to write.
- `Llama.prefill(tokens_bt, positions_bt)`: causal attention within [B, T] rows from position 0 (`__call__`:
  scoring and tests).
RoPE follows the Hugging Face convention (rotate_half over [first half | second half] of head_dim).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from raydeploy.config import ConfigError
from raydeploy.model import native, stacked_matmul
from raydeploy.model.registry import LLAMA
from raydeploy.model.sharding import partition_spec
from raydeploy.model.spec import (
    KERNEL_LAYOUTS,
    DecoderShape,
    LlamaConfig,
    TensorSpec,
    stacked_param_specs,
)
from raydeploy.model.state import path_name

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# -- activation sharding --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActivationSharding:
    """Pins activations to the mesh by logical axis names (act_batch, act_seq, act_embed, act_vocab)."""

    mesh: Any
    rules: tuple[tuple[str, Any], ...]

    @classmethod
    def create(cls, mesh: jax.sharding.Mesh, rules: Mapping[str, Any]) -> ActivationSharding:
        return cls(mesh, tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in rules.items()))

    @property
    def slot_axes(self) -> tuple[str, ...]:
        """Mesh axes that shard the KV cache's slot axis (logical `cache_batch`)."""
        d = partition_spec(("cache_batch",), dict(self.rules), dict(self.mesh.shape), "kv_cache")[0]
        return () if d is None else ((d,) if isinstance(d, str) else tuple(d))

    @property
    def slot_groups(self) -> int:
        """Shards of the slot axis: each holds one group of consecutive slots."""
        return math.prod(dict(self.mesh.shape)[a] for a in self.slot_axes)

    def constrain(self, x: jax.Array, logical_axes: Sequence[str | None], strict: bool = True) -> jax.Array:
        """Pin x's layout; with strict=False, axes whose rules collide leave x as it is (a hint, not a rule)."""
        from jax.sharding import NamedSharding, PartitionSpec

        rules = dict(self.rules)
        rules["_none"] = None
        mesh_shape = dict(self.mesh.shape)
        axes = [a if a is not None else "_none" for a in logical_axes]
        try:
            spec = partition_spec(axes, rules, mesh_shape, "activation")
        except ConfigError:
            if strict:
                raise
            return x
        # A dimension that does not divide its mesh axes (batch 1 in a prefill over dp=2) stays replicated.
        dims = []
        for size, d in zip(x.shape, spec, strict=True):
            names = () if d is None else ((d,) if isinstance(d, str) else tuple(d))
            n = math.prod(mesh_shape[a] for a in names)
            dims.append(d if n <= 1 or size % n == 0 else None)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(*dims)))


def _constrain(shard: ActivationSharding | None, x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    return x if shard is None else shard.constrain(x, axes)


# -- rotary embeddings ------------------------------------------------------------------------------------


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """Inverse frequencies [head_dim / 2] with the config's rope scaling (none, linear, llama3, freq_factors)."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return inv.astype(np.float32)
    if kind == "linear":
        return (inv / float(scaling["factor"])).astype(np.float32)
    if kind == "freq_factors":  # llama.cpp's rope_freqs (a Llama 3 GGUF): a divisor per frequency
        factors = np.asarray(scaling["factors"], np.float64)
        if factors.shape != inv.shape:
            raise ValueError(f"rope_scaling freq_factors: {factors.size} factors for {inv.size} frequencies "
                             f"(head_dim / 2)")
        return (inv / factors).astype(np.float32)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3, "
                     f"freq_factors)")


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """x [..., heads, head_dim] at integer positions [...] (broadcast over heads); HF rotate_half layout."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., hd/2]
    cos = jnp.cos(freqs)[..., None, :]
    sin = jnp.sin(freqs)[..., None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# -- layers -------------------------------------------------------------------------------------------------


def _matmul(x: jax.Array, w: jax.Array, out_first: bool = False) -> jax.Array:
    """x [..., K] times a 2-D weight, in x's dtype: w is [K, N] (in_out) or, with out_first, [N, K] (out_in).

    Lower-precision weights (bfloat16 params, float32 activations) multiply natively with float32
    accumulation: casting the weight up instead would rewrite it every step on XLA CPU.

    Inside an engine step that asked for it (`native.rows_over`), few float32 rows go to the native CPU kernel;
    on a GPU (`stacked_matmul.rows_over`), few rows times a layer of bfloat16 weights go to a Pallas kernel. In
    either, w may be a `native.LayerSlice` (one layer of the stacked weight, passed whole)."""
    if (y := native.matmul(x, w, out_first)) is not None:
        return y
    if (y := stacked_matmul.matmul(x, w, out_first)) is not None:
        return y
    if isinstance(w, native.LayerSlice):
        w = w.materialize()
    xw = x if w.dtype == x.dtype else x.astype(w.dtype)
    dims = (((x.ndim - 1,), (1 if out_first else 0,)), ((), ()))
    return jax.lax.dot_general(xw, w, dims, preferred_element_type=x.dtype)


def _param(rngs: nnx.Rngs | None, shape: tuple[int, ...], dtype: Any, std: float = 0.02) -> nnx.Param:
    """A parameter of `shape` (with the stacked layer dims already in front): zeros, or random with `rngs`."""
    if rngs is None:
        return nnx.Param(jnp.zeros(shape, dtype))
    return nnx.Param((std * jax.random.normal(rngs.params(), shape)).astype(dtype))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype: Any, rngs: nnx.Rngs | None = None,
                 lead: tuple[int, ...] = ()) -> None:
        self.scale = nnx.Param(jnp.ones((*lead, dim), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class HeadsProj(nnx.Module):
    """[.., embed] -> [.., heads, head_dim]; kernel [embed, heads, head_dim] (out_first: [heads, head_dim,
    embed]), optional bias [heads, head_dim]."""

    def __init__(self, d: int, heads: int, hd: int, bias: bool, param_dtype: Any, rngs: nnx.Rngs | None,
                 out_first: bool = False, lead: tuple[int, ...] = ()) -> None:
        self.kernel = _param(rngs, (*lead, *((heads, hd, d) if out_first else (d, heads, hd))), param_dtype)
        self.bias = _param(rngs, (*lead, heads, hd), param_dtype) if bias else None
        self.out_first = out_first

    def weight2d(self) -> Any:
        """The kernel over the flattened heads: [embed, heads * head_dim] (out_first: transposed)."""
        n, h = self.kernel.shape[:2] if self.out_first else self.kernel.shape[1:]
        d = self.kernel.shape[2] if self.out_first else self.kernel.shape[0]
        # A 2-D matmul over the flattened heads is about 2x faster than the 3-D einsum on XLA CPU.
        return self.kernel[...].reshape((n * h, d) if self.out_first else (d, n * h))

    def finish(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """x's flat projection y -> [.., heads, head_dim], plus the bias."""
        n, h = self.kernel.shape[:2] if self.out_first else self.kernel.shape[1:]
        y = y.reshape(*x.shape[:-1], n, h)
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        return y

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.finish(x, _matmul(x, self.weight2d(), self.out_first))


class OutProj(nnx.Module):
    """[.., heads, head_dim] -> [.., embed]; kernel [heads, head_dim, embed] (out_first: [embed, heads,
    head_dim])."""

    def __init__(self, heads: int, hd: int, d: int, param_dtype: Any, rngs: nnx.Rngs | None,
                 out_first: bool = False, lead: tuple[int, ...] = ()) -> None:
        self.kernel = _param(rngs, (*lead, *((d, heads, hd) if out_first else (heads, hd, d))), param_dtype)
        self.out_first = out_first

    def __call__(self, x: jax.Array) -> jax.Array:
        n, h = x.shape[-2:]
        w = self.kernel[...].reshape((-1, n * h) if self.out_first else (n * h, -1))
        return _matmul(x.reshape(*x.shape[:-2], n * h), w, self.out_first)


class Dense(nnx.Module):
    """[.., din] -> [.., dout]; kernel [din, dout] (out_first: [dout, din])."""

    def __init__(self, din: int, dout: int, param_dtype: Any, rngs: nnx.Rngs | None, out_first: bool = False,
                 lead: tuple[int, ...] = ()) -> None:
        self.kernel = _param(rngs, (*lead, *((dout, din) if out_first else (din, dout))), param_dtype)
        self.out_first = out_first

    def weight2d(self) -> Any:
        return self.kernel[...]

    def finish(self, x: jax.Array, y: jax.Array) -> jax.Array:
        return y

    def __call__(self, x: jax.Array) -> jax.Array:
        return _matmul(x, self.kernel[...], self.out_first)


def project(x: jax.Array, projections: Sequence[HeadsProj | Dense]) -> list[jax.Array]:
    """Each projection of the same x (a layer's q, k, v, or gate and up): in one native kernel call inside an
    engine step that runs it (in_out weights; `native.matmuls`), else one matmul each."""
    if not any(m.out_first for m in projections):
        ys = native.matmuls(x, [m.weight2d() for m in projections])
        if ys is not None:
            return [m.finish(x, y) for m, y in zip(projections, ys, strict=True)]
    return [m(x) for m in projections]


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, param_dtype: Any, rngs: nnx.Rngs | None, out_first: bool = False,
                 lead: tuple[int, ...] = ()) -> None:
        d, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = HeadsProj(d, nh, hd, cfg.attention_bias, param_dtype, rngs, out_first, lead)
        self.k_proj = HeadsProj(d, nkv, hd, cfg.attention_bias, param_dtype, rngs, out_first, lead)
        self.v_proj = HeadsProj(d, nkv, hd, cfg.attention_bias, param_dtype, rngs, out_first, lead)
        self.o_proj = OutProj(nh, hd, d, param_dtype, rngs, out_first, lead)

    def qkv(self, x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, ...]:
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj))
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


class MLP(nnx.Module):
    def __init__(self, cfg: DecoderShape, param_dtype: Any, rngs: nnx.Rngs | None, out_first: bool = False,
                 lead: tuple[int, ...] = ()) -> None:
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Dense(d, f, param_dtype, rngs, out_first, lead)
        self.up_proj = Dense(d, f, param_dtype, rngs, out_first, lead)
        self.down_proj = Dense(f, d, param_dtype, rngs, out_first, lead)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = project(x, (self.gate_proj, self.up_proj))
        return self.down_proj(jax.nn.silu(gate) * up)


class DecoderLayer(nnx.Module):
    """One decoder layer; with `lead=(L,)` every parameter holds L layers stacked, and `scan_layers` runs a
    body over them one layer at a time."""

    unrollable = True
    """`scan` goes through `scan_layers`, so `unroll_layers` applies."""

    def __init__(self, cfg: LlamaConfig, param_dtype: Any, rngs: nnx.Rngs | None, out_first: bool = False,
                 lead: tuple[int, ...] = ()) -> None:
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype, lead=lead)
        self.attn = Attention(cfg, param_dtype, rngs, out_first, lead)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype, lead=lead)
        self.mlp = MLP(cfg, param_dtype, rngs, out_first, lead)

    def scan(self, body: Any, carry: Any, xs: Any = None, kinds: Sequence[Any] | None = None) -> tuple[Any, Any]:
        """`lax.scan` of body(layer, carry, x) -> (carry, y) over the stacked layers (and over xs, if given):
        one traced layer, so a program's size and compile time do not grow with depth (`scan_layers`, which
        also says what `kinds` does)."""
        return scan_layers(self, body, carry, xs, kinds)


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
                kinds: Sequence[Any] | None = None) -> tuple[Any, Any]:
    """body(layer, carry, x) -> (carry, y) over a stacked layer module: `lax.scan` over its per-layer slices,
    or, after `unroll_layers`, a loop over the per-layer modules. ys come back stacked either way.

    `kinds`: one static (hashable) value per layer, passed to the body as a fourth argument,
    body(layer, carry, x, kind). The layers are then scanned in blocks of the kinds' period, the block's
    layers unrolled in the body, and the layers past the last whole block unrolled after it (`_scan_blocks`),
    so every layer's kind is a Python value in the program: nothing chooses on data."""
    layers = stack.__dict__.get(UNROLLED_LAYERS)
    if layers is not None:
        ys = []
        for i, layer in enumerate(layers):
            x = None if xs is None else jax.tree.map(lambda a, i=i: a[i], xs)
            carry, y = body(layer, carry, x) if kinds is None else body(layer, carry, x, kinds[i])
            ys.append(y)
        return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)
    graphdef, state = nnx.split(stack)
    whole = _whole_kernels(stack, state) if native.active() or stacked_matmul.active() else None
    if kinds is not None:
        return _scan_blocks(graphdef, state, whole, body, carry, xs, kinds)
    if whole is not None:  # the kernels read whole: one kind, blocks of one layer
        n = jax.tree.leaves(state)[0].shape[0]
        return _scan_blocks(graphdef, state, whole, lambda layer, c, x, _: body(layer, c, x), carry, xs, [None] * n)

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
    reshaped whole, which would copy the weights), kernels the native matmul reads whole as `LayerSlice`s."""
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
        per = [native.LayerSlice(x, i, name=w) if w else at(x, i) for x, w in zip(leaves, names, strict=True)]
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
    in_out projection (`Dense`, `HeadsProj`, `OutProj`), which the native and stacked matmuls read whole with a
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
        if names[-1:] == ["kernel"] and isinstance(owner, (Dense, HeadsProj, OutProj)) and not owner.out_first:
            found[path] = 2 if isinstance(owner, OutProj) else 1
    return found


EMBEDDING = "embed.embedding"
"""The embedding table's parameter name (read as the LM head where the family ties them)."""


class Embed(nnx.Module):
    def __init__(self, vocab: int, d: int, param_dtype: Any, rngs: nnx.Rngs | None) -> None:
        self.embedding = _param(rngs, (vocab, d), param_dtype)


# -- attention kernels (plain XLA; masks from explicit positions, never from token ids) ----------------------


def _attend(q_btnh: jax.Array, k_bksh: jax.Array, v_bksh: jax.Array, mask_bts: jax.Array) -> jax.Array:
    """Grouped-query attention: q [B,T,N,H], head-major k/v [B,K,S,H], boolean mask [B,T,S] -> [B,T,N,H].

    Both products batch over (B, K) and read k/v in their stored layout: the scores contract k's minor
    dimension, the output contracts its positions; only the small q and output are transposed."""
    b, t, n, h = q_btnh.shape
    kv = k_bksh.shape[1]
    q = q_btnh.reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum("btkgh,bksh->bkgts", q, k_bksh).astype(jnp.float32) / math.sqrt(h)
    scores = jnp.where(mask_bts[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bksh.dtype)
    out = jnp.einsum("bkgts,bksh->btkgh", probs, v_bksh)
    return out.reshape(b, t, n, h)


def _window_mask(q_pos_bt: jax.Array, k_pos_bs: jax.Array, sliding_window: int | None) -> jax.Array:
    mask = k_pos_bs[:, None, :] <= q_pos_bt[:, :, None]
    if sliding_window:
        mask &= k_pos_bs[:, None, :] > q_pos_bt[:, :, None] - sliding_window
    return mask


# -- the model -------------------------------------------------------------------------------------------------


class Llama(nnx.Module):
    """Llama-family decoder; state paths = `param_specs(cfg)` names, kernels in `kernel_layout`
    (in_out: `param_specs` shapes; out_in: `out_in_spec` shapes)."""

    def __init__(self, cfg: LlamaConfig, dtype: str = "float32", param_dtype: str = "float32",
                 rngs: nnx.Rngs | None = None, kernel_layout: str = "in_out") -> None:
        if kernel_layout not in KERNEL_LAYOUTS:
            raise ValueError(f"kernel_layout must be one of {', '.join(KERNEL_LAYOUTS)}, got {kernel_layout!r}")
        pdt = DTYPES[param_dtype]
        of = kernel_layout == "out_in"
        self.cfg = cfg
        self.dtype = DTYPES[dtype]
        self.inv_freq = rope_inv_freq(cfg).tolist()  # a plain list: static, hashable graph metadata
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, pdt, rngs)
        self.layers = DecoderLayer(cfg, pdt, rngs, of, lead=(cfg.num_layers,))  # stacked: one scan over them
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt)
        self.lm_head = None if cfg.tie_word_embeddings else Dense(cfg.hidden_size, cfg.vocab_size, pdt, rngs, of)

    # -- pieces
    def _embed(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embed.embedding[...], tokens, axis=0).astype(self.dtype)

    def logits(self, h: jax.Array, shard: ActivationSharding | None = None) -> jax.Array:
        """Final norm + LM head: h [..., D] -> float32 logits [..., V]."""
        h = self.final_norm(h)
        if self.lm_head is not None:
            out = self.lm_head(h)
        else:
            emb: Any = self.embed.embedding[...]
            if native.active():  # named, so the native kernel can read its packed copy (`engine.pack_weights`)
                emb = native.LayerSlice(emb[None], jnp.zeros((), jnp.int32), name=EMBEDDING)
            out = _matmul(h, emb, out_first=True)  # [..., D] x [V, D]
        if out.ndim == 2 and shard is not None:
            # Compute the logits where the vocabulary shards of the weight live, then lay them out as the
            # activations ask: otherwise XLA gathers the whole [V, D] weight to every device each step.
            out = shard.constrain(out, ("act_batch", "vocab"), strict=False)
        out = out.astype(jnp.float32)
        if out.ndim == 2:
            out = _constrain(shard, out, ("act_batch", "act_vocab"))
        return out

    # -- prefill: attention within one chunk starting at position 0 of each row
    def prefill(self, tokens_bt: jax.Array, positions_bt: jax.Array,
                shard: ActivationSharding | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Causal forward over [B, T] tokens; returns hidden [B,T,D] and every layer's K and V, stacked and
        head-major like the cache: [L,B,K,T,H]."""
        inv = np.asarray(self.inv_freq, np.float32)
        x = _constrain(shard, self._embed(tokens_bt), ("act_batch", "act_seq", "act_embed"))
        mask = _window_mask(positions_bt, positions_bt, self.cfg.sliding_window)

        def body(layer: DecoderLayer, x: jax.Array, _: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            q, k, v = layer.attn.qkv(layer.attn_norm(x), positions_bt, inv)
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
            x = x + layer.attn.o_proj(_attend(q, k, v, mask))
            x = _constrain(shard, x + layer.mlp(layer.mlp_norm(x)), ("act_batch", "act_seq", "act_embed"))
            return x, (k, v)

        x, (ks, vs) = self.layers.scan(body, x)
        return x, ks, vs

    # -- ragged: the tokens of many sequences in one flat batch, attention supplied by the caller
    def ragged(self, tokens_n: jax.Array, positions_n: jax.Array, attend: Any,
               shard: ActivationSharding | None = None, cache: Any = None, static_kinds: bool = False
               ) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
        """Forward over a flat batch of N tokens at explicit positions; the model knows no cache layout.

        `attend(layer, q [N, Hq, H], k [N, Hkv, H], v [N, Hkv, H], cache) -> (out [N, Hq, H], cache)` is called
        (with `sliding_window=` when the config sets one) once per layer inside the layer scan (`layer` is the
        traced layer index): it owns the KV cache and the ragged layout. A family whose layers differ in kind
        inside the scan also passes `local=`, a traced bool: the window applies only where it holds (Gemma 3),
        unless the caller asks for `static_kinds` (every layer's kind a Python value: a program that chooses
        nothing on data; Llama's layers are all of one kind, so it changes nothing here). `cache` is carried
        through the scan (None: nothing carried). Returns the hidden states [N, D], every layer's new K and V
        stacked ([L, N, Hkv, H] each, for a caller that writes them after the scan) and the carried cache."""
        inv = np.asarray(self.inv_freq, np.float32)
        x = _constrain(shard, self._embed(tokens_n), ("act_batch", "act_embed"))
        # Mistral-style configs: every layer attends within the window (static, passed to the backend)
        kw = {"sliding_window": int(self.cfg.sliding_window)} if self.cfg.sliding_window else {}

        def body(layer: DecoderLayer, carry: tuple[jax.Array, Any], i: jax.Array
                 ) -> tuple[tuple[jax.Array, Any], tuple[jax.Array, ...]]:
            x, c = carry
            q, k, v = layer.attn.qkv(layer.attn_norm(x), positions_n, inv)
            out, c = attend(i, q, k, v, c, **kw)
            x = x + layer.attn.o_proj(out)
            x = _constrain(shard, x + layer.mlp(layer.mlp_norm(x)), ("act_batch", "act_embed"))
            return (x, c), (k, v)

        layer_ids = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
        (x, cache), (ks, vs) = self.layers.scan(body, (x, cache), layer_ids)
        return x, ks, vs, cache

    def __call__(self, tokens_bt: jax.Array) -> jax.Array:
        """Plain causal forward from position 0: float32 logits [B, T, V] (for tests and scoring)."""
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1])[None], tokens_bt.shape)
        h, _, _ = self.prefill(tokens_bt, positions)
        return self.logits(h)


# -- building the model from a flat {name: array} dict -----------------------------------------------------


def abstract_model(cfg: LlamaConfig, dtype: str = "float32", param_dtype: str = "float32",
                   kernel_layout: str = "in_out") -> tuple[nnx.GraphDef, nnx.State]:
    """The Llama model's graphdef and abstract state (`Family.abstract_model` of the llama family)."""
    return _llama().abstract_model(cfg, dtype, param_dtype, kernel_layout)  # type: ignore[no-any-return]


def _llama() -> Any:
    return LLAMA


def check_state_names(cfg: LlamaConfig) -> None:
    """Assert that the NNX state paths are exactly `stacked_param_specs(cfg)` with the same shapes."""
    _, abstract = abstract_model(cfg)
    got = {path_name(p): tuple(v.shape) for p, v in nnx.to_flat_state(abstract)}
    want = {n: s.shape for n, s in stacked_param_specs(cfg).items()}
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))[:5]
        raise AssertionError(f"model state and stacked_param_specs disagree: {diff}")


def build_model(cfg: LlamaConfig, params: Mapping[str, jax.Array], dtype: str = "float32",
                param_dtype: str = "float32", kernel_layout: str = "in_out") -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of a Llama holding `params` (`Family.build_model` of the llama family)."""
    return _llama().build_model(cfg, params, dtype, param_dtype, kernel_layout)  # type: ignore[no-any-return]


def engine_param_specs(cfg: LlamaConfig, kernel_layout: str = "in_out") -> dict[str, TensorSpec]:
    """The parameters as an engine holds them (`Family.engine_param_specs` of the llama family)."""
    return _llama().engine_param_specs(cfg, kernel_layout)  # type: ignore[no-any-return]


def stack_layers(cfg: LlamaConfig, params: Mapping[str, jax.Array], kernel_layout: str = "in_out",
                 mesh: jax.sharding.Mesh | None = None, rules: Mapping[str, Any] | None = None
                 ) -> dict[str, jax.Array]:
    """Checkpoint params -> the engine's stacked ones (`Family.stack_layers` of the llama family)."""
    return _llama().stack_layers(cfg, params, kernel_layout, mesh, rules)  # type: ignore[no-any-return]
