"""GangSupervisor: builds the gang, watches it, and rebuilds it after a failure.

A Ray actor (named "raydeploy-supervisor" in namespace "raydeploy", num_cpus=0, async) that owns the
placement group and the host actors. Its state machine:

    starting -> loading -> compiling -> ready --(host died / stuck / loop error)--> restarting -> starting ...
                                                  after cluster.max_restarts: failed (with the root cause)

Watching a ready gang: every host has one long-lived `serve` call; `asyncio.wait` on those notices a
process death or a loop error at once; a heartbeat poll notices a host alive but stuck in one step longer
than cluster.step_timeout_s (the watchdog). Any of these takes the whole gang down: rank 0 (if alive)
ends every in-flight request with a retriable error event, every host actor is killed, the placement
group is removed, and after a backoff (restart_backoff_s, doubling) a new gang starts in fresh processes
with a fresh coordinator port (jax.distributed cannot be re-initialised in a process). Errors that a
restart cannot fix (fingerprint mismatch) go straight to `failed`.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from raydeploy.config import Config
from raydeploy.gang.bringup import GangError, _root, bring_up

SUPERVISOR_NAME = "raydeploy-supervisor"
NAMESPACE = "raydeploy"
STATES = ("starting", "loading", "compiling", "ready", "restarting", "failed", "stopped")


@dataclass(frozen=True)
class RestartPolicy:
    """Bounded restarts with exponential backoff."""

    max_restarts: int
    backoff_s: float

    def delay_s(self, restart_number: int) -> float:
        """Seconds to wait before restart number `restart_number` (1-based)."""
        return self.backoff_s * (2 ** max(0, restart_number - 1))

    def allows(self, restarts_done: int) -> bool:
        return restarts_done < self.max_restarts


class GangSupervisor:
    """Create with `ray.remote(GangSupervisor).options(name=..., namespace=..., num_cpus=0)` (see gang.start_gang)."""

    def __init__(self, cfg: Config, checkpoint_path: str | None, faults: dict[int, dict[str, Any]] | None = None,
                 host_configs: dict[int, Config] | None = None, poll_s: float = 0.5,
                 sleep: Callable[[float], Awaitable[None]] | None = None) -> None:
        self.cfg = cfg
        self.checkpoint_path = checkpoint_path
        self.faults = faults or {}
        self.host_configs = host_configs or {}
        self.poll_s = poll_s
        self.sleep = sleep or asyncio.sleep
        self.policy = RestartPolicy(cfg.cluster.max_restarts, cfg.cluster.restart_backoff_s)
        self.state = "starting"
        self.restarts = 0
        self.last_error: str | None = None
        self.generation = 0
        self.hosts: list[Any] = []
        self.group: Any = None
        self.serve_refs: list[Any] = []
        self.phase_s: dict[str, float] = {}
        self.bringup_info: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        self._main: asyncio.Task | None = None
        self._stopping = False

    # -- the HTTP layer's / driver's view ---------------------------------------------------------------
    async def start(self) -> None:
        if self._main is None:
            self._main = asyncio.get_running_loop().create_task(self._run())

    def get_state(self) -> dict[str, Any]:
        return {"state": self.state, "restarts": self.restarts, "last_error": self.last_error,
                "generation": self.generation,
                "coordinator_address": (self.bringup_info or {}).get("coordinator_address"),
                "phase_s": {k: round(v, 3) for k, v in self.phase_s.items()},
                "hosts": self._host_rows(), "history": list(self.history)}

    def get_coordinator(self) -> Any:
        return self.hosts[0] if self.state == "ready" and self.hosts else None

    async def get_status(self) -> dict[str, Any]:
        c = self.cfg.cluster
        out: dict[str, Any] = {
            **self.get_state(),
            "config": {"source": self.cfg.source, "num_hosts": c.num_hosts, "devices_per_host": c.devices_per_host,
                       "platform": c.platform, "mesh": self.cfg.mesh_shape, "checkpoint": self.cfg.model.checkpoint,
                       "model": self.cfg.model.name, "max_slots": self.cfg.engine.max_slots},
            "host_status": [], "stats": None,
        }
        if self.hosts:
            results = await asyncio.gather(*[self._bounded(h.status.remote(), 10.0) for h in self.hosts],
                                           return_exceptions=True)
            out["host_status"] = [r if isinstance(r, dict) else {"rank": i, "error": _root(r)}
                                  for i, r in enumerate(results)]
        if self.state == "ready":
            try:
                out["stats"] = await self._bounded(self.hosts[0].stats.remote(), 10.0)
            except Exception as e:  # noqa: BLE001 - status must answer even while the gang is breaking
                out["stats"] = {"error": _root(e)}
        return out

    async def shutdown(self) -> None:
        """Tear everything down: the loop, every host process, the placement group."""
        self._stopping = True
        if self._main is not None:
            self._main.cancel()
            try:
                await self._main
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - already recorded in state
                pass
        await self._teardown("gang shut down", graceful=True)
        self.state = "stopped"

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            retriable = True
            try:
                await self._start_gang()
                self.state = "ready"
                cause = await self._watch()
            except GangError as e:
                cause, retriable = str(e), e.retriable
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure ends in a defined state
                traceback.print_exc()
                cause = f"supervisor error: {_root(e)}"
            self.state = "restarting"  # before teardown: nobody gets the old coordinator from now on
            self.last_error = cause
            self.history.append({"generation": self.generation, "error": cause, "at": time.time()})
            await self._teardown(cause)
            if not retriable or not self.policy.allows(self.restarts):
                why = "not retriable" if not retriable else f"after {self.restarts} restart(s)"
                self.last_error = f"{cause} ({why})"
                self.state = "failed"
                return
            self.restarts += 1
            self.state = "restarting"
            await self.sleep(self.policy.delay_s(self.restarts))

    async def _start_gang(self) -> None:
        import ray

        from raydeploy.gang.host import HostActor, actor_options
        from raydeploy.gang.placement import PlacementError, reserve_hosts, wait_placed

        self.generation += 1
        self.state = "starting"
        self.phase_s = {}
        self.bringup_info = {}
        t0 = time.perf_counter()
        # Held before the first await: a shutdown that cancels the wait still finds (and removes) the group.
        self.group = reserve_hosts(self.cfg.cluster, f"raydeploy-gang-{self.generation}")
        try:
            await wait_placed(self.group, self.cfg.cluster)
        except PlacementError as e:  # retried: the cluster may grow (autoscaler, nodes coming back)
            self.group = None  # removed by wait_placed
            raise GangError(str(e), phase="placement") from None
        self.phase_s["placement_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        remote_cls = ray.remote(HostActor)
        self.hosts = []
        for rank in range(self.cfg.cluster.num_hosts):
            opts = actor_options(self.cfg, rank, self.group.bundles[rank], self.group.scheduling_strategy(rank),
                                 self.generation)
            opts.pop("name")
            cfg = self.host_configs.get(rank, self.cfg)
            faults = self.faults.get(rank) if self.generation == 1 else None  # injected into the first gang only
            self.hosts.append(remote_cls.options(**opts).remote(cfg, rank, self.generation, self.checkpoint_path,
                                                                faults))
        self.phase_s["actors_s"] = time.perf_counter() - t0
        self.bringup_info = await bring_up(self.cfg, self.hosts, self.phase_s, on_phase=self._on_phase)
        self.serve_refs = [h.serve.remote() for h in self.hosts]

    def _on_phase(self, phase: str) -> None:
        self.state = {"load": "loading", "compile": "compiling"}.get(phase, self.state)

    async def _watch(self) -> str:
        """Return the cause once the ready gang fails (a host died, left its loop, or is stuck)."""
        c = self.cfg.cluster
        waiters = {asyncio.ensure_future(_await(r)): rank for rank, r in enumerate(self.serve_refs)}
        try:
            while True:
                done, _ = await asyncio.wait(list(waiters), timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    rank = waiters[fut]
                    err = fut.exception()
                    if err is not None:
                        return f"host {rank} failed: {_root(err)}"
                    return f"host {rank} left its step loop unexpectedly"
                beats = await asyncio.gather(*[self._bounded(h.heartbeat.remote(), max(10.0, c.heartbeat_timeout_s))
                                               for h in self.hosts], return_exceptions=True)
                for rank, beat in enumerate(beats):
                    if isinstance(beat, BaseException):
                        if any(f.done() for f in waiters):
                            break  # the death itself is reported on the next round
                        return f"host {rank} does not answer heartbeats: {_root(beat)}"
                    if beat.get("in_step_s", 0.0) > c.step_timeout_s:
                        return (f"host {rank} is stuck: step {beat.get('steps_done')} has run "
                                f"{beat['in_step_s']:.1f}s > cluster.step_timeout_s={c.step_timeout_s:g}s")
        finally:
            for fut in waiters:
                fut.cancel()

    async def _teardown(self, cause: str, graceful: bool = False) -> None:
        import ray

        hosts, self.hosts = self.hosts, []
        if hosts:
            try:  # end in-flight requests with a clear retriable error while rank 0 can still answer
                if graceful:
                    await self._bounded(hosts[0].stop.remote(), 10.0)
                await self._bounded(hosts[0].fail_all.remote(f"gang failure, retry: {cause}", True), 10.0)
            except Exception as e:  # noqa: BLE001 - rank 0 may be the host that died
                print(f"raydeploy supervisor: rank 0 could not fail requests ({_root(e)})")
        for h in hosts:
            ray.kill(h, no_restart=True)
        self.serve_refs = []
        # wait until the processes are really gone (ports, devices freed)
        inits = (self.bringup_info or {}).get("init") or []
        here = ray.get_runtime_context().get_node_id()
        local_pids = [i.get("pid") if i.get("node_id") == here else None for i in inits] + [None] * len(hosts)
        await asyncio.gather(*[_wait_dead(h, pid, 30.0) for h, pid in zip(hosts, local_pids, strict=False)])
        if self.group is not None:
            self.group.remove()
            self.group = None

    # -- helpers -------------------------------------------------------------------------------------------
    @staticmethod
    async def _bounded(ref: Any, timeout_s: float) -> Any:
        return await asyncio.wait_for(_await(ref), timeout_s)

    def _host_rows(self) -> list[dict[str, Any]]:
        rows = []
        loads = self.bringup_info.get("load", []) if self.bringup_info else []
        for rank in range(self.cfg.cluster.num_hosts):
            row: dict[str, Any] = {"rank": rank, "alive": rank < len(self.hosts)}
            if rank < len(loads):
                ld = loads[rank]
                row["load"] = {"bytes_read": ld.get("bytes_read"), "seconds": round(ld.get("wall_s", 0.0), 3),
                               "gbps": round(ld.get("gbps", 0.0), 3)}
            rows.append(row)
        return rows


async def _await(ref: Any) -> Any:
    return await ref


async def _wait_dead(handle: Any, pid: int | None, timeout_s: float) -> None:
    """Wait until Ray reports the actor dead and, when it ran on this node, its process has exited."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            await asyncio.wait_for(_await(handle.node_ip.remote()), 2.0)
        except ray.exceptions.RayActorError:
            break
        except TimeoutError:
            pass
        await asyncio.sleep(0.1)
    while pid is not None and _process_running(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if time.monotonic() >= deadline:
        print(f"raydeploy supervisor: a killed host actor (pid {pid}) is still running after {timeout_s:g}s")


def _process_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
