"""What a Llama-family model is made of, without allocating anything.

`LlamaConfig` is built from a Hugging Face `config.json`; `param_specs` lists every parameter with its
shape and logical axes. This table is the contract between the model (whose NNX state paths have exactly
these names), the checkpoint format (which stores tensors under these names, in these layouts), the
converters (which map foreign names onto these) and the sharding rules (which map logical axes to mesh
axes). Layouts are "input dims first": a projection kernel is [in..., out...], so no transposes at run time.
An engine may hold kernels "out_in" instead (`out_in_spec`, transposed once at load) where its backend
multiplies that layout faster; checkpoints always store in_out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    model_type: str = "llama"
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        model_type = d.get("model_type", "llama")
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        bias = bool(d.get("attention_bias", model_type == "qwen2"))
        # transformers >= 5 writes rope settings under "rope_parameters" instead of rope_theta/rope_scaling
        rope_params = d.get("rope_parameters") or {}
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rope_theta=float(d.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bias,
            rope_scaling=d.get("rope_scaling") or _rope_scaling(rope_params),
            sliding_window=d.get("sliding_window") if d.get("use_sliding_window", model_type == "mistral") else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=d.get("pad_token_id"),
            model_type=model_type,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> LlamaConfig:
        return cls.from_hf_dict(json.loads(Path(path).read_text()))


def _rope_scaling(rope_params: dict[str, Any]) -> dict[str, Any] | None:
    kind = rope_params.get("rope_type", rope_params.get("type", "default"))
    return None if kind in (None, "default") else dict(rope_params)


class DecoderShape(Protocol):
    """The sizes Llama's parameter list is made of; every family's config has them (`LlamaConfig`,
    `Gemma3Config`), so families that add tensors to Llama's build on `param_specs` and Llama's modules."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def attention_bias(self) -> bool: ...
    @property
    def tie_word_embeddings(self) -> bool: ...


@dataclass(frozen=True)
class TensorSpec:
    """One parameter: its name, shape and the logical name of each dimension; `dtype` where the tensor has its
    own (a quantized kernel's int8 / float8_e4m3fn, its float32 scale: `raydeploy.model.quant`), None for one held
    in `model.param_dtype`."""

    name: str
    shape: tuple[int, ...]
    logical_axes: tuple[str, ...]
    dtype: str | None = None

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def param_specs(cfg: DecoderShape) -> dict[str, TensorSpec]:
    """Every parameter of the model, in a stable order, keyed by its checkpoint / NNX-state name."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    specs: list[TensorSpec] = [TensorSpec("embed.embedding", (v, d), ("vocab", "embed"))]
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        specs += [
            TensorSpec(f"{p}.attn_norm.scale", (d,), ("norm",)),
            TensorSpec(f"{p}.attn.q_proj.kernel", (d, nh, hd), ("embed", "q_heads", "head_dim")),
            TensorSpec(f"{p}.attn.k_proj.kernel", (d, nkv, hd), ("embed", "kv_heads", "head_dim")),
            TensorSpec(f"{p}.attn.v_proj.kernel", (d, nkv, hd), ("embed", "kv_heads", "head_dim")),
        ]
        if cfg.attention_bias:
            specs += [
                TensorSpec(f"{p}.attn.q_proj.bias", (nh, hd), ("q_heads", "head_dim")),
                TensorSpec(f"{p}.attn.k_proj.bias", (nkv, hd), ("kv_heads", "head_dim")),
                TensorSpec(f"{p}.attn.v_proj.bias", (nkv, hd), ("kv_heads", "head_dim")),
            ]
        specs += [
            TensorSpec(f"{p}.attn.o_proj.kernel", (nh, hd, d), ("q_heads", "head_dim", "embed")),
            TensorSpec(f"{p}.mlp_norm.scale", (d,), ("norm",)),
            TensorSpec(f"{p}.mlp.gate_proj.kernel", (d, f), ("embed", "mlp")),
            TensorSpec(f"{p}.mlp.up_proj.kernel", (d, f), ("embed", "mlp")),
            TensorSpec(f"{p}.mlp.down_proj.kernel", (f, d), ("mlp", "embed")),
        ]
    specs.append(TensorSpec("final_norm.scale", (d,), ("norm",)))
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.kernel", (d, v), ("embed", "vocab")))
    return {s.name: s for s in specs}


def with_layer_tensors(specs: dict[str, TensorSpec],
                       after: Mapping[str, Sequence[tuple[str, tuple[int, ...], tuple[str, ...]]]]
                       ) -> dict[str, TensorSpec]:
    """`specs` with more tensors in every layer: each `(suffix, shape, axes)` of `after[key]` is inserted, as
    `layers.{i}.{suffix}`, right after layer i's tensor named `layers.{i}.{key}` (a family's norms beside Llama's
    projections; the order stays that of the family's checkpoints)."""
    out: dict[str, TensorSpec] = {}
    for name, spec in specs.items():
        out[name] = spec
        split = split_layer_name(name)
        if split is not None and split[1] in after:
            for suffix, shape, axes in after[split[1]]:
                extra = f"layers.{split[0]}.{suffix}"
                out[extra] = TensorSpec(extra, shape, axes)
    return out

# Leading "input" dims of each projection kernel (they are contracted with the activations); the rest are
# output dims. Kernels not listed here have one input dim.
_KERNEL_INPUT_DIMS = {"attn.o_proj.kernel": 2}
KERNEL_LAYOUTS = ("in_out", "out_in")


def kernel_input_dims(name: str) -> int:
    """How many leading dims of kernel `name` (in the checkpoint's in_out layout) are contracted."""
    return next((n for suffix, n in _KERNEL_INPUT_DIMS.items() if name.endswith(suffix)), 1)


def is_kernel(name: str) -> bool:
    return name.endswith(".kernel")


def out_in_spec(spec: TensorSpec) -> TensorSpec:
    """A kernel's spec in the out_in layout (output dims first, input dims last); other tensors unchanged.

    The checkpoint always stores in_out; an engine may hold kernels out_in because some backends multiply
    that layout faster (see `EngineConfig.kernel_layout`). Logical axes move with their dims, so the sharding
    rules apply unchanged."""
    if not is_kernel(spec.name):
        return spec
    n = kernel_input_dims(spec.name)
    lead = 1 if spec.logical_axes[:1] == (LAYER_AXIS,) else 0  # a stacked kernel keeps its layer axis first
    shape, axes = spec.shape[lead:], spec.logical_axes[lead:]
    return TensorSpec(spec.name, spec.shape[:lead] + shape[n:] + shape[:n],
                      spec.logical_axes[:lead] + axes[n:] + axes[:n], spec.dtype)


LAYER_AXIS = "layers"
"""Logical axis of the stacked layer dimension (weights and KV cache); never sharded."""

_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")


def split_layer_name(name: str) -> tuple[int, str] | None:
    """'layers.3.attn.q_proj.kernel' -> (3, 'attn.q_proj.kernel'); None for a name outside the layers."""
    m = _LAYER_NAME.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def stacked_param_specs(cfg: LlamaConfig) -> dict[str, TensorSpec]:
    """The model's parameters as the engine holds them: each per-layer tensor stacked over the layers.

    `layers.{i}.attn.q_proj.kernel` [D, N, H] for i < L becomes `layers.attn.q_proj.kernel` [L, D, N, H] with
    logical axes (layers, embed, q_heads, head_dim), so the forward pass is one `lax.scan` over the layers and
    a program's size (and its compile time) does not grow with depth. Checkpoints keep per-layer names."""
    return stack_layer_specs(param_specs(cfg), cfg.num_layers)


def stack_layer_specs(specs: dict[str, TensorSpec], num_layers: int) -> dict[str, TensorSpec]:
    """Any family's per-layer list stacked: `layers.{i}.x` -> `layers.x` [num_layers, ...] (layer 0's shape)."""
    out: dict[str, TensorSpec] = {}
    for name, spec in specs.items():
        split = split_layer_name(name)
        if split is None:
            out[name] = spec
        elif split[0] == 0:
            stacked = f"layers.{split[1]}"
            out[stacked] = TensorSpec(stacked, (num_layers, *spec.shape), (LAYER_AXIS, *spec.logical_axes), spec.dtype)
    return out


def param_bytes(cfg: LlamaConfig, itemsize: int) -> int:
    return sum(s.numel for s in param_specs(cfg).values()) * itemsize


def kv_pool_spec(cfg: LlamaConfig, total_pages: int, page_size: int) -> TensorSpec:
    """The paged KV pool of every layer: [layers, pages, page_size, 2 * kv_heads, head_dim].

    K and V share one array, interleaved on the head axis (k0, v0, k1, v1, ...) as jax's ragged paged attention
    kernel reads them. The pages axis is split over the cache_batch mesh axes (dp): each dp group owns
    `total_pages / dp` consecutive pages, addressed by page ids local to the group. Stacked over the layers
    like the weights; the engine only reads it inside the layer scan and writes each step's new K/V after it."""
    return TensorSpec("kv_pages", (cfg.num_layers, total_pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim),
                      (LAYER_AXIS, "cache_batch", "page_offset", "cache_kv_heads", "head_dim"))


POOL_RULES = {"page_offset": None}
"""Sharding rule of the pool's within-page axis (never split): added to the mesh rules for the pool."""


def page_table_spec(max_slots: int, max_seq_len: int, page_size: int) -> TensorSpec:
    """Every slot's page-table row; its slots split over the cache_batch mesh axes like the pool's pages (each
    dp group owns a run of consecutive slots)."""
    return TensorSpec("page_tables", (max_slots, pages_per_seq(max_seq_len, page_size)),
                      ("cache_batch", "page_offset"))


def resolve_num_pages(num_pages: int, slots_per_group: int, max_seq_len: int, page_size: int) -> int:
    """`EngineConfig.num_pages` with auto (0) resolved: every slot of the group at max_seq_len."""
    return num_pages if num_pages > 0 else slots_per_group * pages_per_seq(max_seq_len, page_size)


def pages_per_seq(max_seq_len: int, page_size: int) -> int:
    """Page-table entries one sequence of max_seq_len tokens needs."""
    return -(-max_seq_len // page_size)


def kv_pool_bytes(cfg: LlamaConfig, total_pages: int, page_size: int, itemsize: int) -> int:
    """Bytes of the whole paged pool (K and V, every layer, every dp group)."""
    return kv_pool_spec(cfg, total_pages, page_size).numel * itemsize
