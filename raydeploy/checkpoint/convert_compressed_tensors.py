"""Pre-quantized Hugging Face checkpoints in the compressed-tensors format (llm-compressor's output): int8
weight-only (W8A16), symmetric per output channel, read without dequantizing to float on the way.

Why this format: it is what llm-compressor writes and vLLM serves, and the Hub holds int8 models in it for the
families we serve (RedHatAI's, formerly neuralmagic's, `*-quantized.w8a16` and `*-quantized.w8a8` Llama 3 / 3.1 /
3.3, Qwen2.5/Qwen3, Mistral models). Its channel-wise int8 is exactly our int8 layout (`raydeploy.model.quant`):
q = round(w / s), s per output row of the [out, in] weight. So the converter moves bytes: the int8 weight is
transposed to our in_out layout like any weight, the scale [out, 1] is reshaped to the kernel's output dims, and
the checkpoint is written quantized int8 (format version 5).

`config.json`'s `quantization_config` must say quant_method "compressed-tensors", format "int-quantized" (int8
`weight`) or "pack-quantized" (`weight_packed` int32, four 8-bit values per int32, offset by 128, first value in
the low byte), and every config group's weights: 8 bits, int, symmetric, strategy channel. A group that also
quantizes activations (W8A8) is read for its weights; the engine multiplies float activations (W8A16). Anything
else (4-bit, group or block strategies, asymmetric zero points, an LM head quantized) is refused naming the key.
Block-scaled FP8 (Qwen3-FP8, DeepSeek) is not read here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from raydeploy.checkpoint.format import CheckpointError
from raydeploy.model.names import KV_OI, LINEAR_OI, O_OI, Q_OI

QUANT_METHOD = "compressed-tensors"
FORMATS = ("int-quantized", "pack-quantized")
SCALE_SUFFIX = "_scale"  # "x.weight_scale": the scale of "x.weight"


@dataclass(frozen=True)
class CompressedInt8:
    """A checkpoint's compressed-tensors int8 channel-wise scheme (module docstring)."""

    format: str
    ignore: tuple[str, ...]
    w8a8: bool

    def decode(self, name: str, arr: np.ndarray) -> tuple[str, np.ndarray, bool] | None:
        """A source tensor as (weight name, array, is it a scale): `x.weight` int8 [out, in] (unpacked from
        `x.weight_packed`), `x.weight_scale` float32 [out]; other tensors unchanged (False); None for what the
        converter skips (`weight_shape`, activation scales of W8A8)."""
        if name.endswith(".weight_shape") or name.endswith(".input_scale") or name.endswith(".input_zero_point"):
            return None
        if name.endswith(".weight_zero_point"):
            if np.any(np.asarray(arr) != 0):
                raise CheckpointError("asymmetric int8 (a non-zero weight_zero_point) is not supported", tensor=name)
            return None
        if name.endswith(".weight_packed"):
            return name[: -len("_packed")], unpack_int8(arr, name), False
        if name.endswith(".weight" + SCALE_SUFFIX):
            s = np.asarray(arr, np.float32)
            if s.ndim == 2 and s.shape[1] == 1:
                s = s[:, 0]
            if s.ndim != 1:
                raise CheckpointError(f"weight_scale of shape {list(arr.shape)}: channel-wise int8 has one scale "
                                      "per output row, [out, 1]", tensor=name)
            return name[: -len(SCALE_SUFFIX)], s, True
        return name, arr, False


def compressed_config(hf_cfg: dict[str, Any], source: str) -> CompressedInt8 | None:
    """The int8 scheme of a compressed-tensors checkpoint's config.json, None for an unquantized one; an
    unsupported scheme is a CheckpointError naming the key."""
    q = hf_cfg.get("quantization_config") or hf_cfg.get("compression_config")
    if not q:
        return None

    def fail(key: str, why: str) -> CheckpointError:
        return CheckpointError(f"quantization_config.{key}: {why} (raydeploy reads compressed-tensors int8 "
                               "channel-wise weights: W8A16, or W8A8's weights)", source)

    if q.get("quant_method") != QUANT_METHOD:
        raise fail("quant_method", f"{q.get('quant_method')!r} is not supported")
    fmt = q.get("format")
    if fmt not in FORMATS:
        raise fail("format", f"{fmt!r} is not one of {', '.join(FORMATS)}")
    groups = q.get("config_groups") or {}
    if not groups:
        raise fail("config_groups", "no quantization group")
    w8a8 = False
    for gname, g in groups.items():
        w = g.get("weights") or {}
        want = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
        for key, value in want.items():
            if w.get(key) != value:
                raise fail(f"config_groups.{gname}.weights.{key}", f"{w.get(key)!r}, expected {value!r}")
        w8a8 = w8a8 or bool(g.get("input_activations"))
    ignore = tuple(str(x) for x in q.get("ignore") or ())
    if "lm_head" not in ignore and not hf_cfg.get("tie_word_embeddings", False):
        raise fail("ignore", "the LM head is quantized; raydeploy holds it in model.param_dtype")
    return CompressedInt8(fmt, ignore, w8a8)


def unpack_int8(packed: np.ndarray, name: str = "") -> np.ndarray:
    """`weight_packed` int32 [out, in / 4] -> int8 [out, in]: value 4k + i sits in bits 8i..8i+7 of int32 k of its
    row, offset by 128 (compressed-tensors' pack_to_int32 with num_bits 8)."""
    p = np.ascontiguousarray(packed)
    if p.dtype != np.int32 or p.ndim != 2:
        raise CheckpointError(f"weight_packed must be int32 [out, in/4], found {p.dtype} {list(p.shape)}", tensor=name)
    u = p.view(np.uint32)
    out = np.empty((p.shape[0], p.shape[1] * 4), np.uint8)
    for i in range(4):
        out[:, i::4] = (u >> (8 * i)) & 0xFF
    return (out.astype(np.int16) - 128).astype(np.int8)


def pack_int8(q: np.ndarray) -> np.ndarray:
    """The inverse of `unpack_int8` (for tests that write such a checkpoint)."""
    u = (np.asarray(q, np.int16) + 128).astype(np.uint32)
    if u.shape[1] % 4:
        u = np.pad(u, ((0, 0), (0, 4 - u.shape[1] % 4)))
    packed = np.zeros((u.shape[0], u.shape[1] // 4), np.uint32)
    for i in range(4):
        packed |= u[:, i::4] << (8 * i)
    return packed.view(np.int32)


def scale_to_ours(kind: str, s: np.ndarray, cfg: Any, name: str = "") -> np.ndarray:
    """A channel scale [out] (the rows of the source's [out, in] weight) -> the scale of our in_out kernel: its output
    dims ([heads, head_dim] for q/k/v, [embed] for o, [out] for a plain linear)."""
    shapes = {Q_OI: (cfg.num_heads, cfg.head_dim), KV_OI: (cfg.num_kv_heads, cfg.head_dim),
              O_OI: (cfg.hidden_size,), LINEAR_OI: (s.shape[0],)}
    if kind not in shapes:
        raise CheckpointError(f"a quantized weight of layout {kind} is not supported", tensor=name)
    shape = shapes[kind]
    if int(np.prod(shape)) != s.shape[0]:
        raise CheckpointError(f"weight_scale has {s.shape[0]} channels, the config expects {int(np.prod(shape))}",
                              tensor=name)
    return s.reshape(shape)
