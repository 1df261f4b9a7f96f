"""HostActor: one per host, its own process, where JAX lives.

The driver (and the supervisor) import this module without importing JAX: the actor's JAX environment
(platform, virtual device count, thread pool) is passed in the actor's runtime_env, and JAX is imported
only inside the methods, so it initialises with that environment. The actor is async so that status,
heartbeat and the coordinator's entry points stay responsive while a phase or the step loop runs in a
worker thread.

Bring-up phases (called by raydeploy.gang.bringup in this order, on every host concurrently):
`process_info` -> `preflight` (environment and devices, before JAX starts) -> `fingerprint` -> `init_distributed` -> `load` -> `compile` -> `serve` (the long-lived call: rank 0 runs
the coordinator loop, followers the step loop; it returns on shutdown and raises on failure, which is
how the supervisor notices a dead or broken host). Rank 0 also answers `generate`/`abort`/`stats`.
`engine` is where the engine comes from (raydeploy.gang.engines.EngineSource, or a factory name: one of
raydeploy.gang.runtime.ENGINES or "module:function"); tests inject failures by wrapping it
(raydeploy.testing.faults.FaultyEngine: never join, fail the load, hang in a step).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from raydeploy.config import Config
from raydeploy.engine.request import GenerationRequest, TokenEvent
from raydeploy.gang.engines import EngineSource, engine_source
from raydeploy.lora.commands import adapter_path
from raydeploy.lora.slots import AdapterTable

if TYPE_CHECKING:  # names for annotations only: this module must not import JAX
    from jax.sharding import Mesh

    from raydeploy.engine.interfaces import StepEngine
    from raydeploy.gang.coordinator import Coordinator
    from raydeploy.gang.dispatch import FollowerLoop, StepClock
    from raydeploy.gang.runtime import LoadedEngine

JAX_COORDINATOR_PORT = 8476
"""JAX's own default coordinator port; the gang's coordinator listens here on real clusters."""


def host_env(cfg: Config) -> dict[str, str]:
    """Environment of a host process, set before JAX is imported there."""
    c = cfg.cluster
    # "cuda", not "gpu": a GPU host must not fall back to another GPU plugin or to the CPU
    env = {"JAX_PLATFORMS": "cuda" if c.platform == "gpu" else c.platform, "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    if c.simulated:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={c.devices_per_host}"
        env["PJRT_NPROC"] = str(simulated_host_threads(c.devices_per_host, c.num_hosts, os.cpu_count() or 1))
    env.update(c.env)
    return env


def simulated_host_threads(devices_per_host: int, num_hosts: int, cores: int) -> int:
    """CPU client threads (`PJRT_NPROC`) of a simulated host process; all of the gang's hosts share one machine.

    Several virtual devices in a process: a large pool, or the first all-reduce between them can deadlock
    (every device's part must run at once). One device per process: the machine's cores split between the
    hosts. Each host otherwise starts a pool as large as the machine, and the hosts' threads fight over the
    cores: measured, two processes decoding 8 rows each at once on 2 cores, 223-250 ms per pass with 8
    threads each, 152 ms with the default pool, 134 ms with 1 thread each (one process alone: 75 ms)."""
    if devices_per_host > 1:
        return max(8, 4 * devices_per_host)
    return max(1, cores // max(1, num_hosts))


def coordinator_port(cfg: Config) -> int:
    """The configured coordinator port: null means JAX's 8476 on real clusters and 0 (a free port, chosen
    at each start) on simulated hosts, where several gangs may share one machine."""
    port = cfg.cluster.coordinator_port
    if port is None:
        return 0 if cfg.cluster.simulated else JAX_COORDINATOR_PORT
    return port


def actor_options(cfg: Config, rank: int, bundle: dict[str, float], scheduling_strategy: Any,
                  generation: int) -> dict[str, Any]:
    """Ray options of host `rank`: its bundle's resources, its placement, its environment."""
    resources = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    return {
        "num_cpus": bundle.get("CPU", 0.0),
        "num_gpus": bundle.get("GPU", 0.0),
        "resources": resources,
        "scheduling_strategy": scheduling_strategy,
        "runtime_env": {"env_vars": host_env(cfg)},
        "name": None,
        "max_restarts": 0,
        "max_concurrency": 64,
    }


class HostActor:
    """One host of the gang. Create with `ray.remote(HostActor).options(**actor_options(...))`."""

    def __init__(self, cfg: Config, rank: int, generation: int, checkpoint_path: str | None,
                 engine: str | EngineSource = "real") -> None:
        self.cfg = cfg
        self.rank = rank
        self.generation = generation
        self.checkpoint_path = checkpoint_path
        self.engine_source = engine_source(engine)
        self.phase = "created"
        self.phase_times_s: dict[str, float] = {}
        self.init_info: dict[str, Any] = {}
        self.load_stats: dict[str, Any] = {}
        self.mesh: Mesh | None = None
        self.loaded: LoadedEngine | None = None
        self.engine: StepEngine | None = None
        self.eos_token_ids: tuple[int, ...] = ()
        self.loop: FollowerLoop | Coordinator | None = None  # FollowerLoop on followers, Coordinator on rank 0
        self.clock: StepClock | None = None
        self.started_at = time.time()
        self.preflight_info: dict[str, Any] = {}
        self.programs: dict[str, int] | None = None  # {loaded, compiled} after warmup (the real engine)
        self.program_sources: dict[str, dict[str, Any]] = {}  # per program: seconds, loaded from cache or compiled

    # -- bring-up phases ----------------------------------------------------------------------------
    async def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    async def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    async def coordinator_address(self) -> str:
        """Rank 0: `ip:port` of the jax.distributed coordinator it will run (a fresh free port when 0): the
        address every host dials and the only one the service listens on (raydeploy.gang.runtime.coordinator_bind)."""
        import socket

        import ray

        from raydeploy.gang.preflight import PreflightError

        c = self.cfg.cluster
        ip = c.coordinator_bind_address or ray.util.get_node_ip_address()
        port = coordinator_port(self.cfg)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:  # the service listens on this address only: it must be one of this node's (else gRPC aborts)
                s.bind((ip, 0))
            except OSError as e:
                raise PreflightError(f"cluster.coordinator_bind_address {ip!r} cannot be listened on by rank 0 "
                                     f"({e.strerror or e}): it must be an address of rank 0's node; leave it "
                                     "null for the node IP") from None
            if port == 0:
                port = s.getsockname()[1]
        return f"{ip}:{port}"

    async def process_info(self) -> dict[str, Any]:
        """Where this host runs: pid, Ray node id and IP, and when the process started (wall clock)."""
        import ray

        return {"rank": self.rank, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "started_at": self.started_at}

    async def preflight(self) -> dict[str, Any]:
        """Check this host's accelerator environment against the config before JAX starts (no backend is
        initialised); raises raydeploy.gang.preflight.PreflightError, which is not retried."""
        from raydeploy.gang.preflight import check_host

        self.preflight_info = check_host(self.cfg, self.rank)
        return self.preflight_info

    async def fingerprint(self) -> dict[str, str]:
        from raydeploy.gang.fingerprint import host_fingerprint, library_versions
        from raydeploy.gang.runtime import checkpoint_fingerprint

        ckpt = await asyncio.to_thread(checkpoint_fingerprint, self.checkpoint_path)
        return host_fingerprint(self.cfg, ckpt, library_versions())

    async def init_distributed(self, coordinator_address: str) -> dict[str, Any]:
        await self.engine_source.before_init(self.rank, self.generation)
        return await self._phase("init", self._init_sync, coordinator_address)

    def _init_sync(self, coordinator_address: str) -> dict[str, Any]:
        import ray

        from raydeploy.gang.runtime import build_mesh_for, join_distributed

        self.init_info = join_distributed(self.cfg, self.rank, coordinator_address)
        self.init_info["pid"] = os.getpid()
        self.init_info["node_id"] = ray.get_runtime_context().get_node_id()
        self.mesh = build_mesh_for(self.cfg)
        self.init_info["mesh"] = {str(k): int(v) for k, v in self.mesh.shape.items()}
        return self.init_info

    async def load(self) -> dict[str, Any]:
        return await self._phase("load", self._load_sync)

    def _load_sync(self) -> dict[str, Any]:
        self.loaded = self.engine_source.load(self.cfg, self.mesh, self.checkpoint_path, self.rank, self.generation)
        self.engine, self.load_stats = self.loaded.engine, self.loaded.load_stats
        self.eos_token_ids = self.loaded.eos_token_ids
        return self.load_stats

    async def compile(self) -> dict[str, Any]:
        return await self._phase("compile", self._compile_sync)

    def _compile_sync(self) -> dict[str, Any]:
        if self.cfg.engine.warmup and self.engine is not None:
            from raydeploy.engine.engine import compile_threads

            out = dict(self.engine.warmup(compile_threads(self.cfg.engine.compile_threads,
                                                          self.cfg.cluster.platform)))
            status = self.engine.status()
            if "programs" in status:  # which programs came from the cache
                self.programs = dict(status["programs"])
                self.program_sources = dict(status.get("program_sources", {}))  # name -> {seconds, source}
                out["programs"] = self.programs
            return out
        return {}

    async def _phase(self, name: str, fn: Any, *args: Any) -> dict[str, Any]:
        self.phase = name
        t0 = time.perf_counter()
        out = await asyncio.to_thread(fn, *args)
        self.phase_times_s[name] = time.perf_counter() - t0
        self.phase = f"{name}-done"
        return {**(out or {}), "phase_s": self.phase_times_s[name], "rank": self.rank}

    # -- the long-lived call ------------------------------------------------------------------------------
    async def serve(self, runtime_adapters: dict[str, str] | None = None) -> dict[str, Any]:
        """Run this host's loop until shutdown; raises if the loop fails (the supervisor watches this call). Rank 0
        knows `runtime_adapters` first (those loaded over HTTP before this gang restarted; loaded while slots are
        free, the rest on demand), then loads `lora.adapters`: one that cannot be loaded again (its files gone) is
        left out with a line on stderr, not a failed gang."""
        from raydeploy.gang.dispatch import Dispatcher, FollowerLoop, StepClock, jax_kv_client

        self.clock = StepClock()
        client = jax_kv_client()
        engine = self._loaded_engine()
        self.phase = "serving"
        if self.rank == 0:
            from raydeploy.gang.coordinator import Coordinator

            lora = self.cfg.lora
            self.loop = Coordinator(self._make_scheduler(), Dispatcher(engine, client, self.generation,
                                                                      self.cfg.cluster.num_hosts - 1, self.clock),
                                    adapters=AdapterTable(lora.max_adapters) if lora.max_adapters > 0 else None)
            restore = {n: p for n, p in (runtime_adapters or {}).items() if n not in lora.adapters}
            if restore and self.loop.adapters is not None:  # known first, then `lora.adapters` as always
                for name, why in (await self.loop.restore_adapters(restore)).items():
                    print(f"raydeploy host 0: LoRA adapter {name!r} (loaded at runtime from {restore[name]}) was "
                          f"not loaded again after the restart: {why}", file=sys.stderr, flush=True)
            for name, path in lora.adapters.items():  # `lora.adapters`: preloaded before any request
                await self.loop.load_adapter(name, adapter_path(self.cfg, path))
            self.loop.start()
            await asyncio.to_thread(self.loop.join)
            if self.loop.error:
                raise RuntimeError(self.loop.error)
        else:
            self.loop = FollowerLoop(engine, client, self.generation, self.rank, clock=self.clock)
            await asyncio.to_thread(self.loop.run)
        self.phase = "stopped"
        return {"rank": self.rank, "steps": self.clock.steps_done}

    def _loaded_engine(self) -> StepEngine:
        if self.engine is None:
            raise RuntimeError(f"host {self.rank}: the engine is not loaded yet (phase {self.phase})")
        return self.engine

    def _make_scheduler(self) -> Any:
        if self.loaded is None:
            raise RuntimeError(f"host {self.rank}: the engine is not loaded yet (phase {self.phase})")
        return self.loaded.make_scheduler()

    async def stop(self) -> None:
        """Graceful stop: rank 0 broadcasts a shutdown plan, followers leave their loop."""
        if self.loop is not None:
            await asyncio.to_thread(self.loop.stop)

    # -- watchdog and status -------------------------------------------------------------------------------
    async def heartbeat(self) -> dict[str, Any]:
        snap = self.clock.snapshot() if self.clock is not None else {"steps_done": 0, "in_step_s": 0.0}
        return {"rank": self.rank, "phase": self.phase, **snap}

    async def status(self) -> dict[str, Any]:
        from raydeploy.gang.runtime import device_memory, process_rss_bytes

        out: dict[str, Any] = {"rank": self.rank, "pid": os.getpid(), "phase": self.phase,
                               "node_ip": await self.node_ip(), "rss_bytes": process_rss_bytes(),
                               "phase_s": {k: round(v, 3) for k, v in self.phase_times_s.items()},
                               "init": self.init_info, "load": self.load_stats,
                               "preflight": self.preflight_info}
        engine = self.engine.status() if self.engine is not None else {}
        for key in ("matmul", "kv_dtype", "draft"):  # the real engine: "native" or "xla (why)"; the KV pools'
            # dtype; its draft model's steps (engine.speculative.method draft)
            if key in engine:
                out[key] = engine[key]
        if self.programs is not None:
            out["programs_loaded"] = self.programs.get("loaded", 0)
            out["programs_compiled"] = self.programs.get("compiled", 0)
            out["program_sources"] = self.program_sources
        if self.mesh is not None:
            out["device_memory"] = device_memory()
        if self.clock is not None:
            out["steps"] = self.clock.snapshot()
        return out

    # -- rank 0: the coordinator's entry points --------------------------------------------------------
    def _coordinator(self) -> Any:
        from raydeploy.gang.coordinator import Coordinator, GangUnavailableError

        if self.rank != 0:
            raise GangUnavailableError(f"host {self.rank} is not the coordinator (rank 0 is)", retriable=False)
        if not isinstance(self.loop, Coordinator):
            raise GangUnavailableError(f"the gang is not ready (rank 0 is in phase {self.phase})")
        return self.loop

    async def generate(self, req: GenerationRequest) -> AsyncIterator[list[TokenEvent]]:
        """Stream lists of TokenEvents for `req` (call as a Ray streaming generator)."""
        async for batch in self._coordinator().generate(req):
            yield batch

    async def submit(self, req: GenerationRequest, feed: str) -> None:
        """Start `req`; its events go out on the stream `feed(feed)` (raydeploy.gang.feed)."""
        await self._coordinator().submit(req, feed)

    async def feed(self, name: str) -> AsyncIterator[list[TokenEvent]]:
        """Stream the events of every request submitted to feed `name` (call as a Ray streaming generator)."""
        async for batch in self._coordinator().feed(name):
            yield batch

    async def close_feed(self, name: str) -> None:
        self._coordinator().close_feed(name)

    async def abort(self, request_id: str) -> bool:
        return self._coordinator().abort(request_id)

    async def load_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Load LoRA adapter `name` from the PEFT directory `path` on every host (raydeploy.lora)."""
        return await self._coordinator().load_adapter(name, path)

    async def unload_adapter(self, name: str) -> None:
        await self._coordinator().unload_adapter(name)

    async def adapters(self) -> list[str]:
        """The LoRA adapters this gang knows."""
        return self._coordinator().adapter_names()

    def stats(self) -> dict[str, Any]:
        return self._coordinator().stats()

    async def fail_all(self, error: str, retriable: bool = True) -> None:
        """The supervisor declares the gang failed: end in-flight requests with an error event."""
        from raydeploy.gang.coordinator import Coordinator

        if isinstance(self.loop, Coordinator):
            await asyncio.to_thread(self.loop.fail_all, error, retriable)
            # let every stream yield its error event before the supervisor kills this process
            deadline = time.monotonic() + 3.0
            while self.loop.open_streams > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
