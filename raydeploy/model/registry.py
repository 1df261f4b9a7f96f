"""Model families: a Hugging Face `model_type` -> the family that serves it.

A `Family` supplies everything the rest of the system needs to know about one architecture:
- `config_from_hf(dict)`: the family's config dataclass from a raw `config.json` dict;
- `param_specs(cfg)`: every parameter (checkpoint names, in_out layouts, logical axes);
- `module(cfg, dtype, param_dtype, rngs, kernel_layout)`: the Flax NNX decoder;
- `kv_heads(cfg)` / `head_dim`: the KV spec (the paged pool's shape, `kv_pool_spec`);
- `hf_names` / `hf_ignored`: the foreign-name table of the safetensors converter (regex, our name, layout kind;
  see `raydeploy.checkpoint.layout`).

The registry itself is a table of model_type -> "module:attribute" strings; a family module is imported only
when that model_type is asked for. An unknown model_type is an error listing the supported ones.
Adding a dense family: one new module defining `FAMILY`, one line in `_ENTRIES` (see docs/families.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from raydeploy.model.spec import LAYER_AXIS, TensorSpec, split_layer_name

# model_type -> "python.module:ATTRIBUTE" holding that family's `Family`.
_ENTRIES: dict[str, str] = {
    "llama": "raydeploy.model.registry:LLAMA",
    "mistral": "raydeploy.model.registry:LLAMA",
    "qwen2": "raydeploy.model.registry:LLAMA",
    "qwen3": "raydeploy.model.qwen3:FAMILY",
    "gemma3_text": "raydeploy.model.gemma3:FAMILY",
    "qwen3_moe": "raydeploy.model.moe:QWEN3_MOE",
    "mixtral": "raydeploy.model.moe:MIXTRAL",
}


class UnknownModelType(ValueError):
    """A config's model_type that no family serves."""


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_ENTRIES))


@dataclass(frozen=True)
class Family:
    """One model family (see the module docstring)."""

    name: str
    config_from_hf: Callable[[dict[str, Any]], Any]
    param_specs: Callable[[Any], dict[str, TensorSpec]]
    module_path: str  # "python.module:Class" of the NNX decoder, constructor (cfg, dtype, param_dtype, rngs=,
    #                    kernel_layout=)
    hf_names: Sequence[tuple[str, str, str]]
    hf_ignored: Sequence[str] = ()
    gguf_names: Sequence[tuple[str, str, str]] | None = None
    rules: Mapping[str, Any] = field(default_factory=dict)  # sharding rules of the family's own logical axes
    mesh_check: Callable[[Any, dict[str, int]], None] | None = None  # raises ValueError for a mesh it cannot use
    num_experts: Callable[[Any], int] | None = None  # mixture-of-experts families: experts per layer
    experts_per_token: Callable[[Any], int] | None = None  # ... and how many each token is routed to

    def check_mesh(self, cfg: Any, mesh_shape: Mapping[str, int]) -> None:
        """Raise ValueError naming the numbers when the mesh cannot hold this model (e.g. ep vs experts)."""
        if self.mesh_check is not None:
            self.mesh_check(cfg, dict(mesh_shape))

    # -- the module
    def module_class(self) -> type:
        mod, attr = self.module_path.split(":")
        return getattr(importlib.import_module(mod), attr)  # type: ignore[no-any-return]

    def module(self, cfg: Any, dtype: str = "float32", param_dtype: str = "float32", rngs: Any = None,
               kernel_layout: str = "in_out") -> Any:
        return self.module_class()(cfg, dtype, param_dtype, rngs=rngs, kernel_layout=kernel_layout)

    # -- sizes
    def stacked_param_specs(self, cfg: Any) -> dict[str, TensorSpec]:
        """Per-layer tensors stacked over the layers (`layers.{i}.x` -> `layers.x` [L, ...]), as the module's
        state holds them."""
        out: dict[str, TensorSpec] = {}
        for name, spec in self.param_specs(cfg).items():
            split = split_layer_name(name)
            if split is None:
                out[name] = spec
            elif split[0] == 0:
                stacked = f"layers.{split[1]}"
                out[stacked] = TensorSpec(stacked, (cfg.num_layers, *spec.shape), (LAYER_AXIS, *spec.logical_axes))
        return out

    def param_count(self, cfg: Any) -> int:
        return sum(s.numel for s in self.param_specs(cfg).values())

    def active_param_count(self, cfg: Any) -> int:
        """Parameters one token's forward reads: an MoE token uses experts_per_token of num_experts experts."""
        total = self.param_count(cfg)
        if self.num_experts is None or self.experts_per_token is None:
            return total
        e, k = self.num_experts(cfg), self.experts_per_token(cfg)
        expert = sum(s.numel for s in self.param_specs(cfg).values() if "expert" in s.logical_axes)
        return total - expert + expert * k // e

    def param_bytes(self, cfg: Any, itemsize: int) -> int:
        return self.param_count(cfg) * itemsize

    def kv_pool_spec(self, cfg: Any, total_pages: int, page_size: int) -> TensorSpec:
        """The paged KV pool [layers, pages, page_size, 2 * kv_heads, head_dim] (as `spec.kv_pool_spec`)."""
        return TensorSpec("kv_pages", (cfg.num_layers, total_pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim),
                          (LAYER_AXIS, "cache_batch", "page_offset", "cache_kv_heads", "head_dim"))

    def kv_bytes_per_token(self, cfg: Any, itemsize: int) -> int:
        return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize

    # -- building from a flat {name: array} dict
    def build_model(self, cfg: Any, params: Mapping[str, Any], dtype: str = "float32",
                    param_dtype: str = "float32", kernel_layout: str = "in_out") -> tuple[Any, Any]:
        """(graphdef, state) of the family's module holding checkpoint-named (per-layer, in_out) `params`."""
        import flax.nnx as nnx
        import jax.numpy as jnp

        from raydeploy.model.llama import check_params, params_to_state
        from raydeploy.model.spec import is_kernel, kernel_input_dims

        model = nnx.eval_shape(lambda: self.module(cfg, dtype, param_dtype, kernel_layout=kernel_layout))
        graphdef, abstract = nnx.split(model)
        check_params(params, self.param_specs(cfg))
        stacked: dict[str, Any] = {}
        for name, spec in self.stacked_param_specs(cfg).items():
            lead = int(spec.logical_axes[:1] == (LAYER_AXIS,))
            x = (jnp.stack([jnp.asarray(params[f"layers.{i}.{name[len('layers.'):]}"]) for i in range(cfg.num_layers)])
                 if lead else jnp.asarray(params[name]))
            if kernel_layout == "out_in" and is_kernel(name):
                n, nd = kernel_input_dims(name), x.ndim
                x = jnp.transpose(x, tuple(range(lead)) + tuple(range(lead + n, nd)) + tuple(range(lead, lead + n)))
            stacked[name] = x
        return graphdef, params_to_state(stacked, abstract)


def family_for(model_type: str) -> Family:
    """The family serving `model_type`; an unknown one is an error naming the supported model types."""
    entry = _ENTRIES.get(model_type)
    if entry is None:
        raise UnknownModelType(f"model_type {model_type!r} is not supported (supported: "
                               f"{', '.join(supported_model_types())})")
    mod, attr = entry.split(":")
    fam = getattr(importlib.import_module(mod), attr)
    if not isinstance(fam, Family):
        raise TypeError(f"registry entry {entry} for {model_type!r} is not a Family")
    return fam


def from_hf_config(hf: Mapping[str, Any]) -> tuple[Family, Any]:
    """(family, parsed config) from a raw Hugging Face config dict."""
    fam = family_for(str(hf.get("model_type", "llama")))
    return fam, fam.config_from_hf(dict(hf))


def expert_split(num_experts: int, ep: int) -> int:
    """Experts per ep shard; an ep size that does not divide the expert count is an error naming both."""
    if ep < 1 or num_experts % ep:
        raise ValueError(f"mesh axis ep={ep} does not divide the model's {num_experts} experts "
                         f"(ep must be a divisor of {num_experts})")
    return num_experts // ep


def _llama_family() -> Family:
    from raydeploy.checkpoint.layout import GGUF_NAMES, HF_IGNORED, HF_NAMES
    from raydeploy.model.spec import LlamaConfig, param_specs

    return Family("llama", LlamaConfig.from_hf_dict, param_specs, "raydeploy.model.llama:Llama", HF_NAMES,
                  HF_IGNORED, GGUF_NAMES)


LLAMA = _llama_family()
