"""GangSupervisor: builds the gang, watches it, and rebuilds it after a failure.

A Ray actor (namespace "raydeploy", num_cpus=0, async) that owns the host actors and, unless it was given the
placement group of the Serve replica that owns its gang, the placement group. Named after that replica
(raydeploy.gang.directory.gang_name) or by whoever calls `start_gang` ("raydeploy-supervisor" by default). Its state machine:

    starting -> loading -> compiling -> ready --(host died / stuck / loop error)--> restarting -> starting ...
                                                  after cluster.max_restarts: failed (with the root cause)

Watching a ready gang: every host has one long-lived `serve` call; `asyncio.wait` on those notices a
process death or a loop error at once; a heartbeat poll notices a host alive but stuck in one step longer
than cluster.step_timeout_s (the watchdog). Any of these takes the whole gang down: rank 0 (if alive)
ends every in-flight request with a retriable error event, every host actor is killed, the placement
group is removed, and the supervisor waits (bounded) until every old host process has exited, checked by
a tiny task pinned to each old host's node (a TPU host's chips, a GPU's memory and the fixed coordinator
port are free only then). After a backoff (restart_backoff_s, doubling) a new gang starts in fresh
processes (jax.distributed cannot be re-initialised in a process). Errors that a restart cannot fix (a
failed preflight, a fingerprint mismatch) go straight to `failed`.
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
from raydeploy.gang.engines import EngineSource, engine_source

SUPERVISOR_NAME = "raydeploy-supervisor"
EXIT_WAIT_S = 30.0
"""Upper bound on waiting for the old host processes to exit before a restart."""
BLAME_WAIT_S = 5.0
"""How long a failed host's peers get to answer a heartbeat before they are named as the cause."""
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

    def __init__(self, cfg: Config, checkpoint_path: str | None, poll_s: float = 0.5,
                 sleep: Callable[[float], Awaitable[None]] | None = None, name: str = "raydeploy",
                 placement_group: Any = None, engine: str | EngineSource = "real") -> None:
        self.cfg = cfg
        self.checkpoint_path = checkpoint_path
        self.poll_s = poll_s
        self.name = name
        self.engine = engine_source(engine)
        """Where every host's engine comes from (raydeploy.gang.engines: a factory name, or a source wrapping one)."""
        self.placement_group = placement_group
        """A placement group reserved for this gang elsewhere (Serve's, for the replica owning the gang), or None."""
        self.procs: list[dict[str, Any]] = []  # per rank: pid, node_id, node_ip, started_at
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
        self.runtime_adapters: dict[str, str] = {}
        """LoRA adapters loaded over HTTP into this gang (name -> path, as the caller gave it): a restarted gang loads
        them again after `lora.adapters` (`HostActor.serve`)."""
        self._main: asyncio.Task | None = None
        self._stopping = False

    # -- the HTTP layer's / driver's view ---------------------------------------------------------------
    async def start(self) -> None:
        if self._main is None:
            self._main = asyncio.get_running_loop().create_task(self._run())

    def get_state(self) -> dict[str, Any]:
        return {"gang": self.name, "state": self.state, "restarts": self.restarts, "last_error": self.last_error,
                "generation": self.generation,
                "coordinator_address": (self.bringup_info or {}).get("coordinator_address"),
                "phase_s": {k: round(v, 3) for k, v in self.phase_s.items()},
                "placement": self.group.describe() if self.group is not None else None,
                "hosts": self._host_rows(), "history": list(self.history)}

    def get_coordinator(self) -> Any:
        return self.hosts[0] if self.state == "ready" and self.hosts else None

    def remember_adapter(self, name: str, path: str | None) -> None:
        """A LoRA adapter loaded (`path`) or unloaded (None) at runtime: see `runtime_adapters`."""
        if path is None:
            self.runtime_adapters.pop(name, None)
        else:
            self.runtime_adapters[name] = path

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

    async def get_stats(self) -> dict[str, Any]:
        """The coordinator's figures (slots in use, queue depth, tokens, steps); {} while the gang is not ready."""
        if self.state != "ready" or not self.hosts:
            return {}
        try:
            return dict(await self._bounded(self.hosts[0].stats.remote(), 10.0))
        except Exception:  # noqa: BLE001 - the gang is breaking: no figures this time, the state says why
            return {}

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
            entry: dict[str, Any] = {"generation": self.generation, "error": cause, "at": time.time()}
            self.history.append(entry)
            entry["exits"] = await self._teardown(cause)
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
        from raydeploy.gang.placement import PlacementError, external_group, reserve_hosts, wait_placed
        from raydeploy.gang.preflight import PreflightError, check_tpu_nodes

        self.generation += 1
        self.state = "starting"
        self.phase_s = {}
        self.bringup_info = {}
        self.procs = []
        t0 = time.perf_counter()
        try:  # TPU nodes without the slice variables: say so now instead of waiting out placement
            await check_tpu_nodes(self.cfg, min(60.0, self.cfg.cluster.rpc_timeout_s))
        except PreflightError as e:
            raise GangError(str(e), phase="preflight", retriable=False) from None
        if self.placement_group is not None:  # reserved (and placed) by Serve with the replica: kept across restarts
            self.group = external_group(self.cfg.cluster, self.placement_group, self.name)
        else:  # held before the first await: a shutdown that cancels the wait still finds (and removes) the group
            self.group = reserve_hosts(self.cfg.cluster, f"{self.name}-gang-{self.generation}")
        try:
            if self.group.owned:
                await wait_placed(self.group, self.cfg.cluster)
        except PlacementError as e:  # retried: the cluster may grow (autoscaler, nodes coming back)
            self.group = None  # removed by wait_placed
            raise GangError(str(e), phase="placement") from None
        except PreflightError as e:
            self.group = None
            raise GangError(str(e), phase="preflight", retriable=False) from None
        self.phase_s["placement_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        remote_cls = ray.remote(HostActor)
        self.hosts = []
        for rank in range(self.cfg.cluster.num_hosts):
            opts = actor_options(self.cfg, rank, self.group.bundle(rank), self.group.scheduling_strategy(rank),
                                 self.generation)
            opts.pop("name")
            cfg = self.engine.config_for(self.cfg, rank)
            self.hosts.append(remote_cls.options(**opts).remote(cfg, rank, self.generation, self.checkpoint_path,
                                                                self.engine))
        await self._record_procs()
        self.phase_s["actors_s"] = time.perf_counter() - t0
        self.bringup_info = await bring_up(self.cfg, self.hosts, self.phase_s, on_phase=self._on_phase)
        self.serve_refs = [h.serve.remote(dict(self.runtime_adapters)) for h in self.hosts]

    async def _record_procs(self) -> None:
        """Every host's pid and node (kept even if some hosts failed to start, for the teardown's wait)."""
        timeout_s = self.cfg.cluster.rpc_timeout_s
        results = await asyncio.gather(*[self._bounded(h.process_info.remote(), timeout_s) for h in self.hosts],
                                       return_exceptions=True)
        self.procs = [r if isinstance(r, dict) else {"rank": i} for i, r in enumerate(results)]
        failed = [f"host {i} failed: {_root(r)}" for i, r in enumerate(results) if not isinstance(r, dict)]
        if failed:
            raise GangError("bring-up phase 'start' failed: " + "; ".join(failed), phase="start")

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
                        return await self._blame(rank, err)
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

    async def _blame(self, rank: int, err: BaseException) -> str:
        """The cause of a host's failed step loop, naming first the peers that no longer answer.

        A host that dies takes its peers' collectives down with it, and a peer's error ("connection reset by
        peer") can reach the supervisor before Ray reports the death: ask the others, bounded, whether they
        are still there.
        """
        import ray

        own = f"host {rank} failed: {_root(err)}"
        if isinstance(err, ray.exceptions.RayActorError):
            return own
        others = [r for r in range(len(self.hosts)) if r != rank]
        beats = await asyncio.gather(*[self._bounded(self.hosts[r].heartbeat.remote(), BLAME_WAIT_S)
                                       for r in others], return_exceptions=True)
        gone = [_absence(r, b) for r, b in zip(others, beats, strict=True) if isinstance(b, BaseException)]
        return "; ".join([*gone, own])

    async def _teardown(self, cause: str, graceful: bool = False) -> list[dict[str, Any]]:
        """Stop and kill every host, wait until each old process has exited on its node, remove the
        placement; returns per host what the exit check saw."""
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
        # wait until the processes are really gone on their own nodes (chips, GPU memory, ports freed)
        procs = self.procs + [{"rank": i} for i in range(len(self.procs), len(hosts))]
        exits = list(await asyncio.gather(*[_wait_exited(h, p, EXIT_WAIT_S) for h, p in zip(hosts, procs,
                                                                                              strict=False)]))
        for ex in exits:
            if not ex.get("gone"):
                print(f"raydeploy supervisor: old host {ex.get('rank')} (pid {ex.get('pid')} on node "
                      f"{ex.get('node_id')}) has not exited after {EXIT_WAIT_S:g}s: {ex.get('error', '')}")
        if self.group is not None:
            self.group.remove()
            self.group = None
        return exits

    # -- helpers -------------------------------------------------------------------------------------------
    @staticmethod
    async def _bounded(ref: Any, timeout_s: float) -> Any:
        return await asyncio.wait_for(_await(ref), timeout_s)

    def _host_rows(self) -> list[dict[str, Any]]:
        rows = []
        info = self.bringup_info or {}
        loads, preflight, compiles = info.get("load", []), info.get("preflight", []), info.get("compile", [])
        for rank in range(self.cfg.cluster.num_hosts):
            row: dict[str, Any] = {"rank": rank, "alive": rank < len(self.hosts)}
            if rank < len(self.procs):
                row.update({k: self.procs[rank][k] for k in ("pid", "node_id", "node_ip", "started_at")
                            if k in self.procs[rank]})
            if rank < len(preflight) and "TPU_WORKER_ID" in preflight[rank]:
                row["tpu_worker_id"] = int(preflight[rank]["TPU_WORKER_ID"])
            if rank < len(compiles) and isinstance(compiles[rank].get("programs"), dict):
                row["programs"] = dict(compiles[rank]["programs"])
            if rank < len(loads):
                ld = loads[rank]
                row["load"] = {"bytes_read": ld.get("bytes_read"), "seconds": round(ld.get("wall_s", 0.0), 3),
                               "gbps": round(ld.get("gbps", 0.0), 3), "cpu_seconds": ld.get("cpu_seconds")}
            rows.append(row)
        return rows


def _absence(rank: int, err: BaseException) -> str:
    """Why host `rank` did not answer a heartbeat: it died, or it stayed silent."""
    import ray

    if isinstance(err, ray.exceptions.RayActorError):
        return f"host {rank} died: {_root(err)}"
    if isinstance(err, TimeoutError):
        return f"host {rank} does not answer within {BLAME_WAIT_S:g}s"
    return f"host {rank} does not answer: {_root(err)}"


async def _await(ref: Any) -> Any:
    return await ref


async def _wait_exited(handle: Any, proc: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Wait (bounded) until a killed host's process has exited: a zero-CPU task pinned to the host's node
    (hard node affinity) polls its pid. Without a known pid, wait until Ray reports the actor dead."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    out: dict[str, Any] = {"rank": proc.get("rank"), "pid": proc.get("pid"), "node_id": proc.get("node_id")}
    if proc.get("pid") is None or proc.get("node_id") is None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(_await(handle.node_ip.remote()), 2.0)
            except ray.exceptions.RayActorError:
                return {**out, "gone": True, "at": time.time(), "checked": "actor"}
            except TimeoutError:
                pass
            await asyncio.sleep(0.1)
        return {**out, "gone": False, "error": "Ray still reports the actor alive"}
    check = ray.remote(num_cpus=0, max_retries=0)(wait_pid_exited).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(proc["node_id"], soft=False))
    try:
        # the bound covers the check task's own start on that node
        res = await asyncio.wait_for(_await(check.remote(int(proc["pid"]), timeout_s)), timeout_s + 30.0)
    except TimeoutError:
        return {**out, "gone": False, "error": f"the exit check on the node did not answer in {timeout_s + 30:g}s"}
    except Exception as e:  # noqa: BLE001 - a dead node holds no processes; say what happened
        return {**out, "gone": None, "error": f"the exit check failed on the node: {_root(e)}"}
    return {**out, **res, "checked": "node"}


def wait_pid_exited(pid: int, timeout_s: float, poll_s: float = 0.05) -> dict[str, Any]:
    """On the node where `pid` ran: poll until it has exited, at most `timeout_s`; when it was seen gone."""
    import ray

    deadline = time.monotonic() + timeout_s
    while _process_running(pid):
        if time.monotonic() > deadline:
            return {"gone": False, "error": f"pid {pid} still running after {timeout_s:g}s"}
        time.sleep(poll_s)
    return {"gone": True, "at": time.time(), "seen_on": ray.get_runtime_context().get_node_id()}


def _process_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
