"""Checkpoint to engine, written once: `build_engine(cfg, mesh, checkpoint)` reads the checkpoint's model
config, checks the mesh against the family before any weight is read, reads this process's shards with the
family's sharding rules merged under the configured ones, and builds the paged `Engine` over them.

The host actor (`raydeploy.gang.runtime`), `raydeploy generate` and the benchmarks all build their engines
here, so none can drift from the others (`raydeploy generate` once read the weights without the family's rules).
Imports JAX: import it only where JAX may start (a host actor, a command that runs the model).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raydeploy.checkpoint.reader import CheckpointReader
from raydeploy.config import Config
from raydeploy.engine.engine import Engine
from raydeploy.model.registry import Family, from_hf_config
from raydeploy.model.sharding import merge_rules


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
    t0 = time.perf_counter()
    params, stats = reader.load(family.checkpoint_specs(model, reader.index.tensors), mesh,
                                {**family.rules, **configured}, model_cfg.param_dtype,
                                model_cfg.load_threads if load_threads is None else load_threads, progress=False,
                                verify=model_cfg.verify_checksums)
    seconds = time.perf_counter() - t0
    engine = Engine(family, model, params, mesh, configured, model_cfg, engine_cfg, attention)
    del params  # the engine may hold its own (re-laid-out) copies: do not keep the loaded ones alive too
    return BuiltEngine(engine, family, model, stats, seconds, reader)
