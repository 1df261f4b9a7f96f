"""Checkpoint to engine, written once: `build_engine(cfg, mesh, checkpoint)` reads the checkpoint's model
config, checks the mesh against the family before any weight is read, reads this process's shards with the
family's sharding rules merged under the configured ones, and builds the paged `Engine` over them.

The host actor (`raydeploy.gang.runtime`), `raydeploy generate` and the benchmarks all build their engines
here, so none can drift from the others (`raydeploy generate` once read the weights without the family's rules).
Quantized weights (`model.quantization`, docs/quantization.md): a checkpoint stored quantized (format version 5)
is read as stored, int8 / fp8 bytes and float32 scales, each host its own slices; a float checkpoint with
`model.quantization: int8|fp8` is quantized while loading (`load_params`), a few tensors at a time so the float
weights never sit in device memory whole.

Imports JAX: import it only where JAX may start (a host actor, a command that runs the model).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from jax.sharding import NamedSharding

from raydeploy.checkpoint.demo import resolve_checkpoint
from raydeploy.checkpoint.format import CheckpointError, numpy_dtype
from raydeploy.checkpoint.reader import CheckpointReader, LoadStats
from raydeploy.config import Config
from raydeploy.engine.engine import Engine
from raydeploy.engine.speculative.draft import Drafter, check_vocab, draft_engine_config
from raydeploy.model import quant
from raydeploy.model.registry import Family, from_hf_config
from raydeploy.model.sharding import merge_rules, partition_spec
from raydeploy.model.spec import LAYER_AXIS

QUANTIZE_BATCH_BYTES = 1 << 30
"""Float bytes of the kernels read per step of a load-time quantization (each step's float kernels are freed once
quantized): the peak device memory is the quantized weights plus one such batch."""


@dataclass
class BuiltEngine:
    """An engine over a checkpoint, with what loading it read and took."""

    engine: Engine
    family: Family
    model: Any
    """The family's parsed model config."""
    load_stats: Any
    """The reader's statistics (`CheckpointReader.load`)."""
    load_s: float
    """Seconds reading the weights."""
    reader: CheckpointReader


def build_engine(cfg: Config, mesh: Any, checkpoint: str | Path, *, attention: Any = None,
                 engine_cfg: Any = None, model_cfg: Any = None, load_threads: int | None = None,
                 rules: Mapping[str, Any] | None = None) -> BuiltEngine:
    """The engine of `cfg` over `mesh` with the weights of `checkpoint` (a local checkpoint directory).
    `engine_cfg`/`model_cfg` replace the config's sections (benchmarks that sweep them), `attention` the attention
    backend, `rules` the configured sharding rules."""
    engine_cfg = cfg.engine if engine_cfg is None else engine_cfg
    model_cfg = cfg.model if model_cfg is None else model_cfg
    configured = merge_rules(cfg.mesh.rules) if rules is None else dict(rules)
    reader = CheckpointReader(checkpoint)
    family, model = from_hf_config(reader.hf_config, source=f"{checkpoint}/config.json")
    family.check_mesh(model, dict(mesh.shape))  # before any weight is read
    spec = engine_cfg.speculative
    draft = read_draft(spec.draft_checkpoint, model.vocab_size, mesh) if spec.method == "draft" else None
    t0 = time.perf_counter()
    family, params, stats = load_params(reader, family, model, mesh, {**family.rules, **configured}, model_cfg,
                                        model_cfg.load_threads if load_threads is None else load_threads)
    seconds = time.perf_counter() - t0
    engine = Engine(family, model, params, mesh, configured, model_cfg, engine_cfg, attention, lora_cfg=cfg.lora)
    del params  # the engine may hold its own (re-laid-out) copies: do not keep the loaded ones alive too
    if draft is not None:
        engine.attach_draft(build_drafter(engine, mesh, configured, model_cfg, engine_cfg, attention, draft))
    return BuiltEngine(engine, family, model, stats, seconds, reader)


def read_draft(ref: str | None, target_vocab: int, mesh: Any) -> tuple[CheckpointReader, Family, Any]:
    """The draft checkpoint of `engine.speculative.draft_checkpoint` (`ref`, a directory or a `demo:` name) as
    (reader, family, parsed config), checked before any weight of either model is read: its vocabulary is the
    target's (`target_vocab`; ValueError naming both sizes) and its family runs on `mesh`."""
    if not ref:
        raise ValueError("engine.speculative.method draft needs engine.speculative.draft_checkpoint")
    reader = CheckpointReader(resolve_checkpoint(ref))
    family, model = from_hf_config(reader.hf_config, source=f"{ref}/config.json")
    check_vocab(target_vocab, model.vocab_size, ref)
    family.check_mesh(model, dict(mesh.shape))
    return reader, family, model


def build_drafter(engine: Engine, mesh: Any, rules: Mapping[str, Any], model_cfg: Any, engine_cfg: Any,
                  attention: Any = None, draft: tuple[CheckpointReader, Family, Any] | None = None) -> Drafter:
    """The draft model of `engine_cfg.speculative` for `engine` (`draft`: `read_draft`'s, read here when not
    given): its weights read with the same rules, dtypes and quantization over the same mesh, and a paged engine
    over them sharing the target's page table (`raydeploy.engine.speculative.draft`)."""
    ref = engine_cfg.speculative.draft_checkpoint
    reader, family, model = draft or read_draft(ref, engine.vocab_size, mesh)
    family, params, _ = load_params(reader, family, model, mesh, {**family.rules, **rules}, model_cfg,
                                    model_cfg.load_threads)
    draft_engine = Engine(family, model, params, mesh, rules, model_cfg, draft_engine_config(engine_cfg), attention)
    del params
    return Drafter(draft_engine, engine.tables.table, engine_cfg.speculative.num_tokens, engine.vocab_size, str(ref))


def weights_quantization(reader: CheckpointReader, wanted: str, where: str = "") -> str:
    """How an engine over `reader`'s checkpoint holds its kernels: as stored when the checkpoint is quantized
    (`model.quantization` none or the same), else `wanted` (quantized while loading). A checkpoint quantized
    otherwise than asked is an error naming both (requantizing int8 as fp8 would stack two roundings)."""
    stored = reader.quantization
    if stored == "none":
        return quant.check_mode(wanted)
    if wanted not in ("none", stored):
        raise CheckpointError(f"the checkpoint's weights are stored {stored}, model.quantization asks for {wanted}: "
                              f"set model.quantization to {stored} or none, or convert a float checkpoint with "
                              f"`raydeploy convert --quantize {wanted}`", where or str(reader.path))
    return stored


def load_params(reader: CheckpointReader, family: Family, model: Any, mesh: Any, rules: Mapping[str, Any],
                model_cfg: Any, threads: int) -> tuple[Family, dict[str, Any], LoadStats]:
    """(the family as the engine holds it, this process's params, the read's statistics): the checkpoint as
    stored, or a float checkpoint quantized while loading (`model.quantization`; module docstring). fp8 on a chip
    without fp8 matmuls is refused before any weight is read (`raydeploy.model.quant.fp8_support`)."""
    mode = weights_quantization(reader, model_cfg.quantization)
    if mode == "fp8":
        why = quant.device_fp8_support(mesh.devices.flat[0])
        if why:
            raise ValueError(why)
    names = reader.index.tensors
    load = dict(dtype=model_cfg.param_dtype, threads=threads, progress=False, verify=model_cfg.verify_checksums)
    if mode == "none" or reader.quantization != "none":
        family = family.with_quantization(mode)
        params, stats = reader.load(family.checkpoint_specs(model, names), mesh, rules, **load)
        return family, params, stats
    float_specs = family.checkpoint_specs(model, names)
    family = family.with_quantization(mode)
    targets = family.checkpoint_specs(model, names)
    kernels = [n for n in float_specs if quant.quantized_kernel(n)]
    rest = {n: s for n, s in float_specs.items() if n not in kernels}
    params, first = reader.load(rest, mesh, rules, subset=True, **load)
    reads = [first]
    batch: list[str] = []
    for i, name in enumerate(kernels):
        batch.append(name)
        size = sum(float_specs[n].numel * names[n].itemsize for n in batch)
        if size < QUANTIZE_BATCH_BYTES and i + 1 < len(kernels):
            continue
        # each kernel read in its stored float dtype: quantized from the checkpoint's own values
        specs = {n: dataclasses.replace(float_specs[n], dtype=names[n].dtype) for n in batch}
        floats, st = reader.load(specs, mesh, rules, subset=True, **load)
        reads.append(st)
        for n in batch:
            params[n], params[quant.scale_name(n)] = _quantize(floats.pop(n), targets[quant.scale_name(n)], mode,
                                                               mesh, rules)
        batch = []
    return family, params, _sum_stats(reads)


def _quantize(w: jax.Array, scale_spec: Any, mode: str, mesh: Any, rules: Mapping[str, Any]) -> tuple[Any, Any]:
    """One float kernel (placed on the mesh) -> (q, scale), each host computing its own slices: q keeps w's
    sharding, the scale the kernel's output dims' (`quant.scale_spec`). Over an input dim split across devices
    (fsdp over embed) XLA all-reduces each channel's max across the shards: the scale is the whole channel's."""
    lead = int(scale_spec.logical_axes[:1] == (LAYER_AXIS,))
    axes = quant.input_dims(scale_spec.name.removesuffix(quant.SCALE_SUFFIX), w.ndim, lead)
    scale_sharding = NamedSharding(mesh, partition_spec(scale_spec.logical_axes, rules, dict(mesh.shape),
                                                        scale_spec.name))
    key = (tuple(w.shape), str(w.dtype), w.sharding, scale_sharding, mode, axes)
    fn = _QUANTIZERS.get(key)
    if fn is None:  # one program per kind of kernel: the layers repeat a handful
        fn = _QUANTIZERS[key] = jax.jit(lambda x: quant.quantize_jax(x, mode, axes),
                                        out_shardings=(w.sharding, scale_sharding))
    q, s = fn(w)
    if q.dtype != numpy_dtype(quant.STORAGE_DTYPES[mode]):
        raise AssertionError(f"quantized {scale_spec.name} as {q.dtype}")
    return q, s


_QUANTIZERS: dict[Any, Any] = {}


def _sum_stats(stats: list[LoadStats]) -> LoadStats:
    seconds = sum(s.seconds for s in stats)
    read = sum(s.bytes_read for s in stats)
    return LoadStats(bytes_read=read, seconds=seconds, gbps=read / seconds / 1e9 if seconds else 0.0,
                     tensors=sum(s.tensors for s in stats), files=max(s.files for s in stats),
                     cpu_seconds=sum(s.cpu_seconds for s in stats))
