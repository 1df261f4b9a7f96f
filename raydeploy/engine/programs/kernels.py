"""Which matmul kernels and weight layout the step programs use, chosen once per engine from the config, the
model and the mesh: each choice is None when the kernel runs, else why it does not (`KernelChoice`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax

from raydeploy.config import EngineConfig, ModelConfig
from raydeploy.engine.matmul import pallas_gpu as stacked_matmul
from raydeploy.model import native, quant
from raydeploy.model.llama import EMBEDDING
from raydeploy.model.projection import QUANT_SCALE
from raydeploy.model.registry import Family
from raydeploy.model.scan import in_out_kernels


def resolve_kernel_layout(kernel_layout: str, param_dtype: str, platform: str, native_weights: tuple[str, ...] = ()
                          ) -> str:
    """`EngineConfig.kernel_layout` with auto resolved: out_in for bfloat16 weights on CPU when XLA multiplies them
    (measured on the demo model, 8 decode rows: XLA's bfloat16 projections take ~10 GB/s in_out, the [V, D]-shaped
    tied LM head ~16 GB/s), in_out elsewhere: float32 on CPU is faster in_out, the native CPU kernel reads in_out
    weights (`native_weights`: the dtypes it multiplies, empty where it does not run), TPU/GPU compilers choose
    their own layouts."""
    if kernel_layout != "auto":
        return kernel_layout
    xla_bf16 = param_dtype == "bfloat16" and platform == "cpu" and param_dtype not in native_weights
    return "out_in" if xla_bf16 else "in_out"


PALLAS_QUANTIZED: frozenset[str] = frozenset({"int8", "fp8"})
"""The weight quantizations (`model.quantization`) the GPU Pallas few-rows kernel reads (`stacked_matmul`): it takes
the `raydeploy.model.quant.Quantized` pair, int8 / float8_e4m3fn [K, N] read in place and float32 [N] per layer,
converting the weight to bfloat16 inside the kernel (bfloat16 rows: a float32 model's quantized projections keep
XLA's dot, which multiplies them in float32)."""
NATIVE_QUANTIZED: frozenset[str] = frozenset()
"""The same for the native CPU kernels (`raydeploy.model.native`): none (they read float weights)."""


def quantization_problem(family: Family, kernels: frozenset[str], what: str) -> str | None:
    """Why a kernel that reads only the quantizations in `kernels` does not run for `family`'s weights, or None."""
    q = family.quantization
    if q == "none" or q in kernels:
        return None
    return f"weights quantized {q} ({what} reads {', '.join(sorted(kernels)) or 'float'} weights)"


def check_fp8(family: Family, mesh: jax.sharding.Mesh) -> None:
    """fp8 weights on a chip without fp8 matmuls (a TPU before v7x, a GPU below compute capability 8.9) are
    refused, naming the chip (`raydeploy.model.quant.fp8_support`, which `raydeploy plan` asks too). CPU runs
    them (XLA converts; the correctness reference)."""
    if family.quantization == "fp8":
        why = quant.device_fp8_support(mesh.devices.flat[0])
        if why:
            raise ValueError(why)


UNROLL_PLATFORMS = ("cpu",)
"""Platforms whose one-token step programs run the layers unrolled over per-layer weight arrays: XLA CPU copies
a stacked weight's layer slice before every matmul (`raydeploy.model.llama.unroll_layers`). TPU and GPU
compilers read the slice in place, and a scanned program compiles in a fraction of the time."""
UNROLL_MAX_TOKENS = 1
"""Token places per group of the unrolled programs (measured on the demo model, 30 layers: 1 row 23 -> 17 ms,
2 rows 24 -> 21 ms, 4 rows 28 -> 31 ms, 8 rows the same): the one-row decode bucket."""



@dataclass(frozen=True)
class KernelChoice:
    """The kernels of one engine's step programs, each None when in use, else why not."""

    kernel_layout: str
    """The layers' weight layout (`resolve_kernel_layout`)."""
    native_matmul: str | None
    """Why the step programs keep XLA's dot for the projections, or None when they use the native CPU kernel."""
    pack_weights: str | None
    """Why no layer kernel is held packed, or None when those in `packable` may be (`Engine` packs each whose
    weights are exactly 4-bit blocks and calls `use_packed`)."""
    packable: Mapping[str, int]
    """The weights the native kernel may read packed (`raydeploy.model.native.packing`): stacked layer kernels by
    path in the layer module, with how many of their dims make K (`in_out_kernels`; 4-bit tiles), and a tied
    embedding table (`EMBEDDING`, 0; 8-bit rows); empty where it may not."""
    stacked_matmul: str | None
    """Why the step programs keep XLA's gemm for few rows by stacked weights, or None when they use the Pallas
    kernel that reads a layer's weight inside the stack (`raydeploy.model.stacked_matmul`)."""
    unrolled_tokens: frozenset[int]
    """Token buckets whose step programs run the layers unrolled (`UNROLL_PLATFORMS`)."""


def choose_layout(family: Family, mesh: jax.sharding.Mesh, dp_axes: tuple[str, ...], model_cfg: ModelConfig,
                  engine_cfg: EngineConfig) -> tuple[str | None, str]:
    """(why the native CPU kernel does not run or None, the weight layout): what the model is built with."""
    platform = mesh.devices.flat[0].platform
    check_fp8(family, mesh)
    native_matmul = _native_matmul(engine_cfg.cpu_matmul, model_cfg, mesh, dp_axes, platform)
    if native_matmul is None:
        native_matmul = quantization_problem(family, NATIVE_QUANTIZED, "the native kernel")
    layout = resolve_kernel_layout(engine_cfg.kernel_layout, model_cfg.param_dtype, platform,
                                   native.weight_dtypes() if native_matmul is None else ())
    # auto picks what the family's module can hold (an explicit choice it cannot is the module's error)
    kernel_layout = family.resolve_kernel_layout(layout) if engine_cfg.kernel_layout == "auto" else layout
    if native_matmul is None and kernel_layout != "in_out":
        native_matmul = f"kernel layout {kernel_layout} (the kernel reads in_out weights)"
    return native_matmul, kernel_layout


def choose_kernels(native_matmul: str | None, kernel_layout: str, abstract_model: Any, mesh: jax.sharding.Mesh,
                   model_cfg: ModelConfig, engine_cfg: EngineConfig) -> KernelChoice:
    """The rest of the choice, from the model built with `choose_layout`'s layout (its layers' module)."""
    platform = mesh.devices.flat[0].platform
    layers = type(abstract_model.layers)
    pack = _pack_weights(engine_cfg.pack_weights, model_cfg, layers, native_matmul)
    packable: dict[str, int] = {}
    if pack is None:
        packable = in_out_kernels(abstract_model.layers)
        if abstract_model.lm_head is None:  # the tied embedding table is the LM head: 8-bit rows
            packable[EMBEDDING] = 0
    unrolled: frozenset[int] = frozenset()
    if engine_cfg.unroll_layers == "auto" and platform in UNROLL_PLATFORMS and getattr(layers, "unrollable", False):
        unrolled = frozenset({UNROLL_MAX_TOKENS})
    stacked = _stacked_matmul(engine_cfg.gpu_matmul, model_cfg, layers, kernel_layout, mesh)
    if stacked is None:
        stacked = _stacked_quantized(abstract_model, model_cfg.dtype)
    return KernelChoice(kernel_layout=kernel_layout, native_matmul=native_matmul, pack_weights=pack,
                        packable=packable, stacked_matmul=stacked, unrolled_tokens=unrolled)


def _stacked_quantized(abstract_model: Any, dtype: str) -> str | None:
    """Why the Pallas kernel does not read the model's weights for their quantization (`PALLAS_QUANTIZED`) or
    multiply them by activations of `dtype` (bfloat16 only), or None."""
    scale = next((n for n in in_out_kernels(abstract_model.layers) if _has_scale(abstract_model.layers, n)), None)
    if scale is None:
        return None
    stored = str(_kernel(abstract_model.layers, scale).dtype)
    q = quant.mode_of_dtype(stored) or stored
    if q not in PALLAS_QUANTIZED:
        return f"weights quantized {q} (the Pallas kernel reads {', '.join(sorted(PALLAS_QUANTIZED)) or 'float'} weights)"
    if dtype != "bfloat16":
        return f"dtype {dtype} with weights quantized {q} (the kernel multiplies them by bfloat16 activations)"
    return None


def _owner(layers: Any, path: str) -> Any:
    owner = layers
    for name in path.split(".")[:-1]:
        owner = getattr(owner, name)
    return owner


def _has_scale(layers: Any, path: str) -> bool:
    return getattr(_owner(layers, path), QUANT_SCALE, None) is not None


def _kernel(layers: Any, path: str) -> Any:
    return _owner(layers, path).kernel


def _native_matmul(choice: str, model_cfg: ModelConfig, mesh: jax.sharding.Mesh, dp_axes: tuple[str, ...],
                   platform: str) -> str | None:
    """Why the step programs keep XLA's dot for the projections, or None when they use the native CPU kernel
    (`raydeploy.model.native`): auto, on CPU, float32 activations, float32 weights (or bfloat16 where the kernel
    is built for AVX-512) replicated over a dp-only mesh; the caller then also needs the in_out layout."""
    others = {a: n for a, n in dict(mesh.shape).items() if a not in dp_axes and n > 1}
    if choice != "auto":
        return f"engine.cpu_matmul is {choice}"
    if platform != "cpu":
        return f"the platform is {platform}"
    weights = native.weight_dtypes()
    if model_cfg.dtype != "float32" or model_cfg.param_dtype not in weights:
        return (f"dtype {model_cfg.dtype}, param_dtype {model_cfg.param_dtype} (the kernel multiplies float32 "
                f"activations by {' or '.join(weights)} weights on this CPU)")
    if others:
        return f"the mesh splits weights over {others} (the kernel needs them replicated)"
    return native.unavailable()


def _pack_weights(choice: str, model_cfg: ModelConfig, layers: type, native_matmul: str | None) -> str | None:
    if choice != "auto":
        return f"engine.pack_weights is {choice}"
    if native_matmul is not None:
        return f"the native kernel does not run ({native_matmul})"
    if model_cfg.param_dtype != "float32":
        return f"param_dtype {model_cfg.param_dtype} (packing takes float32 weights)"
    if not getattr(layers, "unrollable", False):
        return f"{layers.__name__} layers pass no layer slices (`scan_layers`)"
    return native.packs_weights()


def _stacked_matmul(choice: str, model_cfg: ModelConfig, layers: type, kernel_layout: str,
                    mesh: jax.sharding.Mesh) -> str | None:
    """Why the step programs keep XLA's gemm for few rows by a layer's weights, or None when they call
    `stacked_matmul` (`engine.gpu_matmul`: auto on a GPU, pallas anywhere; bfloat16 weights, in_out, layers
    scanned by `scan_layers`)."""
    platform = mesh.devices.flat[0].platform
    if choice == "xla" or (choice == "auto" and platform != "gpu"):
        return f"engine.gpu_matmul is {choice} on {platform}"
    if model_cfg.param_dtype != "bfloat16":
        return f"param_dtype {model_cfg.param_dtype} (the kernel multiplies bfloat16 weights)"
    if kernel_layout != "in_out":
        return f"kernel layout {kernel_layout} (the kernel reads in_out weights)"
    if not getattr(layers, "unrollable", False):
        return f"{layers.__name__} layers pass no layer slices (`scan_layers`)"
    return stacked_matmul.device_problem(mesh.devices.flat[0]) if platform == "gpu" else None
