"""The Gemma 3 family (text decoder, `model_type: gemma3_text`) as a Flax NNX decoder.

What differs from Llama:
- RMSNorms scale by (1 + weight) (the checkpoint stores the raw weight);
- four norms per layer: before and after attention, before and after the feed-forward (GeGLU: gelu-tanh gate);
- an RMSNorm over each query and key head before RoPE;
- embeddings multiplied by sqrt(hidden_size);
- local sliding-window layers alternating with global ones (`layer_types`, or the older `sliding_window_pattern`),
  each kind with its own RoPE (`rope_parameters` per layer type; older configs: rope_theta / rope_scaling for the
  global layers, rope_local_base_freq for the local ones);
- attention scores scaled by query_pre_attn_scalar**-0.5 instead of head_dim**-0.5 (applied to q, so a
  caller's attention keeps its head_dim**-0.5);
- soft-capping of the final logits (final_logit_softcapping) and of the attention scores (attn_logit_softcapping,
  passed to the attention as `soft_cap`) where the config sets them.

The layers are stacked and scanned like Llama's; whether a layer is local is a per-layer flag scanned with
them. In the engine's path (`ragged`) every layer's attention call passes the static `sliding_window=` and
the traced `local=` flag, and the caller applies the window where the flag holds: it writes the K/V outside
any cond and chooses only the read (a `lax.cond` between two whole calls carried the KV pool through its
branches, and XLA copied the pool twice a step). Forward paths and their contracts are Llama's (`ragged`,
`prefill`, `logits`, `__call__`); `attend` also receives `soft_cap=` when set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp

from raydeploy.lora.batched import LoraRows, adapt, at_layer
from raydeploy.model.llama import (
    DTYPES,
    GATE_UP,
    MLP,
    QKV,
    ActivationSharding,
    Embed,
    RMSNorm,
    _constrain,
    apply_rope,
    rope_inv_freq,
)
from raydeploy.model.names import COPY, GGUF_NORM_PLUS_ONE, KV_BIAS, KV_OI, LINEAR_OI, O_OI, Q_BIAS, Q_OI
from raydeploy.model.projection import Dense, HeadsProj, Matmul, OutProj, project
from raydeploy.model.registry import Family
from raydeploy.model.scan import scan_layers
from raydeploy.model.spec import TensorSpec, param_specs, with_layer_tensors

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class Gemma3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    rope_theta: float = 1_000_000.0              # global layers
    rope_scaling: dict[str, Any] | None = None   # global layers
    rope_local_theta: float = 10_000.0
    query_pre_attn_scalar: float = 256.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    model_type: str = "gemma3_text"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def local_layers(self) -> tuple[bool, ...]:
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Gemma3Config:
        if d.get("use_bidirectional_attention"):
            raise ValueError("gemma3_text: use_bidirectional_attention=true (an encoder) is not supported")
        act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"gemma3_text: hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        n = int(d["num_hidden_layers"])
        types = d.get("layer_types")
        if types is None:
            pattern = int(d.get("sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        bad = sorted(set(types) - set(LAYER_TYPES))
        if bad or len(types) != n:
            raise ValueError(f"gemma3_text: layer_types must be {n} entries of {', '.join(LAYER_TYPES)}, got "
                             f"{len(types)} with {bad or 'valid names'}")
        rp = d.get("rope_parameters") or {}
        if "full_attention" in rp or "sliding_attention" in rp:
            glob, loc = dict(rp.get("full_attention") or {}), dict(rp.get("sliding_attention") or {})
        else:
            glob = dict(d.get("rope_scaling") or {})
            glob["rope_theta"] = d.get("rope_theta", rp.get("rope_theta", 1_000_000.0))
            loc = {"rope_theta": d.get("rope_local_base_freq", 10_000.0)}
        if loc.get("rope_type", "default") != "default":
            raise ValueError(f"gemma3_text: rope type {loc['rope_type']!r} on the sliding layers is not supported")
        kind = glob.get("rope_type", glob.get("type", "default"))
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        eos = d.get("eos_token_id")
        window = d.get("sliding_window")
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=n,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            layer_types=tuple(types),
            sliding_window=None if window is None else int(window),
            rope_theta=float(glob.get("rope_theta", 1_000_000.0)),
            rope_scaling=None if kind in (None, "default") else glob,
            rope_local_theta=float(loc.get("rope_theta", 10_000.0)),
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 131072)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            attention_bias=bool(d.get("attention_bias", False)),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            attn_logit_softcapping=d.get("attn_logit_softcapping"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            pad_token_id=d.get("pad_token_id"),
            model_type=str(d.get("model_type", "gemma3_text")),
        )


def gemma3_param_specs(cfg: Gemma3Config) -> dict[str, TensorSpec]:
    """Llama's parameters plus, in each layer, a per-head q and k norm after the q/k/v projections and a norm
    after the attention and after the MLP (Gemma 3 normalizes each block's output as well as its input)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    norms = [(f"attn.{n}_norm.scale", (hd,), ("norm",)) for n in "qk"]
    return with_layer_tensors(param_specs(cfg), {
        "attn.v_proj.bias" if cfg.attention_bias else "attn.v_proj.kernel": norms,
        "attn.o_proj.kernel": [("post_attn_norm.scale", (d,), ("norm",))],
        "mlp.down_proj.kernel": [("post_mlp_norm.scale", (d,), ("norm",))],
    })


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaling by (1 + weight), in float32."""

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


class Gemma3Attention(nnx.Module):
    def __init__(self, cfg: Gemma3Config, param_dtype: Any, rngs: nnx.Rngs | None,
                 lead: tuple[int, ...] = ()) -> None:
        d, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = HeadsProj(d, nh, hd, cfg.attention_bias, param_dtype, rngs, lead)
        self.k_proj = HeadsProj(d, nkv, hd, cfg.attention_bias, param_dtype, rngs, lead)
        self.v_proj = HeadsProj(d, nkv, hd, cfg.attention_bias, param_dtype, rngs, lead)
        self.q_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps, param_dtype, lead=lead)
        self.k_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps, param_dtype, lead=lead)
        self.o_proj = OutProj(nh, hd, d, param_dtype, rngs, lead)

    def qkv(self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array, q_scale: float,
            mm: Matmul | None = None, lora: LoraRows | None = None) -> tuple[jax.Array, ...]:
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj), mm, lora, QKV)
        q = apply_rope(self.q_norm(q), positions, inv_freq)  # type: ignore[arg-type]
        k = apply_rope(self.k_norm(k), positions, inv_freq)  # type: ignore[arg-type]
        if q_scale != 1.0:
            q = (q.astype(jnp.float32) * q_scale).astype(q.dtype)
        return q, k, v


class Gemma3MLP(MLP):
    """Llama's MLP with a tanh-approximated GELU."""

    def __call__(self, x: jax.Array, mm: Matmul | None = None, lora: LoraRows | None = None) -> jax.Array:
        gate, up = project(x, (self.gate_proj, self.up_proj), mm, lora, GATE_UP)
        h = jax.nn.gelu(gate, approximate=True) * up
        return adapt(lora, "down_proj", h, self.down_proj(h, mm))


class Gemma3Layer(nnx.Module):
    unrollable = True  # `scan` goes through `scan_layers`

    def __init__(self, cfg: Gemma3Config, param_dtype: Any, rngs: nnx.Rngs | None,
                 lead: tuple[int, ...] = ()) -> None:
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn_norm = GemmaRMSNorm(d, eps, param_dtype, lead=lead)
        self.attn = Gemma3Attention(cfg, param_dtype, rngs, lead)
        self.post_attn_norm = GemmaRMSNorm(d, eps, param_dtype, lead=lead)
        self.mlp_norm = GemmaRMSNorm(d, eps, param_dtype, lead=lead)
        self.mlp = Gemma3MLP(cfg, param_dtype, rngs, lead)
        self.post_mlp_norm = GemmaRMSNorm(d, eps, param_dtype, lead=lead)

    def feed_forward(self, x: jax.Array, mm: Matmul | None = None, lora: LoraRows | None = None) -> jax.Array:
        return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x), mm, lora))

    def scan(self, body: Any, carry: Any, xs: Any = None, kinds: Any = None, whole: bool = False
             ) -> tuple[Any, Any]:
        """`lax.scan` of body(layer, carry, x) over the stacked layers (as `DecoderLayer.scan`)."""
        return scan_layers(self, body, carry, xs, kinds, whole)


def _dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                     soft_cap: float | None) -> jax.Array:
    """q [B,T,N,H], k/v [B,T,K,H], mask [B,T,S] -> [B,T,N,H] (grouped-query)."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, n // kv, h)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k).astype(jnp.float32) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(b, t, n, h)


class Gemma3(nnx.Module):
    """Gemma 3 text decoder; state paths = the stacked `gemma3_param_specs` names."""

    def __init__(self, cfg: Gemma3Config, dtype: str = "float32", param_dtype: str = "float32",
                 rngs: nnx.Rngs | None = None) -> None:
        pdt = DTYPES[param_dtype]
        self.cfg = cfg
        self.dtype = DTYPES[dtype]
        glob = SimpleNamespace(head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling)
        loc = SimpleNamespace(head_dim=cfg.head_dim, rope_theta=cfg.rope_local_theta, rope_scaling=None)
        self.inv_freq = rope_inv_freq(glob).tolist()  # type: ignore[arg-type]
        self.inv_freq_local = rope_inv_freq(loc).tolist()  # type: ignore[arg-type]
        # q is scaled by this so that attention with head_dim**-0.5 scores q.k / sqrt(query_pre_attn_scalar)
        self.q_scale = math.sqrt(cfg.head_dim / cfg.query_pre_attn_scalar)
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, pdt, rngs)
        self.layers = Gemma3Layer(cfg, pdt, rngs, lead=(cfg.num_layers,))
        self.final_norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt)
        self.lm_head = None if cfg.tie_word_embeddings else Dense(cfg.hidden_size, cfg.vocab_size, pdt, rngs)

    # -- pieces
    def _embed(self, tokens: jax.Array) -> jax.Array:
        emb = self.embed.embedding[...]
        x = jnp.take(emb, tokens, axis=0) * jnp.asarray(math.sqrt(self.cfg.hidden_size), emb.dtype)
        return x.astype(self.dtype)

    @property
    def _local(self) -> tuple[bool, ...]:
        """Per layer: whether it is a local (sliding-window) layer."""
        return tuple(w and self.cfg.sliding_window is not None for w in self.cfg.local_layers)

    def _layer_xs(self) -> tuple[jax.Array, jax.Array]:
        """Per layer: its index and whether it is a local (sliding-window) layer."""
        return jnp.arange(self.cfg.num_layers, dtype=jnp.int32), jnp.asarray(self._local)

    def _inv_freq(self, local: jax.Array | bool) -> jax.Array:
        if isinstance(local, bool):
            return jnp.asarray(self.inv_freq_local if local else self.inv_freq, jnp.float32)
        return jnp.where(local, jnp.asarray(self.inv_freq_local, jnp.float32), jnp.asarray(self.inv_freq, jnp.float32))

    def logits(self, h: jax.Array, shard: ActivationSharding | None = None, matmul: Matmul | None = None
               ) -> jax.Array:
        """Final norm + LM head (+ final soft-cap): h [..., D] -> float32 logits [..., V] (a tied head in XLA)."""
        h = self.final_norm(h)
        if self.lm_head is not None:
            out = self.lm_head(h, matmul)
        else:
            emb = self.embed.embedding[...]
            out = jnp.einsum("...d,vd->...v", h.astype(emb.dtype), emb, preferred_element_type=h.dtype)
        if out.ndim == 2 and shard is not None:
            out = shard.constrain(out, ("act_batch", "vocab"), strict=False)
        out = out.astype(jnp.float32)
        cap = self.cfg.final_logit_softcapping
        if cap:
            out = cap * jnp.tanh(out / cap)
        if out.ndim == 2:
            out = _constrain(shard, out, ("act_batch", "act_vocab"))
        return out

    # -- prefill: attention within [B, T] rows from position 0
    def prefill(self, tokens_bt: jax.Array, positions_bt: jax.Array,
                shard: ActivationSharding | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Causal forward over [B, T]; returns hidden [B,T,D] and every layer's K and V [L,B,K,T,H]."""
        cfg = self.cfg
        x = _constrain(shard, self._embed(tokens_bt), ("act_batch", "act_seq", "act_embed"))
        causal = positions_bt[:, None, :] <= positions_bt[:, :, None]
        window = cfg.sliding_window or 1
        in_window = positions_bt[:, None, :] > positions_bt[:, :, None] - window
        scale = cfg.head_dim ** -0.5

        def body(layer: Gemma3Layer, x: jax.Array, xs: tuple[jax.Array, jax.Array]
                 ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            _, local = xs
            q, k, v = layer.attn.qkv(layer.attn_norm(x), positions_bt, self._inv_freq(local), self.q_scale)
            mask = causal & (in_window | ~local)
            out = _dense_attention(q, k, v, mask, scale, cfg.attn_logit_softcapping)
            x = x + layer.post_attn_norm(layer.attn.o_proj(out))
            x = _constrain(shard, layer.feed_forward(x), ("act_batch", "act_seq", "act_embed"))
            return x, (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))

        x, (ks, vs) = self.layers.scan(body, x, self._layer_xs())
        return x, ks, vs

    # -- ragged: the engine's path (see Llama.ragged)
    def ragged(self, tokens_n: jax.Array, positions_n: jax.Array, attend: Any,
               shard: ActivationSharding | None = None, cache: Any = None, static_kinds: bool = False,
               matmul: Matmul | None = None, lora: LoraRows | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
        """As `Llama.ragged` (`lora` too); `attend` is called with `sliding_window=` on a local layer and with `soft_cap=` when
        the config sets attn_logit_softcapping. When local and global layers share the scan, a layer's kind is a
        traced flag and `attend` gets it as `local=` (the window applies where it holds; the caller keeps the
        window static for its backend and chooses only the read), unless `static_kinds`: then the layers are
        scanned in blocks of the local/global pattern (`scan_layers`' `kinds`), every layer's kind is static
        and nothing chooses on data, for a program that holds one block of layers instead of one layer."""
        cfg = self.cfg
        x = _constrain(shard, self._embed(tokens_n), ("act_batch", "act_embed"))
        kw: dict[str, Any] = {}
        if cfg.attn_logit_softcapping:
            kw["soft_cap"] = float(cfg.attn_logit_softcapping)
        local_layers = self._local
        mixed = len(set(local_layers)) > 1

        def body(layer: Gemma3Layer, carry: tuple[jax.Array, Any], xs: Any, static_local: bool | None = None
                 ) -> tuple[tuple[jax.Array, Any], tuple[jax.Array, ...]]:
            x, c = carry
            i, local = xs if static_local is None else (xs, static_local)
            lo = at_layer(lora, i)
            q, k, v = layer.attn.qkv(layer.attn_norm(x), positions_n, self._inv_freq(local), self.q_scale, matmul,
                                     lo)
            if mixed and static_local is None:  # the caller chooses the read (its write stays out of any cond)
                out, c = attend(i, q, k, v, c, sliding_window=cfg.sliding_window, local=local, **kw)
            else:  # the layer's kind is static: every layer's (not mixed), or this one's (scanned in blocks)
                is_local = local_layers[0] if static_local is None else static_local
                window = {"sliding_window": cfg.sliding_window} if is_local else {}
                out, c = attend(i, q, k, v, c, **window, **kw)
            x = x + layer.post_attn_norm(adapt(lo, "o_proj", out, layer.attn.o_proj(out, matmul)))
            x = _constrain(shard, layer.feed_forward(x, matmul, lo), ("act_batch", "act_embed"))
            return (x, c), (k, v)

        ids, flags = self._layer_xs()
        whole = matmul is not None and matmul.reads_whole
        if mixed and static_kinds:
            (x, cache), (ks, vs) = self.layers.scan(body, (x, cache), ids, kinds=local_layers, whole=whole)
        else:
            (x, cache), (ks, vs) = self.layers.scan(body, (x, cache), (ids, flags), whole=whole)
        return x, ks, vs, cache

    def __call__(self, tokens_bt: jax.Array) -> jax.Array:
        """Plain causal forward from position 0: float32 logits [B, T, V]."""
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1])[None], tokens_bt.shape)
        h, _, _ = self.prefill(tokens_bt, positions)
        return self.logits(h)


_L = r"(?P<layer>\d+)"
_P = r"model\.layers\." + _L

HF_GEMMA3_NAMES = (
    (r"model\.embed_tokens\.weight", "embed.embedding", COPY),
    (rf"{_P}\.input_layernorm\.weight", "layers.{layer}.attn_norm.scale", COPY),
    (rf"{_P}\.self_attn\.q_proj\.weight", "layers.{layer}.attn.q_proj.kernel", Q_OI),
    (rf"{_P}\.self_attn\.k_proj\.weight", "layers.{layer}.attn.k_proj.kernel", KV_OI),
    (rf"{_P}\.self_attn\.v_proj\.weight", "layers.{layer}.attn.v_proj.kernel", KV_OI),
    (rf"{_P}\.self_attn\.q_proj\.bias", "layers.{layer}.attn.q_proj.bias", Q_BIAS),
    (rf"{_P}\.self_attn\.k_proj\.bias", "layers.{layer}.attn.k_proj.bias", KV_BIAS),
    (rf"{_P}\.self_attn\.v_proj\.bias", "layers.{layer}.attn.v_proj.bias", KV_BIAS),
    (rf"{_P}\.self_attn\.q_norm\.weight", "layers.{layer}.attn.q_norm.scale", COPY),
    (rf"{_P}\.self_attn\.k_norm\.weight", "layers.{layer}.attn.k_norm.scale", COPY),
    (rf"{_P}\.self_attn\.o_proj\.weight", "layers.{layer}.attn.o_proj.kernel", O_OI),
    (rf"{_P}\.post_attention_layernorm\.weight", "layers.{layer}.post_attn_norm.scale", COPY),
    (rf"{_P}\.pre_feedforward_layernorm\.weight", "layers.{layer}.mlp_norm.scale", COPY),
    (rf"{_P}\.post_feedforward_layernorm\.weight", "layers.{layer}.post_mlp_norm.scale", COPY),
    (rf"{_P}\.mlp\.gate_proj\.weight", "layers.{layer}.mlp.gate_proj.kernel", LINEAR_OI),
    (rf"{_P}\.mlp\.up_proj\.weight", "layers.{layer}.mlp.up_proj.kernel", LINEAR_OI),
    (rf"{_P}\.mlp\.down_proj\.weight", "layers.{layer}.mlp.down_proj.kernel", LINEAR_OI),
    (r"model\.norm\.weight", "final_norm.scale", COPY),
    (r"lm_head\.weight", "lm_head.kernel", LINEAR_OI),
)

# llama.cpp's names (architecture `gemma3`). Its converter stores every norm weight as (1 + w).
_B = r"blk\." + _L
GGUF_GEMMA3_NAMES = (
    (r"token_embd\.weight", "embed.embedding", COPY),
    (rf"{_B}\.attn_norm\.weight", "layers.{layer}.attn_norm.scale", GGUF_NORM_PLUS_ONE),
    (rf"{_B}\.attn_q\.weight", "layers.{layer}.attn.q_proj.kernel", Q_OI),
    (rf"{_B}\.attn_k\.weight", "layers.{layer}.attn.k_proj.kernel", KV_OI),
    (rf"{_B}\.attn_v\.weight", "layers.{layer}.attn.v_proj.kernel", KV_OI),
    (rf"{_B}\.attn_q_norm\.weight", "layers.{layer}.attn.q_norm.scale", GGUF_NORM_PLUS_ONE),
    (rf"{_B}\.attn_k_norm\.weight", "layers.{layer}.attn.k_norm.scale", GGUF_NORM_PLUS_ONE),
    (rf"{_B}\.attn_output\.weight", "layers.{layer}.attn.o_proj.kernel", O_OI),
    (rf"{_B}\.post_attention_norm\.weight", "layers.{layer}.post_attn_norm.scale", GGUF_NORM_PLUS_ONE),
    (rf"{_B}\.ffn_norm\.weight", "layers.{layer}.mlp_norm.scale", GGUF_NORM_PLUS_ONE),
    (rf"{_B}\.post_ffw_norm\.weight", "layers.{layer}.post_mlp_norm.scale", GGUF_NORM_PLUS_ONE),
    (rf"{_B}\.ffn_gate\.weight", "layers.{layer}.mlp.gate_proj.kernel", LINEAR_OI),
    (rf"{_B}\.ffn_up\.weight", "layers.{layer}.mlp.up_proj.kernel", LINEAR_OI),
    (rf"{_B}\.ffn_down\.weight", "layers.{layer}.mlp.down_proj.kernel", LINEAR_OI),
    (r"output_norm\.weight", "final_norm.scale", GGUF_NORM_PLUS_ONE),
    (r"output\.weight", "lm_head.kernel", LINEAR_OI),
)

FAMILY = Family("gemma3", Gemma3Config.from_hf_dict, gemma3_param_specs, "raydeploy.model.gemma3:Gemma3",
                HF_GEMMA3_NAMES, (r"model\.rotary_emb\.\w+",), GGUF_GEMMA3_NAMES)
