"""Reading a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`) into the host arrays
a slot holds, checked against the model's adapted projections (`raydeploy.lora.layout.LoraLayout`).

PEFT stores, per adapted module, `...layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight`
[out, r] (torch's out_in). A slot holds A [L, max_rank, in] and B [L, max_rank, out] for every target of the
layout: the adapter's A as it is and B transposed, zero-padded from its rank r up to `max_rank` (the padded columns and
rows add exact zeros) and zeros for a layer or target the adapter leaves alone. Its scale is lora_alpha / r
(lora_alpha / sqrt(r) with `use_rslora`). The HF projection layouts are ours (head-major q/k/v outputs, the same
rotate_half RoPE), so nothing is permuted. What the engine cannot serve as PEFT computes it is refused with an
`AdapterError` naming the file, the tensor or the setting: DoRA, biases, fan_in_fan_out, per-module rank or
alpha patterns, embedding or LM-head adapters, targets outside the layout (an MoE family's experts), a rank above
`lora.max_rank`, a shape that does not fit the model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from raydeploy.checkpoint.convert_safetensors import iter_safetensors

if TYPE_CHECKING:
    from raydeploy.lora.layout import LoraLayout

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?layers\.(\d+)\."
                  r"(?:self_attn|mlp|block_sparse_moe)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class AdapterError(ValueError):
    """An adapter the engine cannot serve; the message names the file, tensor or setting (HTTP 400)."""


@dataclass(frozen=True)
class HostAdapter:
    """One adapter ready for a slot: A [L, max_rank, in] and B [L, max_rank, out] float32 per layout target."""

    rank: int
    alpha: float
    scale: float
    a: dict[str, np.ndarray]
    b: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (*self.a.values(), *self.b.values()))


def empty_adapter(layout: LoraLayout) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Zero A [L, r, in] and B [L, r, out] for every target of `layout` (what an unloaded slot holds)."""
    return ({t.name: np.zeros((layout.layers, layout.rank, t.inputs), np.float32) for t in layout.targets},
            {t.name: np.zeros((layout.layers, layout.rank, t.outputs), np.float32) for t in layout.targets})


def read_config(path: Path) -> dict[str, Any]:
    """adapter_config.json of the adapter at `path`, checked for what the engine computes."""
    cfg_path = path / CONFIG_FILE
    if not path.is_dir():
        raise AdapterError(f"adapter directory {path} does not exist")
    if not cfg_path.is_file():
        raise AdapterError(f"adapter {path} has no {CONFIG_FILE}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{CONFIG_FILE} of adapter {path.name} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{CONFIG_FILE} of adapter {path.name} is not a JSON object")
    kind = str(cfg.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise AdapterError(f"{CONFIG_FILE} of adapter {path.name}: peft_type {kind} is not LORA")
    for key, bad, what in (("use_dora", True, "DoRA"), ("fan_in_fan_out", True, "fan_in_fan_out weights")):
        if cfg.get(key) == bad:
            raise AdapterError(f"{CONFIG_FILE} of adapter {path.name}: {what} ({key}: true) is not supported")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{CONFIG_FILE} of adapter {path.name}: bias {cfg['bias']!r} is not supported "
                           f"(only 'none')")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise AdapterError(f"{CONFIG_FILE} of adapter {path.name}: {key} is not supported (one rank and "
                               f"alpha for every module)")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{CONFIG_FILE} of adapter {path.name}: modules_to_save {cfg['modules_to_save']} "
                           f"(full copies of modules) is not supported")
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        raise AdapterError(f"{CONFIG_FILE} of adapter {path.name}: r must be a positive integer, got "
                           f"{cfg.get('r')!r}")
    return cfg


def read_adapter(path: str | Path, layout: LoraLayout) -> HostAdapter:
    """The adapter at `path` as a slot of `layout` holds it (see the module docstring); AdapterError otherwise."""
    path = Path(path)
    cfg = read_config(path)
    rank = int(cfg["r"])
    if rank > layout.rank:
        raise AdapterError(f"adapter {path.name} has rank {rank}, above lora.max_rank {layout.rank}")
    alpha = float(cfg.get("lora_alpha", rank))
    scale = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        other = " (only safetensors is read)" if (path / "adapter_model.bin").is_file() else ""
        raise AdapterError(f"adapter {path.name} has no {WEIGHTS_FILE}{other}")
    a, b = empty_adapter(layout)
    seen: dict[tuple[int, str, str], str] = {}
    try:
        tensors = list(iter_safetensors(weights))
    except Exception as e:  # a truncated or malformed file: the reader's own error, named
        raise AdapterError(f"{WEIGHTS_FILE} of adapter {path.name} cannot be read: {e}") from None
    for name, x in tensors:
        m = _KEY.match(name)
        if m is None:
            raise AdapterError(f"adapter {path.name}: tensor {name} is not a LoRA A/B weight of a decoder layer's "
                               f"projection (adapted: {', '.join(layout.names)})")
        layer, target, which = int(m.group(1)), m.group(2), m.group(3)
        t = layout.target(target)
        if t is None:
            raise AdapterError(f"adapter {path.name}: tensor {name} adapts {target}, which this model's adapters "
                               f"cannot target (adapted: {', '.join(layout.names)})")
        if layer >= layout.layers:
            raise AdapterError(f"adapter {path.name}: tensor {name} is for layer {layer}, the model has "
                               f"{layout.layers} layers")
        want = (rank, t.inputs) if which == "A" else (t.outputs, rank)
        if tuple(x.shape) != want:
            raise AdapterError(f"adapter {path.name}: tensor {name} has shape {list(x.shape)}, expected {list(want)} "
                               f"(rank {rank}, {target} of {t.inputs} -> {t.outputs})")
        x = np.asarray(x, np.float32)
        if not np.isfinite(x).all():
            raise AdapterError(f"adapter {path.name}: tensor {name} holds non-finite values")
        if which == "A":
            a[target][layer, :rank, :] = x
        else:
            b[target][layer, :rank, :] = x.T
        seen[(layer, target, which)] = name
    if not seen:
        raise AdapterError(f"adapter {path.name}: {WEIGHTS_FILE} holds no LoRA weights")
    for (layer, target, which), name in seen.items():
        other = "B" if which == "A" else "A"
        if (layer, target, other) not in seen:
            raise AdapterError(f"adapter {path.name}: tensor {name} has no lora_{other} partner")
    return HostAdapter(rank, alpha, scale, a, b)

