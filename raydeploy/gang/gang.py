"""The plain-Python entry to a gang, for the CLI driver, the Serve app and tests.

`start_gang(cfg)` starts (or replaces) the named GangSupervisor actor and returns a :class:`Gang` handle;
`Gang.wait_ready()` waits (bounded) until the state is `ready` or `failed`. Callers read a coordinator's token
streams through raydeploy.gang.feed. Requires `ray.init` to have run.
"""

from __future__ import annotations

import time
from typing import Any

from raydeploy.config import Config
from raydeploy.engine.request import GenerationRequest, TokenEvent
from raydeploy.gang.bringup import GangError
from raydeploy.gang.engines import EngineSource, engine_source
from raydeploy.gang.feed import stream_events
from raydeploy.gang.supervisor import NAMESPACE, SUPERVISOR_NAME, GangSupervisor


def resolve_checkpoint_path(cfg: Config) -> str:
    """The checkpoint directory the hosts read (a `demo:` reference is converted once, here, before hosts start)."""
    ref = cfg.model.checkpoint
    if ref.startswith("demo:"):
        from raydeploy.checkpoint.demo import resolve_checkpoint

        return str(resolve_checkpoint(ref, split_for=cfg))  # stored split for this mesh: reads without copies
    return ref


class Gang:
    """Driver-side handle of a supervised gang."""

    def __init__(self, supervisor: Any, cfg: Config) -> None:
        self.supervisor = supervisor
        self.cfg = cfg

    def state(self, timeout_s: float = 30.0) -> dict[str, Any]:
        import ray

        return ray.get(self.supervisor.get_state.remote(), timeout=timeout_s)

    def status(self, timeout_s: float = 60.0) -> dict[str, Any]:
        import ray

        return ray.get(self.supervisor.get_status.remote(), timeout=timeout_s)

    def wait_ready(self, timeout_s: float, poll_s: float = 0.2, newer_than: int | None = None) -> dict[str, Any]:
        """Wait until `ready`; raise GangError on `failed` or when `timeout_s` passes.

        `newer_than`: wait for a gang generation after that one. A caller that saw its request fail with the
        gang passes the generation it sent the request to: the supervisor may not have noticed the death yet,
        and until it does, the dead generation still reads `ready`."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.state()
            if st["state"] == "ready" and (newer_than is None or st["generation"] > newer_than):
                return st
            if st["state"] in ("failed", "stopped"):
                raise GangError(f"gang {st['state']}: {st['last_error']}", phase="bring-up", retriable=False)
            if time.monotonic() > deadline:
                raise GangError(f"gang not ready within {timeout_s:g}s (state {st['state']}, "
                                f"last error {st['last_error']})", phase="bring-up")
            time.sleep(poll_s)

    def coordinator(self, timeout_s: float = 30.0) -> Any:
        import ray

        coord = ray.get(self.supervisor.get_coordinator.remote(), timeout=timeout_s)
        if coord is None:
            st = self.state()
            raise GangError(f"gang is not ready (state {st['state']})", phase="serve")
        return coord

    def generate(self, req: GenerationRequest, timeout_s: float) -> list[TokenEvent]:
        """Run one request to completion (blocking; for tests and batch jobs). Bounded by `timeout_s`."""
        import asyncio

        async def collect() -> list[TokenEvent]:
            out: list[TokenEvent] = []
            async for batch in stream_events(self.coordinator(), req):
                out.extend(batch)
            return out

        return asyncio.run(asyncio.wait_for(collect(), timeout_s))

    def shutdown(self, timeout_s: float = 120.0) -> None:
        import ray

        try:
            ray.get(self.supervisor.shutdown.remote(), timeout=timeout_s)
        finally:
            ray.kill(self.supervisor, no_restart=True)


def create_supervisor(cfg: Config, *, name: str, engine: str | EngineSource = "real",
                      checkpoint_path: str | None = None, poll_s: float = 0.5, detached: bool = False,
                      placement_group: Any = None) -> Any:
    """Create the supervisor actor `name` (namespace "raydeploy") without starting it or waiting (call its
    `start`). With `placement_group`, the gang's hosts go into that group's bundles (one per rank), which the
    caller reserved and removes (a Serve replica's group); otherwise the supervisor reserves its own.

    `engine` names the engine factory (raydeploy.gang.runtime.ENGINES: "real", "toy", or "module:function"), or
    is an engine source (raydeploy.gang.engines); only "real" reads the checkpoint."""
    import ray

    source = engine_source(engine)
    path = (checkpoint_path or resolve_checkpoint_path(cfg)) if source.reads_checkpoint else None
    lifetime = {"lifetime": "detached"} if detached else {}
    # an actor handle: Ray's stubs type its methods as the plain methods, not as `.remote`-callables
    sup: Any = ray.remote(GangSupervisor).options(name=name, namespace=NAMESPACE, num_cpus=0,
                                                  max_concurrency=64, **lifetime).remote(
        cfg, path, poll_s=poll_s, name=name, placement_group=placement_group, engine=source)
    return sup


def check_engine(engine: str | EngineSource) -> EngineSource:
    """`engine` as a checked engine source: a known engine name or "module:function" (imported on the hosts, not
    here: no JAX in the driver), or a source wrapping one."""
    return engine_source(engine)


def start_gang(cfg: Config, *, engine: str | EngineSource = "real", checkpoint_path: str | None = None,
               poll_s: float = 0.5, detached: bool = False, name: str = SUPERVISOR_NAME) -> Gang:
    """Start a supervisor named `name` and its gang; returns at once (see wait_ready). For batch jobs, tests
    and benchmarks; `raydeploy serve` runs one gang per Serve replica instead (raydeploy.serve.replica).

    A supervisor left over under the same name (a job re-run after a crash) is shut down first; gangs with
    different names run side by side, each on its own hosts (on TPU, each on its own slice). `detached`
    makes the supervisor outlive the process that starts it.

    engine "toy" runs the stand-in engine without a checkpoint (tests, control benchmarks); tests inject per-rank
    failures and configs with an engine source that wraps the factory (raydeploy.testing.faults.FaultyEngine).
    """
    import ray

    check_engine(engine)
    try:
        old = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        old = None
    if old is not None:
        try:
            ray.get(old.shutdown.remote(), timeout=cfg.cluster.rpc_timeout_s)
        finally:
            ray.kill(old, no_restart=True)
    sup = create_supervisor(cfg, name=name, engine=engine, checkpoint_path=checkpoint_path, poll_s=poll_s,
                            detached=detached)
    ray.get(sup.start.remote(), timeout=cfg.cluster.rpc_timeout_s)
    return Gang(sup, cfg)
