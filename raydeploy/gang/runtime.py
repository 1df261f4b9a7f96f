"""What one host holds once it is in the gang: its JAX runtime, mesh, weights and engine.

Runs inside a host actor's process only (it imports JAX lazily, after the actor's environment is set).
Phases, each called by the host actor on behalf of the bring-up sequence:
`init_distributed` (join jax.distributed, check process count, build the global mesh), `load` (read this
host's part of the checkpoint into sharded arrays, build the engine), `compile` (warm every program).
The engine comes from an engine factory named when the gang starts: "real" (raydeploy.engine.engine.Engine
over the checkpoint), "toy" (the stand-in of raydeploy.testing.toy), or any "module:function" with the
signature of `load_checkpoint_engine`.
"""

from __future__ import annotations

import importlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raydeploy.config import Config
from raydeploy.constraints.matcher import GrammarEngine
from raydeploy.engine.interfaces import StepEngine, StepScheduler

ENGINES = {"real": "raydeploy.gang.runtime:load_checkpoint_engine",
           "toy": "raydeploy.testing.toy:load_toy_engine"}
"""Engine factories by name; a gang may also name any other as "module:function"."""


@dataclass
class LoadedEngine:
    """What an engine factory returns on each host: the engine, how it loaded, and (used on rank 0) the
    scheduler that plans its steps."""

    engine: StepEngine
    load_stats: dict[str, Any]
    eos_token_ids: tuple[int, ...]
    make_scheduler: Callable[[], StepScheduler]


def engine_factory(name: str) -> Callable[[Config, Any, str | None], LoadedEngine]:
    """The factory named `name` (a key of ENGINES or "module:function"); ValueError naming what is wrong."""
    spec = ENGINES.get(name, name)
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"engine must be one of {sorted(ENGINES)} or 'module:function', found {name!r}")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"engine factory {spec!r} cannot be loaded: {type(e).__name__}: {e}") from None
    return fn


def coordinator_bind(rank: int, coordinator_address: str) -> str | None:
    """What rank 0's coordination service listens on: exactly the `ip:port` it advertises to the other hosts
    (cluster.coordinator_bind_address, else its node IP: the pod IP on KubeRay), never every interface, so the
    port is reachable only where the gang itself dials it. None on the other ranks (they run no service)."""
    return coordinator_address if rank == 0 else None


def join_distributed(cfg: Config, rank: int, coordinator_address: str) -> dict[str, Any]:
    """`jax.distributed.initialize` (every rank concurrently), then check the gang and build the mesh."""
    import jax

    from raydeploy.engine import compile_cache
    from raydeploy.gang.preflight import jax_platform_of

    c = cfg.cluster
    # Every rank reads the shared cache. On TPU/GPU, JAX writes it from process 0 and hands a missing
    # program's binary to the other processes; on XLA:CPU keys differ per process, so each writes its own.
    on_cpu = jax_platform_of(os.environ) == "cpu"
    compile_cache.enable(cfg.engine.compilation_cache_dir, share_between_hosts=not on_cpu, every_process_writes=on_cpu)
    # On GPU Ray narrows CUDA_VISIBLE_DEVICES to the host's GPUs, which JAX then numbers 0..n-1.
    local_ids = list(range(c.devices_per_host)) if c.platform == "gpu" and not c.simulated else None
    t0 = time.perf_counter()
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=c.num_hosts, process_id=rank,
        local_device_ids=local_ids, coordinator_bind_address=coordinator_bind(rank, coordinator_address),
        initialization_timeout=max(1, math.ceil(c.init_timeout_s)),
        heartbeat_timeout_seconds=max(1, math.ceil(c.heartbeat_timeout_s)))
    init_s = time.perf_counter() - t0
    if jax.process_count() != c.num_hosts:
        raise RuntimeError(f"host {rank}: jax.process_count() is {jax.process_count()}, "
                           f"cluster.num_hosts is {c.num_hosts}")
    local = jax.local_devices()
    if len(local) != c.devices_per_host:
        raise RuntimeError(f"host {rank}: JAX sees {len(local)} local device(s) ({local[0].platform}), "
                           f"cluster.devices_per_host is {c.devices_per_host}")
    return {"init_s": init_s, "process_index": jax.process_index(), "process_count": jax.process_count(),
            "local_devices": [str(d) for d in local], "global_devices": len(jax.devices()),
            "platform": local[0].platform}


def build_mesh_for(cfg: Config) -> Any:
    from raydeploy.model.sharding import build_mesh

    return build_mesh(cfg.mesh_shape)


def checkpoint_fingerprint(checkpoint_path: str | None) -> str:
    """The checkpoint index fingerprint as this host sees it ("toy" for the stand-in engine)."""
    if checkpoint_path is None:
        return "toy"
    from raydeploy.checkpoint.reader import CheckpointReader

    return str(CheckpointReader(checkpoint_path).fingerprint())


def load_engine(engine: str, cfg: Config, mesh: Any, checkpoint_path: str | None) -> LoadedEngine:
    """Build this host's engine with the factory named `engine`."""
    return engine_factory(engine)(cfg, mesh, checkpoint_path)


def load_checkpoint_engine(cfg: Config, mesh: Any, checkpoint_path: str | None) -> LoadedEngine:
    """The real engine: read this host's shards of the checkpoint and build the engine over them."""
    if checkpoint_path is None:
        raise ValueError("the real engine needs a checkpoint path")
    from raydeploy.loading import build_engine

    built = build_engine(cfg, mesh, checkpoint_path)
    engine = built.engine

    def make_scheduler() -> StepScheduler:  # on rank 0 only: it owns the requests' grammar matchers
        from raydeploy.engine.scheduler import Scheduler

        grammar = GrammarEngine.from_checkpoint(checkpoint_path, engine.vocab_size, engine.eos_ids)
        return Scheduler.for_engine(engine, cfg, grammar=grammar)

    return LoadedEngine(engine, _stats_dict(built.load_stats, built.load_s), engine.eos_ids, make_scheduler)


def _stats_dict(stats: Any, seconds: float) -> dict[str, Any]:
    if hasattr(stats, "__dataclass_fields__"):
        import dataclasses

        d = dataclasses.asdict(stats)
    elif isinstance(stats, dict):
        d = dict(stats)
    else:
        d = {"stats": repr(stats)}
    nbytes = int(d.get("bytes_read", 0) or 0)
    d.setdefault("seconds", seconds)
    d["wall_s"] = seconds
    d["gbps"] = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return d


def process_rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def device_memory() -> list[dict[str, Any]]:
    """Per local device: bytes in use / limit when the backend reports them (CPU does not)."""
    import jax

    out = []
    for d in jax.local_devices():
        stats = d.memory_stats() or {}
        out.append({"device": str(d), "bytes_in_use": stats.get("bytes_in_use"),
                    "bytes_limit": stats.get("bytes_limit")})
    return out
