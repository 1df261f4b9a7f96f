"""Every gang of one Serve application, found by the names of their supervisors.

Each Serve replica of the gang deployment (raydeploy.serve.replica) owns one gang and names its supervisor
actor `raydeploy-gang-<app>-<replica id>` in namespace "raydeploy". The supervisor is not detached: it lives
and dies with its replica, and its name with it, so listing the named actors with that prefix is the set of
gangs at this moment, with nothing to register or expire. The HTTP ingress (/ready, /status, /metrics), the
`raydeploy serve` driver and the tests ask each supervisor through this module; request routing itself is
Serve's (a DeploymentHandle over the replicas), not this module's.

Why ask each gang rather than keep a registry actor: the supervisors already hold the state, a registry
would be one more actor to keep alive and in step (a replica that dies without unregistering), and the
listing is one GCS call per probe, cached for a moment. No JAX here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from raydeploy.gang.supervisor import NAMESPACE

GANG_PREFIX = "raydeploy-gang"
STATE_ORDER = ("ready", "compiling", "loading", "starting", "restarting", "unknown", "failed", "stopped")
"""How one word sums up several gangs: the first state any gang is in."""


def gang_name(app_name: str, replica_id: str) -> str:
    """The supervisor name of the gang owned by Serve replica `replica_id` of application `app_name`."""
    return f"{GANG_PREFIX}-{app_name}-{replica_id}"


def list_gangs(app_name: str) -> dict[str, Any]:
    """Supervisor handles of the application's live gangs, by name (one GCS call)."""
    import ray

    prefix = f"{GANG_PREFIX}-{app_name}-"
    out: dict[str, Any] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"] if isinstance(entry, dict) else str(entry)
        namespace = entry.get("namespace") if isinstance(entry, dict) else NAMESPACE
        if namespace == NAMESPACE and name.startswith(prefix):
            try:
                out[name] = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:  # it died between the listing and the lookup
                continue
    return out


def summarize(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One state for the deployment: `ready` while at least one gang is ready, with every gang listed."""
    ready = [s for s in states if s.get("state") == "ready"]
    if not states:
        state = "starting"
    else:
        present = {str(s.get("state", "unknown")) for s in states}
        state = next((w for w in STATE_ORDER if w in present), sorted(present)[0])
    errors = [s["last_error"] for s in states if s.get("last_error")]
    restarts = [s.get("restarts") for s in states]
    return {"state": state, "ready_gangs": len(ready), "total_gangs": len(states),
            "restarts": sum(r for r in restarts if isinstance(r, int)), "last_error": errors[-1] if errors else None,
            "gangs": sorted(states, key=lambda s: str(s.get("gang", "")))}


def sum_stats(per_gang: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The coordinators' figures summed over gangs (slots in use, queue depth, tokens, steps, ...), and each
    gang's own under "gangs"."""
    total: dict[str, Any] = {}
    for stats in per_gang.values():
        for k, v in stats.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                total[k] = total.get(k, 0) + v
    return {**total, "gangs": per_gang}


class GangDirectory:
    """Async view of the application's gangs for the HTTP ingress; every call is bounded by `rpc_timeout_s`."""

    def __init__(self, app_name: str, rpc_timeout_s: float = 10.0, cache_s: float = 0.25) -> None:
        self.app_name = app_name
        self.rpc_timeout_s = rpc_timeout_s
        self.cache_s = cache_s
        self._handles: dict[str, Any] = {}
        self._listed_at = -1e9
        self._summary: dict[str, Any] | None = None
        self._summary_at = -1e9

    async def handles(self) -> dict[str, Any]:
        now = time.monotonic()
        if now - self._listed_at >= self.cache_s:
            self._handles = await asyncio.wait_for(asyncio.to_thread(list_gangs, self.app_name), self.rpc_timeout_s)
            self._listed_at = now
        return self._handles

    async def _each(self, method: str) -> dict[str, Any]:
        """`method` of every supervisor; a gang that does not answer in time is left out (its replica is going)."""
        handles = await self.handles()
        names = list(handles)
        results = await asyncio.gather(*[asyncio.wait_for(_await(getattr(handles[n], method).remote()),
                                                          self.rpc_timeout_s) for n in names],
                                       return_exceptions=True)
        return {n: r for n, r in zip(names, results, strict=True) if isinstance(r, dict)}

    async def state(self) -> dict[str, Any]:
        now = time.monotonic()
        if self._summary is None or now - self._summary_at >= self.cache_s:
            states = await self._each("get_state")
            self._summary = summarize([{**s, "gang": n} for n, s in states.items()])
            self._summary_at = now
        return self._summary

    async def stats(self) -> dict[str, Any]:
        return sum_stats({n: s for n, s in (await self._each("get_stats")).items() if s})

    async def status(self) -> dict[str, Any]:
        st = await self._each("get_status")
        return {**summarize([{**s, "gang": n} for n, s in st.items()])}


async def _await(ref: Any) -> Any:
    return await ref


class GangSet:
    """Blocking view of the application's gangs for the driver and tests (Ray must be initialised)."""

    def __init__(self, app_name: str, cfg: Any, rpc_timeout_s: float = 60.0) -> None:
        self.app_name = app_name
        self.cfg = cfg
        self.rpc_timeout_s = rpc_timeout_s

    def supervisors(self) -> dict[str, Any]:
        return list_gangs(self.app_name)

    def _each(self, method: str) -> dict[str, dict[str, Any]]:
        import ray

        handles = self.supervisors()
        refs = {n: getattr(h, method).remote() for n, h in handles.items()}
        out = {}
        for n, ref in refs.items():
            try:
                out[n] = {**ray.get(ref, timeout=self.rpc_timeout_s), "gang": n}
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue  # its replica is going away
        return out

    def state(self) -> dict[str, Any]:
        """The deployment's state (`ready` while at least one gang is), `ready_gangs`, and every gang's."""
        return summarize(list(self._each("get_state").values()))

    def status(self) -> dict[str, Any]:
        """Every gang's full status (hosts, placement, stats) under "gangs"."""
        return summarize(list(self._each("get_status").values()))

    def wait_ready(self, timeout_s: float, count: int | None = None, poll_s: float = 0.2) -> dict[str, Any]:
        """Wait until `count` gangs (default replicas.min) are ready; GangError after `timeout_s`, or at once
        when every gang has failed."""
        from raydeploy.gang.bringup import GangError

        want = self.cfg.replicas.min if count is None else count
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.state()
            if st["ready_gangs"] >= want:
                return st
            if st["total_gangs"] and st["state"] == "failed":
                raise GangError(f"gang failed: {st['last_error']}", phase="bring-up", retriable=False)
            if time.monotonic() > deadline:
                raise GangError(f"{st['ready_gangs']} of {want} gang(s) ready after {timeout_s:g}s (state "
                                f"{st['state']}, last error {st['last_error']})", phase="bring-up")
            time.sleep(poll_s)

    def gang(self, name: str) -> Any:
        """The driver-side `Gang` handle of one gang (its status, coordinator, a generation through it)."""
        from raydeploy.gang.gang import Gang

        return Gang(self.supervisors()[name], self.cfg)

    def ready_gang(self) -> Any:
        """A `Gang` handle of some ready gang (GangError when none is)."""
        from raydeploy.gang.bringup import GangError

        for g in self.state()["gangs"]:
            if g.get("state") == "ready":
                return self.gang(g["gang"])
        raise GangError("no gang is ready", phase="serve")
