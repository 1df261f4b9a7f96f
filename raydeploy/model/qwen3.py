"""The Qwen3 family (dense): the Llama decoder with an RMSNorm over each query and key head before RoPE, and no
q/k/v bias.

The module subclasses `raydeploy.model.llama.Llama`, replacing only the attention's `qkv`, so its forward paths
(`ragged` for the engine, `prefill` / `__call__`) and its stacked-layer scan are Llama's; extra parameters are
`layers.{i}.attn.q_norm.scale` and `layers.{i}.attn.k_norm.scale` ([head_dim], logical axis `norm`).
"""

from __future__ import annotations

from typing import Any

import flax.nnx as nnx
import jax
import numpy as np

from raydeploy.lora.batched import LoraRows
from raydeploy.model.llama import DTYPES, MLP, QKV, Attention, DecoderLayer, Llama, RMSNorm, apply_rope
from raydeploy.model.names import COPY, GGUF_IGNORED, GGUF_NAMES, HF_IGNORED, HF_NAMES
from raydeploy.model.projection import Matmul, project
from raydeploy.model.registry import Family
from raydeploy.model.spec import LlamaConfig, TensorSpec, param_specs, with_layer_tensors

_L = r"(?P<layer>\d+)"


def config_from_hf(d: dict[str, Any]) -> LlamaConfig:
    if d.get("use_sliding_window"):
        raise ValueError("qwen3: use_sliding_window=true (sliding window on the layers past max_window_layers) "
                         "is not supported")
    if d.get("attention_bias"):
        raise ValueError("qwen3: attention_bias=true is not a Qwen3 checkpoint (Qwen3 has no q/k/v bias)")
    return LlamaConfig.from_hf_dict(d)


def qwen3_param_specs(cfg: LlamaConfig) -> dict[str, TensorSpec]:
    """Llama's parameters plus a per-head q and k norm in each layer (after `attn.v_proj`)."""
    norms = [(f"attn.{n}_norm.scale", (cfg.head_dim,), ("norm",)) for n in "qk"]
    return with_layer_tensors(param_specs(cfg), {"attn.v_proj.kernel": norms})


class Qwen3Attention(Attention):
    def __init__(self, cfg: LlamaConfig, param_dtype: Any, rngs: nnx.Rngs | None,
                 lead: tuple[int, ...] = ()) -> None:
        super().__init__(cfg, param_dtype, rngs, lead)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, param_dtype, lead=lead)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, param_dtype, lead=lead)

    def qkv(self, x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, mm: Matmul | None = None,
            lora: LoraRows | None = None) -> tuple[jax.Array, ...]:
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj), mm, lora, QKV)
        return apply_rope(self.q_norm(q), positions, inv_freq), apply_rope(self.k_norm(k), positions, inv_freq), v


class Qwen3DecoderLayer(DecoderLayer):
    def __init__(self, cfg: LlamaConfig, param_dtype: Any, rngs: nnx.Rngs | None,
                 lead: tuple[int, ...] = ()) -> None:
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype, lead=lead)
        self.attn = Qwen3Attention(cfg, param_dtype, rngs, lead)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype, lead=lead)
        self.mlp = MLP(cfg, param_dtype, rngs, lead)


class Qwen3(Llama):
    """Qwen3 decoder; state paths = the stacked `qwen3_param_specs` names."""

    def __init__(self, cfg: LlamaConfig, dtype: str = "float32", param_dtype: str = "float32",
                 rngs: nnx.Rngs | None = None) -> None:
        super().__init__(cfg, dtype, param_dtype, rngs=rngs)
        self.layers = Qwen3DecoderLayer(cfg, DTYPES[param_dtype], rngs, lead=(cfg.num_layers,))


HF_QWEN3_NAMES = (
    *HF_NAMES,
    (rf"model\.layers\.{_L}\.self_attn\.q_norm\.weight", "layers.{layer}.attn.q_norm.scale", COPY),
    (rf"model\.layers\.{_L}\.self_attn\.k_norm\.weight", "layers.{layer}.attn.k_norm.scale", COPY),
)

# llama.cpp's names (architecture `qwen3`): Llama's plus the per-head norms; Q/K are not rope-permuted.
GGUF_QWEN3_NAMES = (
    *GGUF_NAMES,
    (rf"blk\.{_L}\.attn_q_norm\.weight", "layers.{layer}.attn.q_norm.scale", COPY),
    (rf"blk\.{_L}\.attn_k_norm\.weight", "layers.{layer}.attn.k_norm.scale", COPY),
)

FAMILY = Family("qwen3", config_from_hf, qwen3_param_specs, "raydeploy.model.qwen3:Qwen3", HF_QWEN3_NAMES,
                HF_IGNORED, GGUF_QWEN3_NAMES, GGUF_IGNORED)
