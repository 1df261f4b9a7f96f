"""Quantized weights: int8 (and fp8 e4m3) projection kernels with a float32 scale per output channel.

The contract (`model.quantization`, docs/quantization.md), read by every matmul backend:

- What is quantized: every projection kernel (`quantized_kernel`): attention q/k/v/o, MLP gate/up/down and the
  MoE experts' kernels. The embedding table, a separate LM head, the MoE router and the norms stay in
  `model.param_dtype`: the table is read one row per token (int8 saves no decode bandwidth there), the router
  decides which experts run (a small matrix whose rounding would move tokens between experts), and the LM
  head is left for later (docs/quantization.md gives its bytes).
- Symmetric, per output channel: s = max|w| over the kernel's input dims / 127, q = round(w / s) clipped to
  [-127, 127] (int8); fp8: q = float8_e4m3fn(w / s) with s = max|w| / 448. An all-zero channel gets s = 1.
- The scale is its own tensor, named `<kernel>_scale` (`scale_name`), float32, shaped like the kernel with its
  input dims removed (a stacked layer axis, an expert axis kept in front) and carrying the kernel's output
  logical axes (`scale_spec`): it shards exactly like the weight's output dims, so a host reads only its part.
  The kernel keeps its name, shape and logical axes; its `TensorSpec.dtype` says int8 or float8_e4m3fn.
- In the model, a projection module holding a quantized kernel (a `kernel_scale` parameter beside `kernel`)
  hands its backend a `Quantized(data, scale, inputs)`: `data` the int8 kernel (an array, a layer's
  `LayerSlice`, an `OutIn` view), `scale` the float32 scale, `inputs` how many leading dims of the in_out
  shape are contracted. `Quantized.reshape` reshapes both as the in_out kernel would be. XLA's dot
  (`raydeploy.model.projection.dot`) computes `dot_general(x, data.astype(x.dtype)) * scale`, so the
  conversion sits inside the dot's fusion and HBM reads int8. A kernel backend that reads quantized weights
  (the GPU Pallas kernel) takes the same pytree: int8 [K, N] and float32 [N] per layer.

numpy (`quantize_np`, `dequantize_np`: converters, tests) and jax (`quantize_jax`: load-time quantization of
sharded arrays, where XLA reduces the max over an fsdp-split input dim across its shards) compute the same
values. `fp8_support` is the one check of a chip for fp8 that the engine and `raydeploy plan` share.

JAX-free at import (the registry, the planner and config checks read the specs and `fp8_support`): the jax
functions import jax when called, and `raydeploy.model.projection` (the module that multiplies) registers
`Quantized` as a pytree when it is imported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from raydeploy.checkpoint.format import numpy_dtype
from raydeploy.model.spec import LAYER_AXIS, TensorSpec, is_kernel, kernel_input_dims

MODES = ("none", "int8", "fp8")
"""`model.quantization` values."""
STORAGE_DTYPES = {"int8": "int8", "fp8": "float8_e4m3fn"}
"""Per mode, the stored (and held) dtype of a quantized kernel."""
QMAX = {"int8": 127.0, "fp8": 448.0}
"""Per mode, the largest magnitude a quantized value holds: max|w| of a channel maps to it."""
SCALE_DTYPE = "float32"
SCALE_SUFFIX = "_scale"


def mode_of_dtype(dtype: str) -> str | None:
    """The mode whose stored dtype is `dtype` ("int8" -> "int8"), or None for a float dtype."""
    return next((m for m, d in STORAGE_DTYPES.items() if d == dtype), None)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"quantization must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


# -- which tensors, which dims -------------------------------------------------------------------------------

def quantized_kernel(name: str) -> bool:
    """Whether kernel `name` (a checkpoint or stacked name) is quantized: every projection kernel except a
    separate LM head and the MoE router (module docstring)."""
    return is_kernel(name) and not name.startswith("lm_head.") and ".router." not in name


def scale_name(name: str) -> str:
    """'layers.0.attn.q_proj.kernel' -> 'layers.0.attn.q_proj.kernel_scale'."""
    return name + SCALE_SUFFIX


def is_scale(name: str) -> bool:
    return name.endswith(".kernel" + SCALE_SUFFIX)


def input_dims(name: str, ndim: int, lead: int) -> tuple[int, ...]:
    """The contracted dims of kernel `name` (in_out, `ndim` dims, of which `lead` are a stacked layer axis in
    front): one (o_proj: two) right after the leading dims; the MoE experts' [E, in, out] after the expert."""
    start = lead + (1 if ".experts." in name else 0)
    n = kernel_input_dims(name)
    if start + n >= ndim:
        raise ValueError(f"kernel {name} of {ndim} dims has no output dim after its input dims")
    return tuple(range(start, start + n))


def _lead(spec: TensorSpec) -> int:
    return int(spec.logical_axes[:1] == (LAYER_AXIS,))


def scale_spec(spec: TensorSpec) -> TensorSpec:
    """The scale of quantized kernel `spec` (in_out): its shape and logical axes without the input dims."""
    drop = set(input_dims(spec.name, len(spec.shape), _lead(spec)))
    keep = [i for i in range(len(spec.shape)) if i not in drop]
    return TensorSpec(scale_name(spec.name), tuple(spec.shape[i] for i in keep),
                      tuple(spec.logical_axes[i] for i in keep), SCALE_DTYPE)


def quantized_specs(specs: Mapping[str, TensorSpec], mode: str) -> dict[str, TensorSpec]:
    """A model's specs (in_out, per layer or stacked) with every quantized kernel stored as `mode` and its scale
    right after it; unchanged for "none"."""
    if check_mode(mode) == "none":
        return dict(specs)
    out: dict[str, TensorSpec] = {}
    for name, spec in specs.items():
        if quantized_kernel(name):
            out[name] = replace(spec, dtype=STORAGE_DTYPES[mode])
            out[scale_name(name)] = scale_spec(spec)
        else:
            out[name] = spec
    return out


# -- the values ----------------------------------------------------------------------------------------------

def quantize_np(w: np.ndarray, mode: str, axes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(q, scale) of float `w` quantized over its input dims `axes` (module docstring); computed in float32."""
    import ml_dtypes

    w32 = np.asarray(w, np.float32)
    amax = np.max(np.abs(w32), axis=tuple(axes), keepdims=True)
    # times the reciprocal, as XLA computes a division by a constant: numpy and jax give the same bits
    scale = np.where(amax > 0, amax * np.float32(1.0 / QMAX[mode]), 1.0).astype(np.float32)
    if mode == "int8":
        q = np.clip(np.rint(w32 / scale), -127, 127).astype(np.int8)
    else:
        q = np.clip(w32 / scale, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return q, np.squeeze(scale, axis=tuple(axes))


def dequantize_np(q: np.ndarray, scale: np.ndarray, axes: Sequence[int]) -> np.ndarray:
    """float32 w ~= q * scale, the scale broadcast over the input dims `axes`."""
    return np.asarray(q, np.float32) * np.expand_dims(np.asarray(scale, np.float32), tuple(axes))


def quantize_jax(w: Any, mode: str, axes: Sequence[int]) -> tuple[Any, Any]:
    """`quantize_np` in jax (jit it with the output shardings: over an fsdp-split input dim XLA all-reduces the
    channel max across the shards, so every host quantizes only its own slices with the global scale)."""
    import jax.numpy as jnp

    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=tuple(axes), keepdims=True)
    scale = jnp.where(amax > 0, amax * jnp.float32(1.0 / QMAX[mode]), 1.0)
    if mode == "int8":
        q = jnp.clip(jnp.round(w32 / scale), -127, 127).astype(jnp.int8)
    else:
        q = jnp.clip(w32 / scale, -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return q, jnp.squeeze(scale, axis=tuple(axes))


class Quantized:
    """A quantized projection kernel as a projection hands it to a matmul backend (module docstring): `data`
    (int8 / float8, read as the in_out kernel: an array, a `LayerSlice` or an `OutIn`), `scale` (float32, the
    in_out shape's output dims) and `inputs`, how many leading dims of the in_out shape are contracted."""

    def __init__(self, data: Any, scale: Any, inputs: int) -> None:
        self.data, self.scale, self.inputs = data, scale, inputs

    def tree_flatten(self) -> tuple[tuple[Any, Any], int]:
        return (self.data, self.scale), self.inputs

    @classmethod
    def tree_unflatten(cls, inputs: int, children: Any) -> Quantized:
        return cls(children[0], children[1], inputs)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, key: Any) -> Any:
        if key is Ellipsis:
            return self
        raise TypeError("a quantized kernel is read whole ([...]) or reshaped")

    def reshape(self, *shape: Any) -> Quantized:
        """The kernel reshaped as its in_out form would be (merging within its input and within its output dims),
        the scale reshaped to the new output dims."""
        dims = list(shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)
        size = math.prod(self.shape)
        if -1 in dims:
            dims[dims.index(-1)] = size // math.prod(d for d in dims if d != -1)
        k = math.prod(self.shape[:self.inputs])
        split = next((j for j in range(1, len(dims) + 1) if math.prod(dims[:j]) == k), None)
        if split is None:
            raise ValueError(f"reshaping a quantized kernel {self.shape} to {tuple(dims)} mixes input and output dims")
        return Quantized(self.data.reshape(*dims), self.scale.reshape(*dims[split:]), split)

    def dequantize(self, dtype: Any = "float32") -> Any:
        """The float kernel (in_out) this stands for: for what reads a plain array (tests, references)."""
        import jax.numpy as jnp

        data = self.data.materialize() if hasattr(self.data, "materialize") else self.data
        if hasattr(data, "inputs") and hasattr(data, "outputs"):  # an OutIn view: back to in_out
            nd = len(data.data.shape)
            perm = (*range(nd - data.inputs, nd), *range(nd - data.inputs))
            data = jnp.transpose(data.data, perm)
        w = jnp.asarray(data).astype(jnp.float32)
        w = w * jnp.asarray(self.scale, jnp.float32).reshape((1,) * self.inputs + tuple(self.scale.shape))
        return w.astype(dtype)


def storage_bytes(specs: Mapping[str, TensorSpec], param_dtype: str) -> int:
    """Bytes of `specs` with each tensor in its own dtype (`TensorSpec.dtype`) or else `param_dtype`: a quantized
    model's weights, scales included."""
    return sum(s.numel * numpy_dtype(s.dtype or param_dtype).itemsize for s in specs.values())


# -- which chips run fp8 ----------------------------------------------------------------------------------------

FP8_GPU_CAPABILITY = (8, 9)
"""The first CUDA compute capability with fp8 (e4m3) tensor-core matmuls: Ada (8.9), Hopper (9.0) and later."""
FP8_TPU_FIRST = 7
"""The first TPU generation with fp8 matmuls in the MXU: v7x (Ironwood)."""


def fp8_support(platform: str, device_kind: str = "", compute_capability: str | None = None) -> str | None:
    """Why fp8 weights cannot run on this chip, or None where they can. `platform`: jax's (cpu / gpu / tpu);
    `device_kind`: jax's `Device.device_kind` ("TPU v5 lite", "NVIDIA H100 80GB HBM3"); `compute_capability`:
    a GPU's ("8.0", "9.0"), where known. CPU runs fp8 (XLA converts each weight inside the dot: the correctness
    reference, not a fast path)."""
    if platform == "cpu":
        return None
    if platform == "tpu":
        gen = _tpu_generation(device_kind)
        if gen is None or gen >= FP8_TPU_FIRST:
            return None
        return (f"model.quantization fp8 needs fp8 matmuls: {device_kind or 'this TPU'} (TPU v{gen}) has none; "
                f"TPU v{FP8_TPU_FIRST}x and later do. Use int8 on this chip")
    if platform in ("gpu", "cuda", "rocm"):
        cc = _capability(compute_capability)
        if cc is None:
            return None if _known_fp8_gpu(device_kind) else (
                f"model.quantization fp8 needs a GPU with fp8 matmuls (compute capability >= "
                f"{FP8_GPU_CAPABILITY[0]}.{FP8_GPU_CAPABILITY[1]}); cannot tell for {device_kind or 'this GPU'}. "
                "Use int8")
        if cc >= FP8_GPU_CAPABILITY:
            return None
        return (f"model.quantization fp8 needs a GPU with fp8 matmuls (compute capability >= "
                f"{FP8_GPU_CAPABILITY[0]}.{FP8_GPU_CAPABILITY[1]}: H100/H200, L4, L40S); {device_kind or 'this GPU'} "
                f"has {cc[0]}.{cc[1]}. Use int8 on this chip")
    return f"model.quantization fp8 is not supported on platform {platform}"


def device_fp8_support(device: Any) -> str | None:
    """`fp8_support` of a jax device."""
    return fp8_support(device.platform, getattr(device, "device_kind", ""),
                       getattr(device, "compute_capability", None))


def _tpu_generation(kind: str) -> int | None:
    import re

    m = re.search(r"v(\d+)", kind.lower())
    return int(m.group(1)) if m else None


def _capability(cc: str | None) -> tuple[int, int] | None:
    if not cc:
        return None
    try:
        major, minor = (str(cc).split(".") + ["0"])[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def _known_fp8_gpu(kind: str) -> bool:
    k = kind.upper()
    return any(name in k for name in ("H100", "H200", "H20", "H800", "B100", "B200", "GB200", "L4", "L40", "RTX 40"))


# -- whole parameter sets (converters, tests) ------------------------------------------------------------------

def kernel_axes(spec: TensorSpec) -> tuple[int, ...]:
    """The input dims of quantized kernel `spec` (in_out; stacked or per layer)."""
    return input_dims(spec.name, len(spec.shape), _lead(spec))


def quantize_params_np(params: Mapping[str, np.ndarray], specs: Mapping[str, TensorSpec], mode: str
                       ) -> dict[str, np.ndarray]:
    """Float params (in_out, named as `specs`, the float model's) -> the quantized model's: each quantized kernel
    as `mode` with its scale after it, the rest unchanged."""
    out: dict[str, np.ndarray] = {}
    for name, w in params.items():
        if check_mode(mode) != "none" and quantized_kernel(name):
            out[name], out[scale_name(name)] = quantize_np(w, mode, kernel_axes(specs[name]))
        else:
            out[name] = w
    return out


def dequantize_params_np(params: Mapping[str, np.ndarray], specs: Mapping[str, TensorSpec]
                         ) -> dict[str, np.ndarray]:
    """The inverse view of `quantize_params_np`: float32 kernels q * scale, scales dropped (`specs`: float)."""
    out: dict[str, np.ndarray] = {}
    for name, w in params.items():
        if is_scale(name):
            continue
        if scale_name(name) in params:
            out[name] = dequantize_np(w, params[scale_name(name)], kernel_axes(specs[name]))
        else:
            out[name] = w
    return out
