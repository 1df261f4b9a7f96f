"""Model families: a Hugging Face `model_type` -> the family that serves it.

A `Family` supplies everything the rest of the system needs to know about one architecture:
- `config_from_hf(dict)`: the family's config dataclass from a raw `config.json` dict;
- `param_specs(cfg)`: every parameter (checkpoint names, in_out layouts, logical axes);
- `module(cfg, dtype, param_dtype, rngs)`: the Flax NNX decoder (kernels in_out, as `param_specs` has them; an
  engine that holds them out_in gets them wrapped at load, `abstract_model` / `build_model`, and the module never
  knows);
- `kv_heads(cfg)` / `head_dim`: the KV spec (the paged pool's shape, `kv_pool_spec`);
- `hf_names` / `hf_ignored`: the foreign-name table of the safetensors converter (regex, our name, layout kind;
  see `raydeploy.model.names`);
- `gguf_names` / `gguf_ignored`: the same for llama.cpp's GGUF names (None: no GGUF converter for the family);
  besides the common layout kinds they may use `GGUF_NORM_PLUS_ONE` and `GGUF_STACKED_EXPERTS_OI` (names).

The registry itself is a table of model_type -> "module:attribute" strings; a family module is imported only
when that model_type is asked for. An unknown model_type is an error listing the supported ones.
Adding a dense family: one new module defining `FAMILY`, one line in `_ENTRIES` (see docs/families.md).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from raydeploy.model.names import GGUF_IGNORED, GGUF_NAMES, HF_IGNORED, HF_NAMES
from raydeploy.model.quant import check_mode, quantized_specs, storage_bytes
from raydeploy.model.sharding import partition_spec
from raydeploy.model.spec import (
    KERNEL_LAYOUTS,
    LAYER_AXIS,
    LlamaConfig,
    TensorSpec,
    is_kernel,
    kernel_input_dims,
    out_in_spec,
    param_specs,
    split_layer_name,
    stack_layer_specs,
)

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

# model_type -> (tool-call format, reasoning markup) its chat models are tuned on; kept apart from the families so
# the HTTP ingress reads it without importing a family module (they import JAX). One family may serve several
# model_types that chat differently (the llama family serves Mistral's and Qwen2's models).
_CHAT: dict[str, tuple[str, str | None]] = {
    "llama": ("llama3_json", None),
    "mistral": ("mistral", None),
    "qwen2": ("hermes", None),
    "qwen3": ("hermes", "think"),
    "gemma3_text": ("gemma3", None),
    "qwen3_moe": ("hermes", "think"),
    "mixtral": ("mistral", None),
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
    module_path: str  # "python.module:Class" of the NNX decoder, constructor (cfg, dtype, param_dtype, rngs=)
    hf_names: Sequence[tuple[str, str, str]]
    hf_ignored: Sequence[str] = ()
    gguf_names: Sequence[tuple[str, str, str]] | None = None
    gguf_ignored: Sequence[str] = ()
    rules: Mapping[str, Any] = field(default_factory=dict)  # sharding rules of the family's own logical axes
    mesh_check: Callable[[Any, dict[str, int]], None] | None = None  # raises ValueError for a mesh it cannot use
    num_experts: Callable[[Any], int] | None = None  # mixture-of-experts families: experts per layer
    experts_per_token: Callable[[Any], int] | None = None  # ... and how many each token is routed to
    kernel_layouts: tuple[str, ...] = ("in_out", "out_in")  # kernel layouts an engine may hold the kernels in
    tool_format: str = "llama3_json"  # how its chat models write tool calls (raydeploy.serve.chat formats)
    reasoning: str | None = None  # "think": reasoning between <think> and </think> (Qwen3); None: no reasoning markup
    quantization: str = "none"  # how its projection kernels are held (`with_quantization`, raydeploy.model.quant)

    def with_quantization(self, mode: str) -> Family:
        """This family with its projection kernels quantized as `mode` (none / int8 / fp8,
        `raydeploy.model.quant`): `param_specs` lists each quantized kernel with its stored dtype and its scale
        after it, so the checkpoint specs, the engine's specs and shardings, `stack_layers`, `abstract_model` and
        `build_model` all see int8 kernels and their scales. A family is quantized once."""
        if check_mode(mode) == self.quantization:
            return self
        if self.quantization != "none":
            raise ValueError(f"the {self.name} family is already quantized {self.quantization}; cannot make it {mode}")
        base = self.param_specs
        return dataclasses.replace(self, quantization=mode, param_specs=lambda cfg: quantized_specs(base(cfg), mode))

    def weight_bytes(self, cfg: Any, param_dtype: str) -> int:
        """Bytes of every parameter as held: each in its own dtype (a quantized kernel's int8 / fp8, its float32
        scale) or else `param_dtype`."""
        return storage_bytes(self.param_specs(cfg), param_dtype)

    def check_mesh(self, cfg: Any, mesh_shape: Mapping[str, int]) -> None:
        """Raise ValueError naming the numbers when the mesh cannot hold this model (e.g. ep vs experts)."""
        if self.mesh_check is not None:
            self.mesh_check(cfg, dict(mesh_shape))

    # -- the module
    def module_class(self) -> type:
        mod, attr = self.module_path.split(":")
        return getattr(importlib.import_module(mod), attr)  # type: ignore[no-any-return]

    def module(self, cfg: Any, dtype: str = "float32", param_dtype: str = "float32", rngs: Any = None) -> Any:
        """The family's decoder; a quantized family's holds its quantized kernels and their scales (zeros, to fill:
        `raydeploy.model.state.quantize_module`)."""
        m = self.module_class()(cfg, dtype, param_dtype, rngs=rngs)
        if self.quantization == "none":
            return m
        from raydeploy.model.state import quantize_module  # imports flax: only when building

        return quantize_module(m, self.stacked_param_specs(cfg))

    # -- sizes
    def stacked_param_specs(self, cfg: Any) -> dict[str, TensorSpec]:
        """Per-layer tensors stacked over the layers (`layers.{i}.x` -> `layers.x` [L, ...]), as the module's
        state holds them."""
        return stack_layer_specs(self.param_specs(cfg), cfg.num_layers)

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

    def kv_pool_spec(self, cfg: Any, total_pages: int, page_size: int, layers: int | None = None) -> TensorSpec:
        """The paged KV pool [layers, pages, page_size, 2 * kv_heads, head_dim] (as `spec.kv_pool_spec`) of
        every layer, or of `layers` of them."""
        n = cfg.num_layers if layers is None else layers
        return TensorSpec("kv_pages", (n, total_pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim),
                          (LAYER_AXIS, "cache_batch", "page_offset", "cache_kv_heads", "head_dim"))

    def layer_windows(self, cfg: Any) -> tuple[int | None, ...]:
        """Each layer's attention window in tokens (None: the whole sequence), as the module passes
        `sliding_window=` to the engine's attention: a config's `sliding_window` on every layer, or on the
        layers its `local_layers` marks (Gemma 3)."""
        window = getattr(cfg, "sliding_window", None)
        local = getattr(cfg, "local_layers", None)
        if local is None:
            return (window,) * cfg.num_layers
        return tuple(window if is_local else None for is_local in local)

    def kv_bytes_per_token(self, cfg: Any, itemsize: int) -> int:
        return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize

    # -- the engine's view: stacked layers, kernels in the engine's layout
    def resolve_kernel_layout(self, kernel_layout: str) -> str:
        """`kernel_layout` if the family's kernels may be held so; an auto choice (`preferred`) falls back to in_out."""
        return kernel_layout if kernel_layout in self.kernel_layouts else "in_out"

    def abstract_model(self, cfg: Any, dtype: str = "float32", param_dtype: str = "float32",
                       kernel_layout: str = "in_out") -> tuple[Any, Any]:
        """The module's graphdef and abstract state (ShapeDtypeStructs); nothing is allocated. With `kernel_layout`
        out_in, each kernel's leaf is its out_in shape wrapped as an `OutIn` view (`raydeploy.model.state.out_in`):
        the module reads it as the in_out kernel it declares."""
        import flax.nnx as nnx

        from raydeploy.model.state import abstract_out_in  # imports flax: only when building

        self._check_layout(cfg, kernel_layout)
        graphdef, state = nnx.split(nnx.eval_shape(lambda: self.module(cfg, dtype, param_dtype)))
        return graphdef, (abstract_out_in(state) if kernel_layout == "out_in" else state)

    def _check_layout(self, cfg: Any, kernel_layout: str) -> None:
        if kernel_layout not in KERNEL_LAYOUTS:
            raise ValueError(f"kernel_layout must be one of {', '.join(KERNEL_LAYOUTS)}, got {kernel_layout!r}")
        if kernel_layout not in self.kernel_layouts:
            what = "a mixture-of-experts model" if self.num_experts else f"the {self.name} family"
            raise ValueError(f"{cfg.model_type}: kernel_layout must be {' or '.join(self.kernel_layouts)} for {what}, "
                             f"got {kernel_layout!r}")

    def engine_param_specs(self, cfg: Any, kernel_layout: str = "in_out") -> dict[str, TensorSpec]:
        """The parameters as an engine holds them: stacked over the layers, kernels in `kernel_layout`."""
        if kernel_layout not in KERNEL_LAYOUTS:
            raise ValueError(f"kernel_layout must be one of {', '.join(KERNEL_LAYOUTS)}, got {kernel_layout!r}")
        specs = self.stacked_param_specs(cfg)
        return specs if kernel_layout == "in_out" else {n: out_in_spec(s) for n, s in specs.items()}

    def checkpoint_specs(self, cfg: Any, names: Collection[str]) -> dict[str, TensorSpec]:
        """The specs to read a checkpoint holding tensors `names` with: stacked over the layers
        (`stacked_param_specs`, what converters write) when it holds a stacked layer tensor, else per layer
        (`param_specs`, checkpoints converted before stacking, or with `--layers per-layer`)."""
        stacked = self.stacked_param_specs(cfg)
        if any(n.startswith("layers.") and n in stacked for n in names):
            return stacked
        return self.param_specs(cfg)

    def stack_layers(self, cfg: Any, params: Mapping[str, Any], kernel_layout: str = "in_out",
                     mesh: Any = None, rules: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Checkpoint params (in_out kernels; per-layer names, or already stacked over the layers as
        `stacked_param_specs`) -> the engine's: each per-layer tensor stacked over the layers, kernels in
        `kernel_layout`. With a mesh, each result is placed by its logical axes (the layer axis unsharded), one
        parameter kind at a time, one compiled program per (shape, sharding); a tensor that needs neither
        stacking nor a transpose is passed on as it is (placed by the reader with the same sharding)."""
        import jax
        import jax.numpy as jnp

        from raydeploy.model.state import check_params  # imports flax: only when stacking

        stacked_in = not any(split_layer_name(n) for n in params)
        check_params(params, self.stacked_param_specs(cfg) if stacked_in else self.param_specs(cfg))
        targets = self.engine_param_specs(cfg, kernel_layout)
        programs: dict[tuple[Any, ...], Any] = {}
        out: dict[str, Any] = {}
        for name, spec in targets.items():
            lead = int(spec.logical_axes[:1] == (LAYER_AXIS,))  # the engine's tensor has a layer axis first
            stacked = bool(lead) and not stacked_in  # ... that is made here, from per-layer tensors
            suffix = name[len("layers."):]
            members = [params[f"layers.{i}.{suffix}"] for i in range(cfg.num_layers)] if stacked else [params[name]]
            perm: tuple[int, ...] | None = None
            if kernel_layout == "out_in" and is_kernel(name):
                n = kernel_input_dims(name)
                nd = members[0].ndim + int(stacked)
                perm = tuple(range(lead)) + tuple(range(lead + n, nd)) + tuple(range(lead, lead + n))

            def assemble(*xs: Any, perm: tuple[int, ...] | None = perm, stacked: bool = stacked) -> Any:
                x = jnp.stack(xs) if stacked else xs[0]
                return x if perm is None else jnp.transpose(x, perm)

            if mesh is None:
                out[name] = assemble(*members)
                continue
            if not stacked and perm is None:
                out[name] = members[0]
                continue
            from jax.sharding import NamedSharding

            sharding = NamedSharding(mesh, partition_spec(spec.logical_axes, {**self.rules, **dict(rules or {})},
                                                          dict(mesh.shape), name))
            key = (perm, stacked, len(members), sharding)
            if key not in programs:
                programs[key] = jax.jit(assemble, out_shardings=sharding)
            out[name] = programs[key](*members)
        return out

    def build_model(self, cfg: Any, params: Mapping[str, Any], dtype: str = "float32",
                    param_dtype: str = "float32", kernel_layout: str = "in_out") -> tuple[Any, Any]:
        """(graphdef, state) of the family's module holding `params`: checkpoint-named arrays (per layer,
        in_out; stacked here) or arrays already stacked in `kernel_layout` (`stack_layers`; kept as they are)."""
        from raydeploy.model.state import out_in, params_to_state  # imports flax: only when building

        if any(split_layer_name(n) for n in params):
            params = self.stack_layers(cfg, params, kernel_layout)
        graphdef, abstract = self.abstract_model(cfg, dtype, param_dtype)
        if kernel_layout == "out_in":
            self._check_layout(cfg, kernel_layout)
            params = {n: out_in(n, a) if is_kernel(n) else a for n, a in params.items()}
        return graphdef, params_to_state(params, abstract)

    def eos_ids(self, cfg: Any) -> tuple[int, ...]:
        return tuple(int(t) for t in cfg.eos_token_ids)

    def summary(self, cfg: Any) -> dict[str, Any]:
        """The shape figures `raydeploy plan` prints."""
        out = {"model_type": cfg.model_type, "family": self.name, "layers": cfg.num_layers,
               "hidden": cfg.hidden_size, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
               "head_dim": cfg.head_dim, "ffn": cfg.intermediate_size, "vocab": cfg.vocab_size,
               "tied_embeddings": cfg.tie_word_embeddings}
        if self.num_experts is not None and self.experts_per_token is not None:
            del out["ffn"]  # every layer's MLP is routed experts: a dense intermediate size would be unused
            out.update(experts=self.num_experts(cfg), experts_per_token=self.experts_per_token(cfg),
                       expert_ffn=getattr(cfg, "moe_intermediate_size", None))
        return out


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
    tool_format, reasoning = _CHAT[model_type]
    if (fam.tool_format, fam.reasoning) != (tool_format, reasoning):  # one Family object per model_type
        fam = _CHAT_FAMILIES.setdefault(model_type, dataclasses.replace(fam, tool_format=tool_format,
                                                                         reasoning=reasoning))
    return fam


_CHAT_FAMILIES: dict[str, Family] = {}
_CHAT_DEFAULT: tuple[str, str | None] = (Family.tool_format, Family.reasoning)  # the dataclass's defaults


def chat_formats(model_type: str | None) -> tuple[str, str | None]:
    """(tool-call format, reasoning markup) of `model_type`'s chat models (a family's name is taken too), without
    importing its family; an unknown or missing one gets Family's defaults."""
    names = {"gemma3": "gemma3_text"}
    key = names.get(model_type or "", model_type or "")
    return _CHAT.get(key, _CHAT_DEFAULT)


def from_hf_config(hf: Mapping[str, Any], source: str | None = None) -> tuple[Family, Any]:
    """(family, parsed config) from a raw Hugging Face config dict. With `source` (the config.json it came
    from), a config the family cannot use is a ValueError naming that file."""
    fam = family_for(str(hf.get("model_type", "llama")))
    try:
        return fam, fam.config_from_hf(dict(hf))
    except (KeyError, ValueError, TypeError) as e:
        if source is None:
            raise
        what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"{source}: not a usable {fam.name} config: {what}") from e


def expert_split(num_experts: int, ep: int) -> int:
    """Experts per ep shard; an ep size that does not divide the expert count is an error naming both."""
    if ep < 1 or num_experts % ep:
        raise ValueError(f"mesh axis ep={ep} does not divide the model's {num_experts} experts "
                         f"(ep must be a divisor of {num_experts})")
    return num_experts // ep


def _llama_family() -> Family:
    return Family("llama", LlamaConfig.from_hf_dict, param_specs, "raydeploy.model.llama:Llama", HF_NAMES,
                  HF_IGNORED, GGUF_NAMES, GGUF_IGNORED)


LLAMA = _llama_family()
