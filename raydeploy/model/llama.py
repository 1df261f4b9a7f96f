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
from raydeploy.lora.batched import LoraRows, adapt, at_layer
from raydeploy.model.projection import Dense, HeadsProj, Matmul, OutProj, _param, dot, project
from raydeploy.model.registry import LLAMA
from raydeploy.model.scan import scan_layers
from raydeploy.model.sharding import partition_spec
from raydeploy.model.spec import (
    DecoderShape,
    LlamaConfig,
    TensorSpec,
    stacked_param_specs,
)
from raydeploy.model.state import path_name

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


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


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype: Any, rngs: nnx.Rngs | None = None,
                 lead: tuple[int, ...] = ()) -> None:
        self.scale = nnx.Param(jnp.ones((*lead, dim), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, param_dtype: Any, rngs: nnx.Rngs | None,
                 lead: tuple[int, ...] = ()) -> None:
        d, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = HeadsProj(d, nh, hd, cfg.attention_bias, param_dtype, rngs, lead)
        self.k_proj = HeadsProj(d, nkv, hd, cfg.attention_bias, param_dtype, rngs, lead)
        self.v_proj = HeadsProj(d, nkv, hd, cfg.attention_bias, param_dtype, rngs, lead)
        self.o_proj = OutProj(nh, hd, d, param_dtype, rngs, lead)

    def qkv(self, x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, mm: Matmul | None = None,
            lora: LoraRows | None = None) -> tuple[jax.Array, ...]:
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj), mm, lora, QKV)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


class MLP(nnx.Module):
    def __init__(self, cfg: DecoderShape, param_dtype: Any, rngs: nnx.Rngs | None,
                 lead: tuple[int, ...] = ()) -> None:
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Dense(d, f, param_dtype, rngs, lead)
        self.up_proj = Dense(d, f, param_dtype, rngs, lead)
        self.down_proj = Dense(f, d, param_dtype, rngs, lead)

    def __call__(self, x: jax.Array, mm: Matmul | None = None, lora: LoraRows | None = None) -> jax.Array:
        gate, up = project(x, (self.gate_proj, self.up_proj), mm, lora, GATE_UP)
        h = jax.nn.silu(gate) * up
        return adapt(lora, "down_proj", h, self.down_proj(h, mm))


class DecoderLayer(nnx.Module):
    """One decoder layer; with `lead=(L,)` every parameter holds L layers stacked, and `scan_layers` runs a
    body over them one layer at a time."""

    unrollable = True
    """`scan` goes through `scan_layers`, so `unroll_layers` applies."""

    def __init__(self, cfg: LlamaConfig, param_dtype: Any, rngs: nnx.Rngs | None,
                 lead: tuple[int, ...] = ()) -> None:
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype, lead=lead)
        self.attn = Attention(cfg, param_dtype, rngs, lead)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype, lead=lead)
        self.mlp = MLP(cfg, param_dtype, rngs, lead)

    def scan(self, body: Any, carry: Any, xs: Any = None, kinds: Sequence[Any] | None = None,
             whole: bool = False) -> tuple[Any, Any]:
        """`lax.scan` of body(layer, carry, x) -> (carry, y) over the stacked layers (and over xs, if given):
        one traced layer, so a program's size and compile time do not grow with depth (`scan_layers`, which
        also says what `kinds` and `whole` do)."""
        return scan_layers(self, body, carry, xs, kinds, whole)


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
    """Llama-family decoder; state paths = `param_specs(cfg)` names, kernels in_out as `param_specs` declares them
    (an engine that holds them out_in wraps them at load: `raydeploy.model.projection.OutIn`)."""

    def __init__(self, cfg: LlamaConfig, dtype: str = "float32", param_dtype: str = "float32",
                 rngs: nnx.Rngs | None = None) -> None:
        pdt = DTYPES[param_dtype]
        self.cfg = cfg
        self.dtype = DTYPES[dtype]
        self.inv_freq = rope_inv_freq(cfg).tolist()  # a plain list: static, hashable graph metadata
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, pdt, rngs)
        self.layers = DecoderLayer(cfg, pdt, rngs, lead=(cfg.num_layers,))  # stacked: one scan over them
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt)
        self.lm_head = None if cfg.tie_word_embeddings else Dense(cfg.hidden_size, cfg.vocab_size, pdt, rngs)

    # -- pieces
    def _embed(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embed.embedding[...], tokens, axis=0).astype(self.dtype)

    def logits(self, h: jax.Array, shard: ActivationSharding | None = None, matmul: Matmul | None = None
               ) -> jax.Array:
        """Final norm + LM head: h [..., D] -> float32 logits [..., V]; `matmul`: the backend (None: XLA's dot)."""
        h = self.final_norm(h)
        if self.lm_head is not None:
            out = self.lm_head(h, matmul)
        elif matmul is None:
            out = dot(h, self.embed.embedding[...], out_first=True)  # [..., D] x [V, D]
        else:
            out = matmul.tied_head(h, self.embed.embedding[...])
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
               shard: ActivationSharding | None = None, cache: Any = None, static_kinds: bool = False,
               matmul: Matmul | None = None, lora: LoraRows | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
        """Forward over a flat batch of N tokens at explicit positions; the model knows no cache layout.
        `matmul`: the backend every projection multiplies with (`raydeploy.model.projection`; None: XLA's dot).
        `lora`: the step's adapters, one slot (or none) per token (`raydeploy.lora.batched`; None: no adapter
        term is traced at all).

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
            lo = at_layer(lora, i)
            q, k, v = layer.attn.qkv(layer.attn_norm(x), positions_n, inv, matmul, lo)
            out, c = attend(i, q, k, v, c, **kw)
            x = x + adapt(lo, "o_proj", out, layer.attn.o_proj(out, matmul))
            mlp_kw = {} if lo is None else {"lora": lo}
            x = _constrain(shard, x + layer.mlp(layer.mlp_norm(x), matmul, **mlp_kw), ("act_batch", "act_embed"))
            return (x, c), (k, v)

        layer_ids = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
        whole = matmul is not None and matmul.reads_whole
        (x, cache), (ks, vs) = self.layers.scan(body, (x, cache), layer_ids, whole=whole)
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
