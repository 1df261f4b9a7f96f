"""What a config implies, computed without any hardware: `raydeploy plan CONFIG`.

From the config and the model's `config.json` alone this works out the hosts and devices, the resolved
mesh (and which axes cross hosts), the Ray placement bundles, the bytes of parameters and KV cache each
device and each host holds (shard shapes from :mod:`raydeploy.model.sharding`), and compares them with the
device's memory. It checks that every sharded dimension divides (attention heads vs tp, every parameter,
the KV cache, slots vs dp). Problems are collected, not raised one at a time, so one run names them all;
:meth:`Plan.raise_if_impossible` turns them into a :class:`ConfigError` before anything is placed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raydeploy.checkpoint.demo import resolve_checkpoint
from raydeploy.compile import CHIPS, Chip, roofline_s
from raydeploy.config import Config, ConfigError
from raydeploy.engine.geometry import EngineGeometry
from raydeploy.gang.placement import head_bundle, host_bundles, placement_strategy
from raydeploy.gang.preflight import cache_dir_problem
from raydeploy.model.quant import fp8_support, is_scale
from raydeploy.model.registry import Family, family_for, from_hf_config
from raydeploy.model.sharding import check_divisible, logical_to_mesh_axes, merge_rules
from raydeploy.model.spec import (
    POOL_RULES,
    TensorSpec,
    is_kernel,
    kernel_input_dims,
    page_table_spec,
    split_layer_name,
)

GIB = 1024**3

# Memory of one device (GiB) per accelerator type; keys are matched case-insensitively.
DEVICE_MEMORY_GIB: dict[str, float] = {
    "v2": 8, "v3": 16, "v4": 32, "v5e": 16, "v5litepod": 16, "v5p": 95, "v6e": 32, "v7x": 192,
    "a100-40g": 40, "a100-80g": 80, "h100": 80, "h200": 141, "b200": 180, "l4": 24, "a10g": 24,
}
# Fraction of device memory the plan lets parameters + KV cache use; the rest is for activations,
# compiled programs and the runtime (on GPU set XLA_PYTHON_CLIENT_MEM_FRACTION accordingly).
USABLE_FRACTION: dict[str, float] = {"tpu": 0.9, "gpu": 0.85, "cpu": 0.8}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8_e4m3fn": 1}
SCALE_ITEMSIZE = 4
"""Bytes of one float32 scale: a quantized kernel's per output channel, a quantized KV cache's per token and head."""
GPU_COMPUTE_CAPABILITY = {"a100-40g": "8.0", "a100-80g": "8.0", "a10g": "8.6", "l4": "8.9", "h100": "9.0",
                          "h200": "9.0", "b200": "10.0"}
"""CUDA compute capability per GPU accelerator type: which of them have fp8 matmuls (`raydeploy.model.quant`)."""
QUANTIZED_KV_DTYPES = ("int8", "float8_e4m3fn")
"""`engine.kv_dtype`s stored with a float32 scale per token and combined kv head (`raydeploy.engine.attention.kv_quant`)."""
MODEL_CONTEXT = 1024
"""Attended tokens per row (prompt + generated) of the modelled decode figures."""


@dataclass(frozen=True)
class DecodeModel:
    """A modelled decode step (`decode_model`): the roofline of one chip's reads and flops, not a measurement."""

    streams: int
    """Rows decoding at once over the whole gang (one token each per step)."""
    step_ms: float
    tok_s: float
    per_stream_tok_s: float
    bound: str
    """Which roof sets the step: `HBM` (bytes / bandwidth) or `compute` (flops / bf16 peak)."""


@dataclass(frozen=True)
class SlotSuggestion:
    """The largest `engine.max_slots` whose parameters and KV cache fit one device within a margin, and the
    modelled decode throughput there (`suggest_slots`)."""

    max_slots: int
    """0: none (`note` says why)."""
    margin: str
    """What is left free on each device for temporaries, code and the runtime, and where that figure comes from."""
    kv_bytes_per_device: int = 0
    free_bytes_per_device: int = 0
    """Bytes of the budget left after parameters + KV cache at `max_slots`."""
    chip: str | None = None
    context: int = MODEL_CONTEXT
    modelled: tuple[DecodeModel, ...] = ()
    """At batch 1 and at `max_slots` (every slot decoding, `context` tokens each); empty for a chip without
    published figures (`raydeploy.compile.CHIPS`)."""
    modelled_config: tuple[DecodeModel, ...] = ()
    """The same at the config's own `engine.max_slots`, for comparison."""
    note: str = ""


@dataclass(frozen=True)
class Plan:
    """Everything `raydeploy plan` reports; bytes are per device unless the name says otherwise."""

    source: str
    model_config_json: str
    model: dict[str, Any]
    platform: str
    accelerator_type: str | None
    num_hosts: int
    devices_per_host: int
    total_devices: int
    mesh: dict[str, int]
    mesh_axis_span: dict[str, str]
    placement_strategy: str
    bundles: list[dict[str, float]]
    param_dtype: str
    kv_dtype: str
    param_count: int
    param_bytes_total: int
    param_bytes_per_device: int
    param_bytes_per_host: int
    kv_bytes_total: int
    kv_bytes_per_device: int
    kv_bytes_per_host: int
    slots_per_dp_group: int
    page_size: int
    pages_per_dp_group: int
    """Pages of the paged KV pool each dp group owns (`engine.num_pages`, auto resolved)."""
    device_memory_bytes: int
    device_memory_from: str
    usable_bytes_per_device: int
    free_bytes_per_device: int
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    slice_head_bundle: dict[str, float] | None = None
    """TPU: reserved first to claim one whole slice; then every host bundle also asks for that slice's name."""
    active_param_count: int = 0
    """Parameters one token's forward reads (a mixture-of-experts token uses k of its experts)."""
    kv_bytes_per_token: int = 0
    """KV cache bytes of one token (K and V, every layer, whole model)."""
    window_ring_pages: int = 0
    """Pages of each slot's ring for the sliding-window layers (`engine.window_pages: ring`); 0 = none."""
    window_layers: int = 0
    """Layers whose pages are rings (they are not in the main pool)."""
    packed_bytes_per_device: int = 0
    """CPU: the most the packed copies of weights that are exactly 4- or 8-bit blocks add (`packed_bytes_max`)."""
    quantization: str = "none"
    """`model.quantization`: projection kernels held as int8 / float8_e4m3fn with float32 scales."""
    weight_scale_bytes_per_device: int = 0
    """Of `param_bytes_per_device`: the quantized kernels' float32 scales (one per output channel)."""
    kv_scale_bytes_per_device: int = 0
    """Of `kv_bytes_per_device`: a quantized KV cache's float32 scales (one per token, kv head, K and V)."""
    dp_groups: int = 1
    """Groups the slots divide over (each with its own pages and rows)."""
    kv_bytes_per_token_per_device: float = 0.0
    """KV bytes one cached token of a sequence puts on each device of its group, every layer (scales included)."""
    lora_bytes_per_device: int = 0
    """The LoRA adapter slots' A/B stacks and scales on each device (`lora.max_adapters` x `lora.max_rank`;
    docs/lora.md); every step reads them whole and multiplies each row by every slot (2 flops per element)."""
    slots: SlotSuggestion | None = None
    """The largest max_slots that fits, and the modelled decode figures (`suggest_slots`)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        return d

    def raise_if_impossible(self) -> None:
        if self.problems:
            raise ConfigError("impossible plan: " + "; ".join(self.problems), file=self.source)


# -- the model's shape -------------------------------------------------------------------------------


def model_config_path(cfg: Config) -> Path:
    """The config.json that describes the model: `model.hf_config`, else the checkpoint's own."""
    m = cfg.model
    base = Path(cfg.source).parent if cfg.source and not cfg.source.startswith("<") else Path.cwd()
    if m.hf_config:
        p = Path(os.path.expanduser(m.hf_config))
        p = p if p.is_absolute() else base / p
        if not p.is_file():
            raise ConfigError(f"model config.json {p} does not exist", file=cfg.source, key="model.hf_config")
        return p
    if m.checkpoint.startswith("demo:"):
        return Path(resolve_checkpoint(m.checkpoint)) / "config.json"
    if "://" in m.checkpoint:
        raise ConfigError(f"checkpoint {m.checkpoint} is not on this machine; set model.hf_config to its "
                          f"config.json so the plan knows the model's shape", file=cfg.source, key="model.hf_config")
    p = Path(os.path.expanduser(m.checkpoint))
    p = (p if p.is_absolute() else base / p) / "config.json"
    if not p.is_file():
        raise ConfigError(f"no config.json at {p} (checkpoint {m.checkpoint!r} not on this machine?); set "
                          f"model.hf_config to the model's config.json", file=cfg.source, key="model.hf_config")
    return p


# -- memory of one device ----------------------------------------------------------------------------


def host_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_memory(cfg: Config) -> tuple[int, str]:
    """Bytes of one device and where the figure came from."""
    c = cfg.cluster
    if c.device_memory_gib is not None:
        return int(c.device_memory_gib * GIB), "cluster.device_memory_gib"
    if c.platform == "cpu":
        ram = host_ram_bytes()
        # Simulated hosts all live on this machine; real CPU hosts are assumed to be like this one.
        share = cfg.total_devices if c.simulated else c.devices_per_host
        return ram // share, f"host RAM {ram / GIB:.1f} GiB / {share} devices"
    acc = (c.accelerator_type or "").lower()
    if acc in DEVICE_MEMORY_GIB:
        return int(DEVICE_MEMORY_GIB[acc] * GIB), f"{c.accelerator_type} ({DEVICE_MEMORY_GIB[acc]:g} GiB)"
    known = ", ".join(DEVICE_MEMORY_GIB)
    raise ConfigError(f"device memory unknown for platform {c.platform!r} with accelerator_type "
                      f"{c.accelerator_type!r}; set cluster.accelerator_type to one of {known} or set "
                      f"cluster.device_memory_gib", file=cfg.source, key="cluster.accelerator_type")


# -- sharding arithmetic -----------------------------------------------------------------------------


def axis_span(mesh: dict[str, int], devices_per_host: int) -> dict[str, str]:
    """Per mesh axis: `in-host`, `across hosts`, `both` or `size 1`. Devices are ordered by (host, local id), so
    the outermost axes cross hosts (see raydeploy.model.sharding.build_mesh)."""
    out: dict[str, str] = {}
    names = list(mesh)
    for i, a in enumerate(names):
        stride = math.prod(mesh[b] for b in names[i + 1:])
        if mesh[a] == 1:
            out[a] = "size 1"
        elif (stride * mesh[a] <= devices_per_host and devices_per_host % (stride * mesh[a]) == 0):
            out[a] = "in-host"
        elif stride % devices_per_host == 0:
            out[a] = "across hosts"
        else:
            out[a] = "both"
    return out


def _shard_numel(spec: TensorSpec, rules: dict, mesh: dict[str, int]) -> int:
    """Elements in one device's shard (rounded up where a dimension does not divide)."""
    dims = logical_to_mesh_axes(spec.logical_axes, rules, mesh, spec.name)
    return math.prod(-(-s // (math.prod(mesh[a] for a in d) if d else 1)) for s, d in zip(spec.shape, dims, strict=True))


def is_quantized(kv_dtype: str) -> bool:
    return kv_dtype in QUANTIZED_KV_DTYPES


def _kv_scale_spec(pool: TensorSpec) -> TensorSpec:
    """The scales of a quantized KV pool: one per token and combined head (the pool without its head_dim; the
    engine holds them as [..., 2 * kv_heads, 1], sharded like the pool)."""
    return TensorSpec(pool.name + "_scale", pool.shape[:-1], pool.logical_axes[:-1])


def _kv_bytes_per_token_per_device(pools: Any, scales: list[TensorSpec], layout: Any, rules: dict,
                                   mesh: dict[str, int], itemsize: int, tokens_per_group: int, layers: int) -> float:
    """KV bytes (every layer, scales included) that one cached token of a sequence puts on each device of its
    group: the main pool's bytes per device over its tokens per group, per main layer, times the layers. 0 when
    every layer keeps a ring (the main pool is empty)."""
    main = pools[0]
    if not layout.main_layers or not tokens_per_group:
        return 0.0
    per_dev = _shard_numel(main, rules, mesh) * itemsize
    if scales:
        per_dev += _shard_numel(scales[0], rules, mesh) * SCALE_ITEMSIZE
    return per_dev / tokens_per_group / len(layout.main_layers) * layers


def _generic(name: str) -> str:
    return re.sub(r"layers\.\d+\.", "layers.*.", name)


def model_family(cfg: Config) -> tuple[Family, Any, str]:
    """(family, parsed model config, config.json path) of the config's model, through the registry."""
    path = model_config_path(cfg)
    try:
        raw = json.loads(path.read_text())
        return (*from_hf_config(raw, source=str(path)), str(path))
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot read model config {path}: {e}", file=cfg.source, key="model.hf_config") from None


def _heads_problems(model: Any, rules: dict, mesh: dict[str, int]) -> list[str]:
    out = []
    for logical, count, what in (("q_heads", model.num_heads, "attention heads"),
                                 ("kv_heads", model.num_kv_heads, "KV heads"),
                                 ("cache_kv_heads", model.num_kv_heads, "KV heads in the KV cache")):
        axes = logical_to_mesh_axes((logical,), rules, mesh, logical)[0]
        if axes is None:
            continue
        n = math.prod(mesh[a] for a in axes)
        if count % n:
            sizes = " x ".join(f"{a}={mesh[a]}" for a in axes)
            out.append(f"the model has {count} {what}, not divisible by {sizes} (mesh.rules.{logical}); "
                       f"use a size dividing {count} or set mesh.rules.{logical}: null to replicate")
    return out


# -- the plan ------------------------------------------------------------------------------------------


def packed_bytes_max(cfg: Config, specs: dict[str, TensorSpec]) -> int:
    """The most bytes per device that the packed copies of a CPU engine add beside its float32 weights
    (`engine.pack_weights: auto`, the native kernel on, float32 weights replicated over a dp-only mesh): 0.75
    bytes a weight for each layer projection whose K and N are multiples of 32, 1.125 for a tied embedding table
    (`raydeploy.model.native.packing`). Which of them pack is known only at load, from their values (exactly 4-
    or 8-bit blocks, as a dequantized GGUF's are); a checkpoint from safetensors packs none. 0 where nothing may
    pack."""
    e, m, mesh = cfg.engine, cfg.model, cfg.mesh_shape
    if (cfg.cluster.platform != "cpu" or e.pack_weights != "auto" or e.cpu_matmul != "auto"
            or m.param_dtype != "float32" or m.dtype != "float32" or any(n > 1 for a, n in mesh.items() if a != "dp")):
        return 0
    from raydeploy.model.native.packing import BLOCK, Q8_TILE, TILE  # numpy only

    def tiles(k: int, n: int, tile_bytes: int) -> int:  # a weight packs only in whole tiles of BLOCK x BLOCK
        return k // BLOCK * (n // BLOCK) * tile_bytes if k % BLOCK == 0 and n % BLOCK == 0 else 0

    total = 0
    for name, spec in specs.items():
        if split_layer_name(name) is not None and is_kernel(name) and "expert" not in spec.logical_axes:
            n_in = kernel_input_dims(name)
            total += tiles(math.prod(spec.shape[:n_in]), math.prod(spec.shape[n_in:]), TILE)
        elif name == "embed.embedding" and "lm_head.kernel" not in specs:
            vocab, embed = spec.shape
            total += tiles(vocab, embed, Q8_TILE)
    return total


def make_plan(cfg: Config, model: Any = None, family: Family | None = None) -> Plan:
    """Work out what `cfg` needs. Raises ConfigError only when the model's shape or memory is unknown;
    every other impossibility is listed in `Plan.problems`. `model` (a family's parsed config; its family from
    `model.model_type` unless given) replaces the config's config.json. `Plan.slots` suggests the largest
    `engine.max_slots` that fits (`suggest_slots`)."""
    json_path = "<given>"
    if model is None:
        family, model, json_path = model_family(cfg)
    elif family is None:
        family = family_for(model.model_type)
    plan = dataclasses.replace(_plan(cfg, model, family), model_config_json=json_path)
    return dataclasses.replace(plan, slots=suggest_slots(cfg, model, family, plan))


def chip_figures(cfg: Config) -> Chip | None:
    """Published figures of the config's chip (`raydeploy.compile.CHIPS`), None when there are none."""
    return CHIPS.get((cfg.cluster.accelerator_type or "").lower())


def fp8_problem(cfg: Config) -> str | None:
    """Why the config's chip cannot run fp8 (`raydeploy.model.quant.fp8_support`), naming it; None where it can.
    The plan knows the chip from `cluster.accelerator_type` (a GPU's compute capability from its type)."""
    c = cfg.cluster
    acc = c.accelerator_type or ""
    kind = f"TPU {acc}" if c.platform == "tpu" and acc else acc
    why = fp8_support(c.platform, kind, GPU_COMPUTE_CAPABILITY.get(acc.lower()))
    return None if why is None else f"{why} (cluster.accelerator_type {acc or 'unset'})"


def _plan(cfg: Config, model: Any, family: Family) -> Plan:
    """`make_plan` without the slot suggestion (which plans the config again at other slot counts)."""
    c, eng = cfg.cluster, cfg.engine
    mesh = cfg.mesh_shape
    problems: list[str] = []
    warnings: list[str] = []
    try:
        rules = {**family.rules, **merge_rules(cfg.mesh.rules)}
    except ConfigError as err:
        raise ConfigError(str(err), file=cfg.source, key=err.key) from None

    problems += _heads_problems(model, rules, mesh)
    try:
        family.check_mesh(model, mesh)
    except ValueError as err:
        problems.append(str(err))
    quant = cfg.model.quantization
    if quant == "fp8" and (why := fp8_problem(cfg)) is not None:
        problems.append(why)
    held = family.with_quantization(quant)  # int8 / fp8 kernels with their float32 scales in their specs
    specs = held.param_specs(model)
    pool_rules = {**rules, **POOL_RULES}
    from raydeploy.engine.attention import work_follows_table  # imports jax: only when planning
    from raydeploy.engine.kv_cache import (  # imports jax: only when planning
        PoolLayout,
        pool_specs,
        resolve_kv_dtype,
    )

    acc = c.accelerator_type or ""
    try:  # the chip from the config: a quantized fp8 cache needs fp8 as fp8 weights do
        kv_dtype = resolve_kv_dtype(eng.kv_dtype, cfg.model.dtype, eng.attention, c.platform,
                                    f"TPU {acc}" if c.platform == "tpu" and acc else acc,
                                    GPU_COMPUTE_CAPABILITY.get(acc.lower()))
        follows = work_follows_table(eng.attention, c.platform, kv_dtype)
    except ValueError as err:
        problems.append(str(err))
        kv_dtype, follows = cfg.model.dtype, False
    geometry = EngineGeometry.create(eng, cfg.model, mesh, rules, c.platform, kv_dtype, follows)
    problems += geometry.problems()
    groups, pages_per_group = geometry.groups, geometry.pages_per_group

    layout = PoolLayout.for_engine(family, model, eng, cfg.model.max_seq_len, groups)
    kv_specs = pool_specs(family, model, layout, pages_per_group * groups, eng.page_size, eng.max_slots)
    seen: set[str] = set()
    for spec in [*specs.values(), page_table_spec(eng.max_slots, cfg.model.max_seq_len, eng.page_size), *kv_specs]:
        try:
            check_divisible(spec, pool_rules, mesh)
        except ConfigError as err:
            msg = _generic(str(err))
            if msg not in seen:
                seen.add(msg)
                problems.append(msg)

    p_item, kv_item = ITEMSIZE[cfg.model.param_dtype], ITEMSIZE[kv_dtype]
    param_count = family.param_count(model)
    p_dev = sum(_shard_numel(s, rules, mesh) * ITEMSIZE[s.dtype or cfg.model.param_dtype] for s in specs.values())
    scale_dev = sum(_shard_numel(s, rules, mesh) * SCALE_ITEMSIZE for s in specs.values() if is_scale(s.name))
    p_total = sum(s.numel * ITEMSIZE[s.dtype or cfg.model.param_dtype] for s in specs.values())
    # a quantized KV cache: a float32 scale per token and combined head beside each pool ([..., 2 * kv_heads, 1])
    kv_scales = [_kv_scale_spec(spec) for spec in kv_specs] if is_quantized(kv_dtype) else []
    kv_scale_dev = sum(_shard_numel(spec, pool_rules, mesh) for spec in kv_scales) * SCALE_ITEMSIZE
    kv_total = sum(spec.numel for spec in kv_specs) * kv_item + sum(s.numel for s in kv_scales) * SCALE_ITEMSIZE
    kv_dev = sum(_shard_numel(spec, pool_rules, mesh) for spec in kv_specs) * kv_item + kv_scale_dev
    kv_token_dev = _kv_bytes_per_token_per_device(kv_specs, kv_scales, layout, pool_rules, mesh, kv_item,
                                                  pages_per_group * eng.page_size, model.num_layers)

    packed_dev = packed_bytes_max(cfg, specs)
    from raydeploy.lora.layout import LoraLayout  # imports jax: only when planning

    lora = LoraLayout.for_model(family, model, cfg.lora, cfg.model.param_dtype)
    lora_dev = 0 if lora is None else lora.bytes_per_chip(mesh, rules)

    mem, mem_from = device_memory(cfg)
    usable = int(mem * USABLE_FRACTION[c.platform])
    need = p_dev + kv_dev + lora_dev
    if packed_dev and need <= usable < need + packed_dev:
        warnings.append(f"per device: parameters + KV cache {_gib(need)} fit the usable {_gib(usable)}, but with "
                        f"packed copies of 4-/8-bit-block weights (up to {_gib(packed_dev)}) they would not; "
                        f"set engine.pack_weights: off if the checkpoint is a dequantized GGUF")
    if need > usable:
        problems.append(
            f"per device: parameters {_gib(p_dev)} + KV cache {_gib(kv_dev)} = {_gib(need)} exceeds the usable "
            f"{_gib(usable)} ({USABLE_FRACTION[c.platform]:.0%} of {_gib(mem)}, {mem_from}); shard over more "
            f"devices (fsdp/tp) or lower engine.num_pages ({pages_per_group} per dp group), engine.max_slots "
            f"({eng.max_slots}) or model.max_seq_len ({cfg.model.max_seq_len})" + ("" if p_item == kv_item == 2 else " or use bfloat16")
            + ("" if quant != "none" or c.platform == "cpu" else "; model.quantization int8 halves bfloat16 weights")
            + ("" if is_quantized(kv_dtype) or c.platform == "cpu" else "; engine.kv_dtype int8 halves a bfloat16 KV cache"))
    if cfg.model.max_seq_len > model.max_position_embeddings:
        warnings.append(f"model.max_seq_len {cfg.model.max_seq_len} exceeds the model's max_position_embeddings "
                        f"{model.max_position_embeddings}")
    if c.platform in ("tpu", "gpu"):
        res = "TPU" if c.platform == "tpu" else "GPU"
        have = c.host_resources.get(res)
        if have is None:
            problems.append(f"cluster.host_resources has no {res}: host actors would not be placed on "
                            f"{c.platform.upper()} nodes; set host_resources: {{{res}: {c.devices_per_host}}}")
        elif have != c.devices_per_host:
            problems.append(f"cluster.host_resources.{res} is {have:g} but cluster.devices_per_host is "
                            f"{c.devices_per_host}; each host actor must own all its devices")
    cache_dir = cfg.engine.compilation_cache_dir
    if cache_dir and "://" in cache_dir:
        warnings.append(f"engine.compilation_cache_dir {cache_dir} is not checked here (that needs the hosts' "
                        f"credentials); the hosts need etils[epath] and gcsfs to use it")
    elif (cache_problem := cache_dir_problem(cache_dir)) is not None:
        if c.simulated:
            problems.append(cache_problem)
        else:  # the hosts mount it, maybe not this machine
            warnings.append(f"{cache_problem} (checked on this machine; the hosts check it again before joining)")
    if c.platform == "tpu" and c.num_hosts > 1 and not c.tpu_slice_head_resource:
        warnings.append("multi-host TPU without cluster.tpu_slice_head_resource: hosts of different slices "
                        "could be mixed")

    return Plan(
        source=cfg.source, model_config_json="<given>",
        model=family.summary(model),
        platform=c.platform, accelerator_type=c.accelerator_type, num_hosts=c.num_hosts,
        devices_per_host=c.devices_per_host, total_devices=cfg.total_devices, mesh=mesh,
        mesh_axis_span=axis_span(mesh, c.devices_per_host), placement_strategy=placement_strategy(c),
        bundles=host_bundles(c), param_dtype=cfg.model.param_dtype, kv_dtype=kv_dtype,
        param_count=param_count, param_bytes_total=p_total, param_bytes_per_device=p_dev,
        param_bytes_per_host=p_dev * c.devices_per_host, kv_bytes_total=kv_total, kv_bytes_per_device=kv_dev,
        kv_bytes_per_host=kv_dev * c.devices_per_host, slots_per_dp_group=geometry.slots_per_group,
        page_size=eng.page_size, pages_per_dp_group=pages_per_group,
        device_memory_bytes=mem, device_memory_from=mem_from, usable_bytes_per_device=usable,
        free_bytes_per_device=usable - need, problems=problems, warnings=warnings,
        slice_head_bundle=head_bundle(c), active_param_count=family.active_param_count(model),
        kv_bytes_per_token=family.kv_bytes_per_token(model, kv_item) + (
            model.num_layers * 2 * model.num_kv_heads * SCALE_ITEMSIZE if is_quantized(kv_dtype) else 0),
        window_ring_pages=layout.ring_pages, window_layers=len(layout.window_layers),
        packed_bytes_per_device=packed_dev, quantization=quant, weight_scale_bytes_per_device=scale_dev,
        kv_scale_bytes_per_device=kv_scale_dev, dp_groups=groups, kv_bytes_per_token_per_device=kv_token_dev,
        lora_bytes_per_device=lora_dev,
    )


# -- filling the chips -----------------------------------------------------------------------------------------


def decode_model(plan: Plan, chip: Chip, slots: int, context: int = MODEL_CONTEXT) -> tuple[DecodeModel, ...]:
    """Modelled decode at batch 1 and with `slots` rows decoding (every dp group full), `context` attended tokens
    each: per step a chip reads its weight shard once and each of its group's rows' KV, and multiplies 2 x (active
    parameters on the chip) x (rows) flops; the step takes `raydeploy.compile.roofline_s` of those. Each step gives
    one token per row. A model of the roofline with published chip figures, not a measurement (no attention flops,
    no collectives, no host overhead)."""
    groups = max(plan.dp_groups, 1)
    chips_per_group = plan.total_devices // groups
    out = []
    for streams in sorted({1, slots}):
        rows = 1 if streams == 1 else -(-streams // groups)
        bytes_read = (plan.param_bytes_per_device + rows * context * plan.kv_bytes_per_token_per_device
                      + plan.lora_bytes_per_device)
        lora_flops = 2 * plan.lora_bytes_per_device / ITEMSIZE[plan.param_dtype]  # per row: every slot's A and B
        flops = (2 * plan.active_param_count / chips_per_group + lora_flops) * rows
        step = roofline_s(chip, flops, bytes_read)
        bound = "HBM" if bytes_read / (chip.hbm_gbps * 1e9) >= flops / (chip.bf16_tflops * 1e12) else "compute"
        out.append(DecodeModel(streams=streams, step_ms=round(step * 1e3, 3), tok_s=round(streams / step, 1),
                               per_stream_tok_s=round(1 / step, 1), bound=bound))
    return tuple(out)


def with_slots(cfg: Config, max_slots: int) -> Config:
    """`cfg` with `engine.max_slots` replaced."""
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, max_slots=max_slots))


def suggest_slots(cfg: Config, model: Any, family: Family, plan: Plan) -> SlotSuggestion:
    """The largest `engine.max_slots` (a multiple of the dp groups, so every group has as many) whose parameters +
    KV cache fit each device's usable bytes: `USABLE_FRACTION` of its memory, so the margin is the rest (10% of
    HBM on TPU, 15% on GPU) for the programs' temporaries, their code and the runtime. Found by planning the config
    again at other slot counts (the pool grows with them: `engine.num_pages` auto). max_slots + one slot per group
    does not fit, or adds a problem. With the modelled decode at that size and at the config's own."""
    c = cfg.cluster
    margin = (f"margin {1 - USABLE_FRACTION[c.platform]:.0%} of device memory, "
              f"{_gib(plan.device_memory_bytes - plan.usable_bytes_per_device)}, for temporaries, code and the runtime")
    chip = chip_figures(cfg)
    config_model = decode_model(plan, chip, cfg.engine.max_slots) if chip and plan.slots_per_dp_group else ()
    if cfg.engine.num_pages:
        return SlotSuggestion(0, margin, chip=chip.name if chip else None, modelled_config=config_model,
                              note=f"engine.num_pages is set ({cfg.engine.num_pages}): the pool does not grow with "
                                   f"the slots; set it to 0 (auto) for a suggestion")
    groups = max(plan.dp_groups, 1)
    known = set(plan.problems)

    def fitting(k: int) -> Plan | None:
        p = _plan(with_slots(cfg, k * groups), model, family)
        fits = (p.param_bytes_per_device + p.kv_bytes_per_device + p.lora_bytes_per_device <= p.usable_bytes_per_device
                and all(pr in known for pr in p.problems))
        return p if fits else None

    best = fitting(1)
    if best is None:
        return SlotSuggestion(0, margin, chip=chip.name if chip else None, modelled_config=config_model,
                              note="not even one slot per dp group fits beside the parameters")
    lo, hi = 1, 2
    while hi <= MAX_SUGGESTED_SLOTS // groups and (p := fitting(hi)) is not None:
        lo, best, hi = hi, p, hi * 2
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        if (p := fitting(mid)) is not None:
            lo, best = mid, p
        else:
            hi = mid
    return SlotSuggestion(lo * groups, margin, kv_bytes_per_device=best.kv_bytes_per_device,
                          free_bytes_per_device=best.free_bytes_per_device, chip=chip.name if chip else None,
                          modelled=decode_model(best, chip, lo * groups) if chip else (),
                          modelled_config=config_model)


MAX_SUGGESTED_SLOTS = 1 << 16
"""The search for the largest max_slots stops here (a tiny model on a large chip)."""


def compiled_margin_slots(plan: Plan, programs: Any) -> tuple[int, int]:
    """(max_slots, margin bytes) with the compiled programs' own bytes as the margin: the largest of any program's
    temporaries + outputs not aliased to inputs + code, measured at the config's max_slots. The KV cache grows
    linearly with the slots (auto pages), so max_slots = the dp groups x the slots per group whose KV fits beside
    the parameters and that margin. The temporaries themselves grow a little with the rows of a decode step: an
    estimate, to confirm with `raydeploy compile --set engine.max_slots=N`."""
    margin = max((p.peak_bytes - p.argument_bytes for p in programs.programs), default=0)
    if not plan.slots_per_dp_group or not plan.kv_bytes_per_device:
        return 0, margin
    per_slot = plan.kv_bytes_per_device / plan.slots_per_dp_group  # one more slot in every group
    room = plan.device_memory_bytes - margin - plan.param_bytes_per_device - plan.lora_bytes_per_device
    return max(int(room // per_slot), 0) * max(plan.dp_groups, 1), margin


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _size(n: int) -> str:
    return _gib(n) if n >= GIB else f"{n / 2**20:.1f} MiB"


def _weights_dtype(plan: Plan) -> str:
    if plan.quantization == "none":
        return plan.param_dtype
    held = "int8" if plan.quantization == "int8" else "float8_e4m3fn"
    return f"{held} projection kernels + {plan.param_dtype} embeddings, LM head and norms"


def _modelled(rows: tuple[DecodeModel, ...]) -> str:
    return "; ".join(f"{m.tok_s:,.0f} tok/s at {m.streams} stream{'s' if m.streams > 1 else ''} "
                     f"({m.step_ms:.2f} ms/step, {m.bound}-bound)" for m in rows)


def _slot_lines(plan: Plan) -> list[str]:
    s = plan.slots
    if s is None:
        return []
    if not s.max_slots:
        return [f"slots         no suggestion: {s.note}"]
    lines = [f"slots         max_slots {s.max_slots} fits ({s.margin}): KV cache {_gib(s.kv_bytes_per_device)} per "
             f"device, {_gib(s.free_bytes_per_device)} of the usable left (config: {plan.slots_per_dp_group * plan.dp_groups})"]
    if s.modelled:
        lines.append(f"modelled      MODEL, not a measurement ({s.chip} roofline, {s.context}-token context per stream): "
                     f"at max_slots {s.max_slots}: {_modelled(s.modelled[-1:])}; batch 1: {_modelled(s.modelled[:1])}"
                     + (f"; at the config's {s.modelled_config[-1].streams}: {_modelled(s.modelled_config[-1:])}"
                        if s.modelled_config else ""))
    return lines


def format_plan(plan: Plan) -> str:
    m = plan.model
    mesh = " x ".join(f"{a}={n} ({plan.mesh_axis_span[a]})" for a, n in plan.mesh.items())
    lines = [
        f"config        {plan.source}",
        f"model         {m['model_type']}: {plan.param_count / 1e9:.3f}B params, {m['layers']} layers, hidden "
        f"{m['hidden']}, heads {m['heads']}/{m['kv_heads']} kv, head_dim {m['head_dim']}, "
        + (f"ffn {m['ffn']}, " if "ffn" in m else "") + f"vocab {m['vocab']}  ({plan.model_config_json})",
        *([f"experts       {m['experts']} per layer, {m['experts_per_token']} per token (ffn {m['expert_ffn']}): "
           f"{plan.active_param_count / 1e9:.3f}B params active per token"] if "experts" in m else []),
        f"hosts         {plan.num_hosts} x {plan.devices_per_host} {plan.platform} device(s)"
        f"{' ' + plan.accelerator_type if plan.accelerator_type else ''} = {plan.total_devices} devices",
        f"mesh          {mesh}",
        f"placement     {plan.placement_strategy}, bundles {plan.bundles}"
        + (f" on one slice claimed by {plan.slice_head_bundle}" if plan.slice_head_bundle else ""),
        f"parameters    {_weights_dtype(plan)}: total {_gib(plan.param_bytes_total)}, per device "
        f"{_gib(plan.param_bytes_per_device)}, per host {_gib(plan.param_bytes_per_host)}"
        + (f" (float32 scales {_size(plan.weight_scale_bytes_per_device)} per device included)"
           if plan.weight_scale_bytes_per_device else ""),
        f"KV cache      {plan.kv_dtype}: total {_gib(plan.kv_bytes_total)}, per device "
        f"{_gib(plan.kv_bytes_per_device)}, per host {_gib(plan.kv_bytes_per_host)} "
        f"(paged: {plan.pages_per_dp_group} pages of {plan.page_size} tokens = "
        f"{plan.pages_per_dp_group * plan.page_size} tokens per dp group; {plan.slots_per_dp_group} slots per dp "
        f"group); {plan.kv_bytes_per_token / 1024:.1f} KiB per token"
        + (f" (float32 scales per token and head: {_size(plan.kv_scale_bytes_per_device)} per device included)"
           if plan.kv_scale_bytes_per_device else "")
        + (f"; {plan.window_layers} sliding-window layers keep a ring of {plan.window_ring_pages} pages per slot "
           f"instead (no prefix caching)" if plan.window_ring_pages else ""),
        *([f"packed copies up to {_gib(plan.packed_bytes_per_device)} per device beside the float32 weights "
           f"(engine.pack_weights: auto; only weights that are exactly 4- or 8-bit blocks, known at load)"]
          if plan.packed_bytes_per_device else []),
        f"device memory {_gib(plan.device_memory_bytes)} ({plan.device_memory_from}); usable "
        f"{_gib(plan.usable_bytes_per_device)}; free after params + KV {_gib(plan.free_bytes_per_device)}",
    ]
    lines += _slot_lines(plan)
    lines += [f"warning       {w}" for w in plan.warnings]
    lines += [f"PROBLEM       {p}" for p in plan.problems]
    lines.append("plan OK" if plan.ok else f"plan IMPOSSIBLE ({len(plan.problems)} problem(s))")
    return "\n".join(lines)


def report_plan(plan: Plan, args: argparse.Namespace, programs: Any = None) -> int:
    """`raydeploy plan`: print the plan (text or --json); exit 1 when it is impossible. `programs` is the
    `raydeploy.compile.CompileReport` of `plan --compile` (the command layer compiles; a program that does not
    fit is one more problem of the plan)."""
    if programs is not None:
        plan = dataclasses.replace(plan, problems=[*plan.problems, *programs.problems])
    if getattr(args, "json", False):
        d = plan.to_dict()
        if programs is not None:
            d["programs"] = {p.name: {"peak_bytes": p.peak_bytes, "temp_bytes": p.temp_bytes}
                             for p in programs.programs}
            slots, margin = compiled_margin_slots(plan, programs)
            d["compiled_margin_slots"] = {"max_slots": slots, "margin_bytes": margin}
        print(json.dumps(d, indent=2))
    else:
        print(format_plan(plan))
        if programs is not None and programs.programs:
            worst = max(programs.programs, key=lambda p: p.peak_bytes)
            print(f"programs      {len(programs.programs)} compiled for {programs.target}; largest "
                  f"{worst.name}: {_gib(worst.peak_bytes)} per device with temporaries {_gib(worst.temp_bytes)}")
            slots, margin = compiled_margin_slots(plan, programs)
            if slots:
                print(f"slots         with the compiled programs' margin ({_gib(margin)}: the largest temporaries + "
                      f"outputs + code, at max_slots {plan.slots_per_dp_group * plan.dp_groups}) about max_slots "
                      f"{slots} fit the whole {_gib(plan.device_memory_bytes)}; confirm with raydeploy compile "
                      f"--set engine.max_slots={slots}")
    if not plan.ok:
        for p in plan.problems:
            print(f"raydeploy plan: {p}", file=sys.stderr)
        return 1
    return 0
