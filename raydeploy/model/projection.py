"""The projection layers every family builds on (`Dense`, `HeadsProj`, `OutProj`, `project`) and what they multiply
with: a matmul backend handed in by the caller, never found through ambient state.

A family's forward passes take `matmul=` (a `Matmul`: `raydeploy.engine.matmul` chooses one per engine: XLA's dot,
the native CPU kernels, the GPU's Pallas kernel) and hand it down to every projection; without one (tests,
scoring, `prefill`) the projections multiply with XLA's dot (`dot`). A backend that reads a stacked weight whole
(`Matmul.reads_whole`) gets each layer's kernels as `LayerSlice`s from the layer scan
(`raydeploy.model.scan.scan_layers`) instead of sliced copies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import flax.nnx as nnx
import jax
import jax.numpy as jnp

from raydeploy.model.quant import Quantized

if TYPE_CHECKING:
    from raydeploy.lora.batched import LoraRows

jax.tree_util.register_pytree_node_class(Quantized)  # quant.py stays JAX-free: the module that multiplies registers it


class LayerSlice:
    """Layer `layer` of a stacked weight `stack` [L, ...], not sliced out: a kernel takes the stack and the
    index, so a layer scan passes the weights through untouched (XLA CPU copies a layer's slice of a stacked
    weight into a new buffer before any library call reads it). Reads as the layer's own array would
    (`shape`, `dtype`, `[...]`, `reshape`); `materialize()` is that array, for whatever a kernel does not run.
    `name`: the stacked parameter's path in the layer module ("attn.q_proj.kernel"), by which a kernel that
    needs the weight's sharding or a packed copy looks it up."""

    def __init__(self, stack: jax.Array, layer: jax.Array, shape: Sequence[int] | None = None,
                 name: str | None = None) -> None:
        self.stack, self.layer, self.name = stack, layer, name
        self.shape = tuple(stack.shape[1:] if shape is None else shape)

    @property
    def dtype(self) -> Any:
        return self.stack.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, key: Any) -> Any:
        return self if key is Ellipsis else self.materialize()[key]

    def reshape(self, *shape: Any) -> LayerSlice:
        dims = list(shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)
        size = 1
        for d in self.shape:
            size *= d
        if -1 in dims:
            known = 1
            for d in dims:
                known *= d if d != -1 else 1
            dims[dims.index(-1)] = size // known
        return LayerSlice(self.stack, self.layer, dims, self.name)

    def materialize(self) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(self.stack, self.layer, keepdims=False).reshape(self.shape)


@jax.tree_util.register_pytree_node_class
class OutIn:
    """A projection kernel held out_in (`data`: its output dims before its input dims, as `EngineConfig.kernel_layout`
    out_in transposes it once at load, `Family.stack_layers`) that reads as the in_out kernel the module declares:
    `shape` is the in_out shape, `reshape` merges within the input and within the output dims, and `dot`
    contracts `data`'s last dim. The families never see the layout; `Family.abstract_model` and `build_model`
    wrap the kernels. A pytree: leading dims past the kernel's own (a stack's layer axis) stay in front, so a
    layer scan slices `data` as it would the array."""

    def __init__(self, data: Any, inputs: int, outputs: int) -> None:
        self.data, self.inputs, self.outputs = data, inputs, outputs

    def tree_flatten(self) -> tuple[tuple[Any], tuple[int, int]]:
        return (self.data,), (self.inputs, self.outputs)

    @classmethod
    def tree_unflatten(cls, aux: tuple[int, int], children: Any) -> OutIn:
        return cls(children[0], *aux)

    @property
    def shape(self) -> tuple[int, ...]:
        s = tuple(self.data.shape)
        lead = len(s) - self.inputs - self.outputs
        return s[:lead] + s[len(s) - self.inputs:] + s[lead:len(s) - self.inputs]

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    def astype(self, dtype: Any) -> OutIn:
        return OutIn(self.data.astype(dtype), self.inputs, self.outputs)

    def __getitem__(self, key: Any) -> Any:
        if key is Ellipsis:
            return self
        raise TypeError("an out_in kernel is read whole ([...]) or reshaped")

    def reshape(self, *shape: Any) -> OutIn:
        """The kernel (without leading dims) reshaped as its in_out form would be, merging only within its input
        and within its output dims."""
        dims = list(shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)
        logical = self.shape
        if len(logical) != self.inputs + self.outputs:
            raise ValueError(f"an out_in kernel with leading dims {logical} is reshaped per layer, not stacked")
        size = math.prod(logical)
        if -1 in dims:
            dims[dims.index(-1)] = size // math.prod(d for d in dims if d != -1)
        k = math.prod(logical[:self.inputs])
        split = next((j for j in range(len(dims) + 1) if math.prod(dims[:j]) == k), None)
        if split is None:
            raise ValueError(f"reshaping an out_in kernel {logical} to {tuple(dims)} mixes input and output dims")
        return OutIn(self.data.reshape(*dims[split:], *dims[:split]), split, len(dims) - split)


def dot(x: jax.Array, w: Any, out_first: bool = False) -> jax.Array:
    """x [..., K] times a 2-D weight in XLA, in x's dtype: w is [K, N] or, with out_first, [N, K]; an array, a
    `LayerSlice` or an `OutIn` (read as its in_out form, [K, N]). Lower-precision weights (bfloat16 params, float32
    activations) multiply natively with float32 accumulation: casting the weight up instead would rewrite it every
    step on XLA CPU. A `Quantized` weight (int8 / float8 with a scale per output channel,
    `raydeploy.model.quant`) is converted to x's dtype inside the dot, `dot_general(x, q.astype(x.dtype)) * scale`:
    XLA fuses the convert into the dot's operand, so the weight is read as stored."""
    scale = None
    if isinstance(w, Quantized):
        if out_first:
            raise ValueError("a quantized kernel multiplies in_out (out_first is for a tied embedding table)")
        w, scale = w.data, w.scale
    if isinstance(w, LayerSlice):
        w = w.materialize()
    if isinstance(w, OutIn):
        w, out_first = w.data, not out_first
    dims = (((x.ndim - 1,), (1 if out_first else 0,)), ((), ()))
    if scale is not None:
        y = jax.lax.dot_general(x, w.astype(x.dtype), dims, preferred_element_type=jnp.float32)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)
    xw = x if w.dtype == x.dtype else x.astype(w.dtype)
    return jax.lax.dot_general(xw, w, dims, preferred_element_type=x.dtype)


class Matmul(Protocol):
    """A matmul backend as the model sees it (`raydeploy.engine.matmul` has them)."""

    reads_whole: bool
    """Whether it reads stacked layer kernels whole: the layer scan then passes them as `LayerSlice`s."""

    def matmul(self, x: jax.Array, w: Any, out_first: bool = False) -> jax.Array:
        """x @ w as `dot` computes it (w an array or a `LayerSlice`)."""
        ...

    def matmuls(self, x: jax.Array, ws: Sequence[Any]) -> list[jax.Array] | None:
        """[x @ w for w in ws] (in_out weights) in one call, or None where the backend has no such call."""
        ...

    def tied_head(self, h: jax.Array, table: jax.Array) -> jax.Array:
        """h [..., D] times a tied embedding table [V, D] (the LM head) -> [..., V]."""
        ...


def _mul(mm: Matmul | None, x: jax.Array, w: Any) -> jax.Array:
    return dot(x, w) if mm is None else mm.matmul(x, w)


QUANT_SCALE = "kernel_scale"
"""Attribute of a projection module holding its quantized kernel's scale (`raydeploy.model.quant`: the parameter
`<path>.kernel_scale`); absent on a float model's modules."""


def kernel_value(module: nnx.Module, inputs: int = 1) -> Any:
    """A projection module's kernel as its backend multiplies it: the kernel, or, where the module holds a
    quantized kernel (a `kernel_scale` beside it), the `Quantized` pair with `inputs` contracted leading dims."""
    scale = getattr(module, QUANT_SCALE, None)
    if scale is None:
        return module.kernel[...]  # type: ignore[attr-defined]
    return Quantized(module.kernel[...], scale[...], inputs)  # type: ignore[attr-defined]


def _param(rngs: nnx.Rngs | None, shape: tuple[int, ...], dtype: Any, std: float = 0.02) -> nnx.Param:
    """A parameter of `shape` (with the stacked layer dims already in front): zeros, or random with `rngs`."""
    if rngs is None:
        return nnx.Param(jnp.zeros(shape, dtype))
    return nnx.Param((std * jax.random.normal(rngs.params(), shape)).astype(dtype))


class HeadsProj(nnx.Module):
    """[.., embed] -> [.., heads, head_dim]; kernel [embed, heads, head_dim], optional bias [heads, head_dim]."""

    def __init__(self, d: int, heads: int, hd: int, bias: bool, param_dtype: Any, rngs: nnx.Rngs | None,
                 lead: tuple[int, ...] = ()) -> None:
        self.kernel = _param(rngs, (*lead, d, heads, hd), param_dtype)
        self.bias = _param(rngs, (*lead, heads, hd), param_dtype) if bias else None

    def weight2d(self) -> Any:
        """The kernel over the flattened heads: [embed, heads * head_dim]."""
        d, n, h = self.kernel.shape
        # A 2-D matmul over the flattened heads is about 2x faster than the 3-D einsum on XLA CPU.
        return kernel_value(self).reshape((d, n * h))

    def finish(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """x's flat projection y -> [.., heads, head_dim], plus the bias."""
        n, h = self.kernel.shape[1:]
        y = y.reshape(*x.shape[:-1], n, h)
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        return y

    def __call__(self, x: jax.Array, mm: Matmul | None = None) -> jax.Array:
        return self.finish(x, _mul(mm, x, self.weight2d()))


class OutProj(nnx.Module):
    """[.., heads, head_dim] -> [.., embed]; kernel [heads, head_dim, embed]."""

    def __init__(self, heads: int, hd: int, d: int, param_dtype: Any, rngs: nnx.Rngs | None,
                 lead: tuple[int, ...] = ()) -> None:
        self.kernel = _param(rngs, (*lead, heads, hd, d), param_dtype)

    def __call__(self, x: jax.Array, mm: Matmul | None = None) -> jax.Array:
        n, h = x.shape[-2:]
        w = kernel_value(self, inputs=2).reshape((n * h, -1))
        return _mul(mm, x.reshape(*x.shape[:-2], n * h), w)


class Dense(nnx.Module):
    """[.., din] -> [.., dout]; kernel [din, dout]."""

    def __init__(self, din: int, dout: int, param_dtype: Any, rngs: nnx.Rngs | None,
                 lead: tuple[int, ...] = ()) -> None:
        self.kernel = _param(rngs, (*lead, din, dout), param_dtype)

    def weight2d(self) -> Any:
        return kernel_value(self)

    def finish(self, x: jax.Array, y: jax.Array) -> jax.Array:
        return y

    def __call__(self, x: jax.Array, mm: Matmul | None = None) -> jax.Array:
        return _mul(mm, x, kernel_value(self))


def project(x: jax.Array, projections: Sequence[HeadsProj | Dense], mm: Matmul | None = None,
            lora: LoraRows | None = None, names: Sequence[str] = ()) -> list[jax.Array]:
    """Each projection of the same x (a layer's q, k, v, or gate and up): in one backend call where the backend
    has one (`Matmul.matmuls`: the native CPU kernel), else one matmul each. `lora`: the step's adapters
    (`raydeploy.lora.batched`), added to each output by its module name in `names` ("q_proj", ...), whatever
    the base weight is."""
    out = None
    if mm is not None:
        ys = mm.matmuls(x, [m.weight2d() for m in projections])
        if ys is not None:
            out = [m.finish(x, y) for m, y in zip(projections, ys, strict=True)]
    if out is None:
        out = [m(x, mm) for m in projections]
    if lora is None:
        return out
    return lora.add_all(names, x, out)
