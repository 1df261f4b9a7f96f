"""A model's NNX state <-> a flat {name: array} dict named like the state's paths (`stacked_param_specs`).

`Family.build_model` fills a family module's abstract state with loaded arrays through `params_to_state`;
`check_params` is the one shape check of a set of named arrays against specs. Imports flax: the JAX-free
registry imports this module only inside the functions that build a model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.nnx as nnx
import jax

from raydeploy.checkpoint.format import numpy_dtype
from raydeploy.model.projection import QUANT_SCALE, OutIn
from raydeploy.model.quant import scale_name
from raydeploy.model.spec import LlamaConfig, TensorSpec, is_kernel, kernel_input_dims


def path_name(path: tuple[Any, ...]) -> str:
    """An NNX state path as our parameter name (`("layers", "attn", "q_proj", "kernel")` -> `layers.attn....`)."""
    return ".".join(str(p) for p in path)


def check_params(params: Mapping[str, Any], specs: Mapping[str, Any], what: str = "params") -> None:
    """Every name of `specs` present once with its shape; extra names are an error (they mean the checkpoint
    and the config disagree)."""
    missing = sorted(set(specs) - set(params))
    extra = sorted(set(params) - set(specs))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}")
        if extra:
            parts.append(f"unexpected {len(extra)} tensor(s), e.g. {', '.join(extra[:3])}")
        raise ValueError(f"{what} do not match the model: " + "; ".join(parts))
    for name, spec in specs.items():
        if tuple(params[name].shape) != tuple(spec.shape):
            raise ValueError(f"{what}: tensor {name} has shape {tuple(params[name].shape)}, the model expects "
                             f"{tuple(spec.shape)}")


def params_to_state(params: Mapping[str, jax.Array], abstract_state: nnx.State, what: str = "params"
                    ) -> nnx.State:
    """Fill the abstract state with arrays named like its paths (`stacked_param_specs`)."""
    flat = nnx.to_flat_state(abstract_state)
    check_params(params, {path_name(p): v for p, v in flat}, what)
    items = []
    for path, var in flat:
        arr = params[path_name(path)]
        if arr.dtype != var.dtype:
            arr = arr.astype(var.dtype)
        items.append((path, var.replace(arr)))
    return nnx.from_flat_state(items)


def out_in(name: str, data: Any) -> OutIn:
    """Kernel `name` held out_in (`data`, as `Family.stack_layers` transposes it) as the view the module reads as
    its in_out kernel; a stacked layer kernel keeps its layer axis in front."""
    inputs = kernel_input_dims(name)
    lead = int(name.startswith("layers."))
    return OutIn(data, inputs, len(data.shape) - lead - inputs)


def abstract_out_in(state: nnx.State) -> nnx.State:
    """An abstract in_out state with every kernel's leaf replaced by its out_in shape as an `OutIn` view (what
    `Family.build_model` fills it with): the leaves are the arrays an out_in engine holds."""
    items = []
    for path, var in nnx.to_flat_state(state):
        name = path_name(path)
        if is_kernel(name):
            x = var.get_value()
            lead = int(name.startswith("layers."))
            n, nd = kernel_input_dims(name), len(x.shape)
            perm = (*range(lead), *range(lead + n, nd), *range(lead, lead + n))
            var = var.replace(out_in(name, jax.ShapeDtypeStruct(tuple(x.shape[p] for p in perm), x.dtype)))
        items.append((path, var))
    return nnx.from_flat_state(items)


def state_to_params(state: nnx.State) -> dict[str, jax.Array]:
    """The inverse of `params_to_state`: {name: array} with stacked layer names."""
    return {path_name(p): v.get_value() for p, v in nnx.to_flat_state(state)}


def unstack_layers(cfg: LlamaConfig, stacked: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Stacked names -> checkpoint names (`layers.attn.q_proj.kernel`[i] -> `layers.{i}.attn.q_proj.kernel`)."""
    out: dict[str, jax.Array] = {}
    for name, arr in stacked.items():
        if name.startswith("layers."):
            for i in range(cfg.num_layers):
                out[f"layers.{i}.{name[len('layers.'):]}"] = arr[i]
        else:
            out[name] = arr
    return out


def quantize_module(module: nnx.Module, specs: Mapping[str, TensorSpec]) -> nnx.Module:
    """`module` (a family's decoder, stacked layers) holding quantized kernels where `specs` (its quantized stacked
    specs, `raydeploy.model.quant.quantized_specs`) gives a kernel its own dtype: that kernel becomes a parameter
    of the quantized dtype, and its projection module gains the float32 scale (`QUANT_SCALE`), both zeros (what
    `Family.build_model` fills). The families' modules never know: their projections read a `Quantized` pair
    wherever the scale is present (`raydeploy.model.projection.kernel_value`)."""
    import jax.numpy as jnp

    for path, m in list(nnx.iter_modules(module)):
        name = path_name((*path, "kernel"))
        spec = specs.get(name)
        if spec is None or spec.dtype is None or not isinstance(getattr(m, "kernel", None), nnx.Param):
            continue
        scale = specs[scale_name(name)]
        m.kernel = nnx.Param(jnp.zeros(spec.shape, numpy_dtype(spec.dtype)))  # type: ignore[attr-defined]
        setattr(m, QUANT_SCALE, nnx.Param(jnp.zeros(scale.shape, numpy_dtype(scale.dtype or "float32"))))
    return module
