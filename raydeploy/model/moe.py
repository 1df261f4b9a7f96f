"""Mixture-of-experts families: Qwen3-MoE (`qwen3_moe`) and Mixtral (`mixtral`).

The decoder is Llama's (Qwen3-MoE with Qwen3's per-head q/k norms) with the feed-forward replaced by a routed
block: a router [embed, experts] picks each token's top-k experts (softmax over all experts, then the top k;
renormalised over the k when `norm_topk_prob`, which Mixtral always does), and the experts' SwiGLU weights are
stacked [E, ...] with the logical axis `expert` (mapped to the `ep` mesh axis by `MOE_RULES`).

The expert computation never multiplies every token by every expert. The token-expert assignments are sorted
by expert and multiplied as one grouped matmul: on TPU and GPU `jax.lax.ragged_dot` with the group sizes,
which lowers to a grouped-matmul kernel. XLA:CPU lowers `ragged_dot` densely (every group masked over all
rows: 50-400 ms for 1-256 tokens at 32 experts of 512x512), so on CPU the same sorted assignments go through
`tiled_grouped_matmul`: a loop over row tiles of one expert each, that reads each routed expert's weights in
place (no gathered copy) once per tile. With tiles about twice the mean rows per expert, that is each routed
expert once at decode sizes (`benchmarks/moe_decode.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp

from raydeploy.model.llama import DTYPES, Attention, DecoderLayer, Llama, RMSNorm
from raydeploy.model.names import (
    COPY,
    GGUF_IGNORED,
    GGUF_NAMES,
    GGUF_STACKED_EXPERTS_OI,
    HF_IGNORED,
    HF_NAMES,
    LINEAR_OI,
)
from raydeploy.model.projection import QUANT_SCALE, Dense, Matmul, _param
from raydeploy.model.qwen3 import Qwen3Attention
from raydeploy.model.registry import Family, expert_split
from raydeploy.model.spec import LlamaConfig, TensorSpec, param_specs

MAX_TILE_ROWS = 64
METHODS = ("auto", "tiled", "ragged_dot")
SCAN_LAYER = "_scan_layer"

MOE_RULES: dict[str, Any] = {"expert": "ep", "expert_mlp": "tp", "router": None}
"""Sharding rules of the MoE logical axes: experts over `ep`, each expert's hidden units over `tp`."""


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    qk_norm: bool = False


def config_from_hf(d: dict[str, Any]) -> MoEConfig:
    mt = d.get("model_type")
    base = LlamaConfig.from_hf_dict(d)
    kw = {f.name: getattr(base, f.name) for f in fields(LlamaConfig)}
    if mt == "qwen3_moe":
        if d.get("use_sliding_window"):
            raise ValueError("qwen3_moe: use_sliding_window=true is not supported")
        if int(d.get("decoder_sparse_step", 1)) != 1 or d.get("mlp_only_layers"):
            raise ValueError("qwen3_moe: dense layers between the MoE layers (decoder_sparse_step != 1 or "
                             "mlp_only_layers) are not supported")
        experts = d.get("num_experts") or d.get("num_local_experts")
        ffn = d["moe_intermediate_size"]
        norm, qk = bool(d.get("norm_topk_prob", False)), True
    elif mt == "mixtral":
        experts, ffn, norm, qk = d.get("num_local_experts"), d["intermediate_size"], True, False
        kw["sliding_window"] = d.get("sliding_window")
    else:
        raise ValueError(f"model_type {mt!r} is not a mixture-of-experts family (qwen3_moe, mixtral)")
    if not experts or not d.get("num_experts_per_tok"):
        raise ValueError(f"{mt}: num_experts / num_experts_per_tok missing from the config")
    k = int(d["num_experts_per_tok"])
    if not 0 < k <= int(experts):
        raise ValueError(f"{mt}: num_experts_per_tok={k} must be in [1, num_experts={experts}]")
    return MoEConfig(**kw, num_experts=int(experts), num_experts_per_tok=k, moe_intermediate_size=int(ffn),
                     norm_topk_prob=norm, qk_norm=qk)


def moe_param_specs(cfg: MoEConfig) -> dict[str, TensorSpec]:
    """Llama's parameters with each layer's MLP replaced by a router and stacked experts (and Qwen3's q/k
    norms when the family has them)."""
    e, d, f, hd = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.head_dim
    out: dict[str, TensorSpec] = {}
    for name, spec in param_specs(cfg).items():
        if ".mlp." in name:
            if name.endswith(".mlp.gate_proj.kernel"):
                p = name[: -len(".gate_proj.kernel")]
                for n, shape, axes in (
                    ("router.kernel", (d, e), ("embed", "router")),
                    ("experts.gate_proj.kernel", (e, d, f), ("expert", "embed", "expert_mlp")),
                    ("experts.up_proj.kernel", (e, d, f), ("expert", "embed", "expert_mlp")),
                    ("experts.down_proj.kernel", (e, f, d), ("expert", "expert_mlp", "embed")),
                ):
                    out[f"{p}.{n}"] = TensorSpec(f"{p}.{n}", shape, axes)
            continue
        out[name] = spec
        if cfg.qk_norm and name.endswith(".attn.v_proj.kernel"):
            p = name[: -len(".v_proj.kernel")]
            out[f"{p}.q_norm.scale"] = TensorSpec(f"{p}.q_norm.scale", (hd,), ("norm",))
            out[f"{p}.k_norm.scale"] = TensorSpec(f"{p}.k_norm.scale", (hd,), ("norm",))
    return out


def check_mesh(cfg: MoEConfig, mesh_shape: dict[str, int]) -> None:
    expert_split(cfg.num_experts, int(mesh_shape.get("ep", 1)))


# -- the expert computation ------------------------------------------------------------------------------------


def expert_ffn(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
               down: jax.Array, method: str = "auto", valid: jax.Array | None = None,
               layer: jax.Array | None = None, scales: tuple[jax.Array, ...] | None = None) -> jax.Array:
    """Routed SwiGLU experts: x [N, D], expert_ids / weights [N, k], gate/up [E, D, F], down [E, F, D] ->
    [N, D] = sum_k weights * expert(x). The assignments are sorted by expert and multiplied group by group;
    `method`: "ragged_dot" (one `jax.lax.ragged_dot` per matrix: TPU and GPU kernels), "tiled"
    (`tiled_grouped_matmul`: XLA:CPU), "auto" (tiled on CPU, else ragged_dot). `valid` [N, k]: assignments to
    compute (the others are sorted last, outside every group, and contribute 0). `layer`: the weights hold
    every layer, [L, E, ...], and this is the one to use (indexed where the weights are read, see
    `MoEDecoderLayer.scan`). `scales`: the experts' kernels are quantized (`raydeploy.model.quant`): int8 / fp8
    gate, up, down with their float32 scales ([E, F], [E, F], [E, D], or [L, E, ...]), converted inside each
    matmul and scaled per output channel of the row's expert."""
    if method not in METHODS:
        raise ValueError(f"expert_ffn: method must be one of {', '.join(METHODS)}, got {method!r}")
    n, k = expert_ids.shape
    e = gate.shape[0] if layer is None else gate.shape[1]
    flat = expert_ids.reshape(-1)
    keep = None if valid is None else valid.reshape(-1)
    if keep is not None:
        flat = jnp.where(keep, flat, e)  # sentinel group e: after every real group
    tok = jnp.repeat(jnp.arange(n, dtype=jnp.int32), k)
    if method == "auto":
        method = "tiled" if jax.default_backend() == "cpu" else "ragged_dot"
    order = jnp.argsort(flat, stable=True)
    xs = x.astype(gate.dtype if scales is None else x.dtype)[tok[order]]
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    if method == "tiled":
        ys = tiled_grouped_matmul(xs, sizes, gate, up, down, layer, scales)
    else:
        if layer is not None:
            gate, up, down = (jax.lax.dynamic_index_in_dim(w, layer, keepdims=False) for w in (gate, up, down))
            if scales is not None:
                scales = tuple(jax.lax.dynamic_index_in_dim(s, layer, keepdims=False) for s in scales)
        if scales is None:
            h = jax.lax.ragged_dot(xs, gate, sizes, preferred_element_type=jnp.float32)
            u = jax.lax.ragged_dot(xs, up, sizes, preferred_element_type=jnp.float32)
            a = (jax.nn.silu(h) * u).astype(down.dtype)
            ys = jax.lax.ragged_dot(a, down, sizes, preferred_element_type=jnp.float32)
        else:  # each row scaled by its expert's channel scales (rows outside every group: any expert, dropped)
            row_expert = jnp.minimum(flat[order], e - 1)
            sg, su, sd = (sc[row_expert] for sc in scales)
            h = jax.lax.ragged_dot(xs, gate.astype(xs.dtype), sizes, preferred_element_type=jnp.float32) * sg
            u = jax.lax.ragged_dot(xs, up.astype(xs.dtype), sizes, preferred_element_type=jnp.float32) * su
            a = (jax.nn.silu(h) * u).astype(xs.dtype)
            ys = jax.lax.ragged_dot(a, down.astype(xs.dtype), sizes, preferred_element_type=jnp.float32) * sd
    y = jnp.zeros_like(ys).at[order].set(ys)
    if keep is not None:  # rows outside every group are not defined by every grouped-matmul kernel
        y = jnp.where(keep[:, None], y, 0.0)
    y = y * weights.reshape(-1, 1).astype(jnp.float32)
    return y.reshape(n, k, -1).sum(axis=1)


def tile_rows(assignments: int, experts: int) -> int:
    """Rows per tile of `tiled_grouped_matmul`: the power of two at or above twice the mean rows per expert
    (1 to MAX_TILE_ROWS). Measured on CPU, 32 experts of 512x512, 4 per token: at 1 / 8 / 16 / 64 / 256 tokens
    the best tile was 1 / 2 / 4 / 16 / 32-64 rows; a tile costs one read of its expert's weights."""
    want = max(1, -(-2 * assignments // experts))
    return min(MAX_TILE_ROWS, 1 << (want - 1).bit_length())


def tiled_grouped_matmul(xs: jax.Array, sizes: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                         layer: jax.Array | None = None, scales: tuple[jax.Array, ...] | None = None) -> jax.Array:
    """SwiGLU over rows sorted by expert: xs [M, D] whose first sizes[0] rows go to expert 0, the next sizes[1]
    to expert 1, ... -> [M, D] float32 (rows after the last group: 0). A `fori_loop` over the tiles actually
    used (sum of ceil(sizes / T), at most M / T + E): each tile takes T rows of one group and that expert's
    matrices by a dynamic index (read in place) and writes its T rows back. A group's last tile also writes
    rows of the next group; the tiles run in row order, so the next group's first tile, which starts right
    there, overwrites them (the last group's spill lands in the padding or in rows outside every group).
    `layer`: the weights are [L, E, ...] and a tile reads [layer, expert] in place: a layer's experts sliced
    out of the stack before the loop would be a copy of all of them (XLA materialises a loop's operand).
    `scales`: quantized experts (`expert_ffn`): each tile converts its expert's matrices and scales the products."""
    m, d = xs.shape
    t = tile_rows(m, gate.shape[0] if layer is None else gate.shape[1])

    def matrix(w: jax.Array, ex: jax.Array) -> jax.Array:
        if layer is None:
            return jax.lax.dynamic_index_in_dim(w, ex, keepdims=False)
        return jax.lax.dynamic_slice(w, (layer, ex, 0, 0), (1, 1, *w.shape[2:]))[0, 0]

    def channel(s: jax.Array, ex: jax.Array) -> jax.Array:
        if layer is None:
            return jax.lax.dynamic_index_in_dim(s, ex, keepdims=False)
        return jax.lax.dynamic_slice(s, (layer, ex, 0), (1, 1, s.shape[-1]))[0, 0]

    def mul(a: jax.Array, w: jax.Array, ex: jax.Array, k: int) -> jax.Array:
        if scales is None:
            return jnp.dot(a, matrix(w, ex), preferred_element_type=jnp.float32)
        return jnp.dot(a, matrix(w, ex).astype(a.dtype), preferred_element_type=jnp.float32) * channel(scales[k], ex)

    xs = jnp.concatenate([xs, jnp.zeros((t, d), xs.dtype)])
    starts = jnp.cumsum(sizes) - sizes
    tiles = (sizes + t - 1) // t
    ends = jnp.cumsum(tiles)

    def tile(j: jax.Array, ys: jax.Array) -> jax.Array:
        ex = jnp.searchsorted(ends, j, side="right").astype(jnp.int32)
        first = starts[ex] + (j - (ends[ex] - tiles[ex])) * t
        rows = jax.lax.dynamic_slice_in_dim(xs, first, t)
        h = mul(rows, gate, ex, 0)
        u = mul(rows, up, ex, 1)
        a = (jax.nn.silu(h) * u).astype(down.dtype if scales is None else xs.dtype)
        o = mul(a, down, ex, 2)
        return jax.lax.dynamic_update_slice_in_dim(ys, o, first, 0)

    ys = jax.lax.fori_loop(0, ends[-1], tile, jnp.zeros((m + t, down.shape[-1]), jnp.float32))
    return ys[:m]


def expert_ffn_ep(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
                  down: jax.Array, mesh: Any, method: str = "auto", layer: jax.Array | None = None,
                  scales: tuple[jax.Array, ...] | None = None) -> jax.Array:
    """`expert_ffn` with the experts split over the mesh's `ep` axis (and each expert's hidden units over `tp`
    when the mesh has it), inside `shard_map`: every ep shard computes only the assignments routed to its own
    experts (the rest are sorted behind them and masked out), and one psum over ep (and tp) adds the parts.
    The tokens and routing are replicated over ep, so no token moves; no expert's weights are gathered.
    `layer`: as in `expert_ffn` (weights [L, E, ...])."""
    from jax.sharding import PartitionSpec as P

    names = dict(mesh.shape)
    tp = "tp" if names.get("tp", 1) > 1 and gate.shape[-1] % names["tp"] == 0 else None
    reduce_axes = ("ep", tp) if tp else ("ep",)

    def local(x: jax.Array, ids: jax.Array, w: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
              layer: jax.Array | None, scales: tuple[jax.Array, ...] | None) -> jax.Array:
        e_local = gate.shape[0] if layer is None else gate.shape[1]
        lid = ids - jax.lax.axis_index("ep") * e_local
        mine = (lid >= 0) & (lid < e_local)
        # Assignments to other shards' experts keep weight 0 and an in-range id: computed, then dropped.
        y = expert_ffn(x, jnp.where(mine, lid, 0), jnp.where(mine, w, 0.0), gate, up, down, method,
                       valid=mine, layer=layer, scales=scales)
        return jax.lax.psum(y, reduce_axes)

    rep = P()
    lead = () if layer is None else (None,)
    scale_specs = None if scales is None else (P(*lead, "ep", tp), P(*lead, "ep", tp), P(*lead, "ep", None))
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(rep, rep, rep, P(*lead, "ep", None, tp), P(*lead, "ep", None, tp),
                                   P(*lead, "ep", tp, None), None if layer is None else rep, scale_specs),
                         out_specs=rep, axis_names=frozenset(reduce_axes), check_vma=False)(
        x, expert_ids, weights, gate, up, down, layer, scales)


def route(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Top-k routing: (weights [N, k] float32, expert ids [N, k])."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    w, ids = jax.lax.top_k(probs, k)
    if normalize:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w, ids


class ExpertWeights(nnx.Module):
    def __init__(self, shape: tuple[int, ...], param_dtype: Any, rngs: nnx.Rngs | None) -> None:
        self.kernel = _param(rngs, shape, param_dtype)


class Experts(nnx.Module):
    def __init__(self, cfg: MoEConfig, param_dtype: Any, rngs: nnx.Rngs | None, lead: tuple[int, ...] = ()) -> None:
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = ExpertWeights((*lead, e, d, f), param_dtype, rngs)
        self.up_proj = ExpertWeights((*lead, e, d, f), param_dtype, rngs)
        self.down_proj = ExpertWeights((*lead, e, f, d), param_dtype, rngs)


class MoEBlock(nnx.Module):
    def __init__(self, cfg: MoEConfig, param_dtype: Any, rngs: nnx.Rngs | None, lead: tuple[int, ...] = ()) -> None:
        self.router = Dense(cfg.hidden_size, cfg.num_experts, param_dtype, rngs, lead)
        self.experts = Experts(cfg, param_dtype, rngs, lead)
        self.top_k = cfg.num_experts_per_tok
        self.normalize = cfg.norm_topk_prob

    def __call__(self, x: jax.Array, mm: Matmul | None = None, lora: Any = None) -> jax.Array:
        """The routed experts; `lora` (the step's adapters) changes nothing here: adapters of an MoE family
        target its attention projections only (`raydeploy.lora.layout`)."""
        x2 = x.reshape(-1, x.shape[-1])
        w, ids = route(self.router(x2, mm), self.top_k, self.normalize)
        weights = (self.experts.gate_proj.kernel[...], self.experts.up_proj.kernel[...],
                   self.experts.down_proj.kernel[...])
        held = [getattr(m, QUANT_SCALE, None) for m in (self.experts.gate_proj, self.experts.up_proj,
                                                       self.experts.down_proj)]
        scales = None if held[0] is None else tuple(sc[...] for sc in held if sc is not None)  # quantized experts
        layer = getattr(self, SCAN_LAYER, None)  # set by MoEDecoderLayer.scan: the weights hold every layer
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty and dict(mesh.shape).get("ep", 1) > 1:
            y = expert_ffn_ep(x2, ids, w, *weights, mesh, layer=layer, scales=scales)
        else:
            y = expert_ffn(x2, ids, w, *weights, layer=layer, scales=scales)
        return y.astype(x.dtype).reshape(x.shape)


class MoEDecoderLayer(DecoderLayer):
    unrollable = False  # its scan hands every layer the stacked experts (see `scan`)

    def __init__(self, cfg: MoEConfig, param_dtype: Any, rngs: nnx.Rngs | None, lead: tuple[int, ...] = ()) -> None:
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype, lead=lead)
        attn = Qwen3Attention if cfg.qk_norm else Attention
        self.attn = attn(cfg, param_dtype, rngs, lead)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype, lead=lead)
        self.mlp = MoEBlock(cfg, param_dtype, rngs, lead)  # type: ignore[assignment]

    def scan(self, body: Any, carry: Any, xs: Any = None, kinds: Any = None, whole: bool = False
             ) -> tuple[Any, Any]:
        """`DecoderLayer.scan`, except that the experts' weights are not sliced per layer: each traced layer
        holds all of them, [L, E, ...], and its MoE block the layer index (`SCAN_LAYER`), and the expert
        computation indexes [layer, expert] where it reads a matrix. A scan slices its per-layer inputs
        into new buffers, and the CPU grouped matmul is a loop that reads only the routed experts: given a
        layer's slice it would first copy every expert of the layer (measured: 94 instead of 9 ms a
        decode step at 1 token, `benchmarks/moe_decode.py`). `kinds` (`scan_layers`): the layers of an MoE
        stack are of one kind, passed to the body as its fourth argument. `whole` changes nothing: this scan
        passes no `LayerSlice`s (`unrollable` is False), as `scan_layers` does for such a stack."""
        if kinds is not None:
            if len(set(kinds)) > 1:
                raise ValueError(f"an MoE layer stack scans layers of one kind, got kinds {sorted(set(kinds))}")
            return self.scan(lambda layer, c, x: body(layer, c, x, kinds[0]), carry, xs)
        graphdef, experts, rest = nnx.split(self, nnx.PathContains("experts"), ...)  # type: ignore[misc]
        layers = jnp.arange(self.attn_norm.scale.shape[0], dtype=jnp.int32)

        def step(c: Any, per_layer: Any) -> tuple[Any, Any]:
            layer_state, x, i = per_layer
            layer = nnx.merge(graphdef, experts, layer_state)
            object.__setattr__(layer.mlp, SCAN_LAYER, i)
            return body(layer, c, x)  # type: ignore[no-any-return]

        return jax.lax.scan(step, carry, (rest, xs, layers))


class MoE(Llama):
    """Qwen3-MoE / Mixtral decoder: Llama's forward paths with routed experts (engines hold its kernels in_out
    only: the family's `kernel_layouts`)."""

    def __init__(self, cfg: MoEConfig, dtype: str = "float32", param_dtype: str = "float32",
                 rngs: nnx.Rngs | None = None) -> None:
        super().__init__(cfg, dtype, param_dtype, rngs=rngs)
        self.layers = MoEDecoderLayer(cfg, DTYPES[param_dtype], rngs, lead=(cfg.num_layers,))


_L = r"(?P<layer>\d+)"
_E = r"(?P<expert>\d+)"
_ATTN_ONLY = tuple(row for row in HF_NAMES if ".mlp." not in row[0])

HF_QWEN3_MOE_NAMES = (
    *_ATTN_ONLY,
    (rf"model\.layers\.{_L}\.self_attn\.q_norm\.weight", "layers.{layer}.attn.q_norm.scale", COPY),
    (rf"model\.layers\.{_L}\.self_attn\.k_norm\.weight", "layers.{layer}.attn.k_norm.scale", COPY),
    (rf"model\.layers\.{_L}\.mlp\.gate\.weight", "layers.{layer}.mlp.router.kernel", LINEAR_OI),
    (rf"model\.layers\.{_L}\.mlp\.experts\.{_E}\.gate_proj\.weight",
     "layers.{layer}.mlp.experts.gate_proj.kernel[{expert}]", LINEAR_OI),
    (rf"model\.layers\.{_L}\.mlp\.experts\.{_E}\.up_proj\.weight",
     "layers.{layer}.mlp.experts.up_proj.kernel[{expert}]", LINEAR_OI),
    (rf"model\.layers\.{_L}\.mlp\.experts\.{_E}\.down_proj\.weight",
     "layers.{layer}.mlp.experts.down_proj.kernel[{expert}]", LINEAR_OI),
)

HF_MIXTRAL_NAMES = (
    *_ATTN_ONLY,
    (rf"model\.layers\.{_L}\.block_sparse_moe\.gate\.weight", "layers.{layer}.mlp.router.kernel", LINEAR_OI),
    (rf"model\.layers\.{_L}\.block_sparse_moe\.experts\.{_E}\.w1\.weight",
     "layers.{layer}.mlp.experts.gate_proj.kernel[{expert}]", LINEAR_OI),
    (rf"model\.layers\.{_L}\.block_sparse_moe\.experts\.{_E}\.w3\.weight",
     "layers.{layer}.mlp.experts.up_proj.kernel[{expert}]", LINEAR_OI),
    (rf"model\.layers\.{_L}\.block_sparse_moe\.experts\.{_E}\.w2\.weight",
     "layers.{layer}.mlp.experts.down_proj.kernel[{expert}]", LINEAR_OI),
)

# llama.cpp's names: the experts of a layer arrive already stacked [E, out, in] (`ffn_*_exps`), the router is
# `ffn_gate_inp`. Qwen3-MoE (architecture `qwen3moe`) adds the per-head norms; Mixtral is architecture `llama`
# with experts (its Q/K rope-permuted like Llama's).
_GGUF_ATTN_ONLY = tuple(row for row in GGUF_NAMES if ".mlp." not in row[1])
_GGUF_EXPERTS = (
    (rf"blk\.{_L}\.ffn_gate_inp\.weight", "layers.{layer}.mlp.router.kernel", LINEAR_OI),
    (rf"blk\.{_L}\.ffn_gate_exps\.weight", "layers.{layer}.mlp.experts.gate_proj.kernel", GGUF_STACKED_EXPERTS_OI),
    (rf"blk\.{_L}\.ffn_up_exps\.weight", "layers.{layer}.mlp.experts.up_proj.kernel", GGUF_STACKED_EXPERTS_OI),
    (rf"blk\.{_L}\.ffn_down_exps\.weight", "layers.{layer}.mlp.experts.down_proj.kernel", GGUF_STACKED_EXPERTS_OI),
)
GGUF_QWEN3_MOE_NAMES = (
    *_GGUF_ATTN_ONLY,
    (rf"blk\.{_L}\.attn_q_norm\.weight", "layers.{layer}.attn.q_norm.scale", COPY),
    (rf"blk\.{_L}\.attn_k_norm\.weight", "layers.{layer}.attn.k_norm.scale", COPY),
    *_GGUF_EXPERTS,
)
GGUF_MIXTRAL_NAMES = (*_GGUF_ATTN_ONLY, *_GGUF_EXPERTS)

QWEN3_MOE = Family("qwen3_moe", config_from_hf, moe_param_specs, "raydeploy.model.moe:MoE", HF_QWEN3_MOE_NAMES,
                   HF_IGNORED, GGUF_QWEN3_MOE_NAMES, GGUF_IGNORED, rules=MOE_RULES, mesh_check=check_mesh,
                   num_experts=lambda c: c.num_experts,
                   experts_per_token=lambda c: c.num_experts_per_tok, kernel_layouts=("in_out",))
MIXTRAL = Family("mixtral", config_from_hf, moe_param_specs, "raydeploy.model.moe:MoE", HF_MIXTRAL_NAMES,
                 HF_IGNORED, GGUF_MIXTRAL_NAMES, GGUF_IGNORED, rules=MOE_RULES, mesh_check=check_mesh,
                 num_experts=lambda c: c.num_experts,
                 experts_per_token=lambda c: c.num_experts_per_tok, kernel_layouts=("in_out",))
