"""The HTTP layer's one view of the gang: state, a token stream per request, abort, stats.

This is the only serve module that knows the gang's actor names and methods: the supervisor actor
("raydeploy-supervisor" in namespace "raydeploy") reports the gang state and hands out the rank-0
coordinator while the gang is ready; the coordinator streams `TokenEvent` lists for a
`GenerationRequest` (a Ray streaming generator), aborts requests and reports stats. Every call is bounded
by a timeout. Gang failures become `ServiceUnavailable` (503, retriable); a full queue becomes
`Overloaded` (503 with Retry-After). Remote errors are matched by their class, imported from the gang
and engine modules that define them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from raydeploy.engine.request import GenerationRequest, TokenEvent
from raydeploy.engine.scheduler import QueueFullError
from raydeploy.gang.bringup import GangError
from raydeploy.gang.coordinator import GangUnavailableError
from raydeploy.gang.fingerprint import FingerprintMismatchError
from raydeploy.gang.placement import PlacementError
from raydeploy.serve.errors import Overloaded, ServiceUnavailable

log = logging.getLogger("raydeploy.serve")

SUPERVISOR_NAME = "raydeploy-supervisor"
NAMESPACE = "raydeploy"
READY = "ready"
GANG_ERRORS: tuple[type[BaseException], ...] = (GangUnavailableError, GangError, PlacementError,
                                                FingerprintMismatchError)
"""Errors the gang raises when it cannot serve right now (503, retriable). These modules import no JAX, so
the ingress stays JAX-free (tests/test_serve_http.py checks)."""


class Backend(Protocol):
    """What the HTTP layer needs from whatever generates tokens."""

    async def state(self) -> dict[str, Any]:
        """{"state": starting|loading|compiling|ready|restarting|failed, "restarts", "last_error", ...}"""
        ...

    def generate(self, req: GenerationRequest) -> AsyncIterator[list[TokenEvent]]:
        """Token events of one request, in order; the last carries finish_reason."""
        ...

    async def abort(self, request_id: str) -> bool: ...

    async def stats(self) -> dict[str, Any]:
        """The coordinator's figures (queue depth, slots in use, steps, ...); {} when not ready."""
        ...

    async def status(self) -> dict[str, Any]:
        """The gang's full status (hosts, devices, mesh, memory, load and start-up times)."""
        ...


def _raised(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    """Whether `exc`, or the error a remote actor raised inside it (`RayTaskError.cause`), is one of `kinds`.

    Ray re-raises a remote exception as a class derived from both `RayTaskError` and the original class, and
    keeps the original as `.cause`; either is matched by type."""
    return isinstance(exc, kinds) or isinstance(getattr(exc, "cause", None), kinds)


def _is_queue_full(exc: BaseException) -> bool:
    return _raised(exc, (QueueFullError,))


def _is_gang_failure(exc: BaseException) -> bool:
    import ray.exceptions as rex

    if isinstance(exc, (rex.RayActorError, rex.ActorUnavailableError, rex.ObjectLostError,
                        rex.WorkerCrashedError, rex.GetTimeoutError)):
        return True
    # the coordinator refuses work while the gang is not serving; bring-up, placement and fingerprint
    # failures reach here from the supervisor while it rebuilds the gang
    return _raised(exc, GANG_ERRORS)


class GangBackend:
    """`Backend` over the supervisor and the rank-0 coordinator actor.

    The coordinator handle is cached while the gang stays ready and dropped on any actor failure, so a
    restart is picked up on the next request.
    """

    def __init__(self, rpc_timeout_s: float = 10.0, retry_after_s: float = 5.0,
                 state_cache_s: float = 0.25) -> None:
        self.rpc_timeout_s = rpc_timeout_s
        self.retry_after_s = retry_after_s
        self._state_cache_s = state_cache_s
        self._supervisor: Any = None
        self._coordinator: Any = None
        self._state: dict[str, Any] | None = None
        self._state_at = 0.0

    # -- handles -------------------------------------------------------------------------------------
    def _get_supervisor(self) -> Any:
        import ray

        if self._supervisor is None:
            try:
                self._supervisor = ray.get_actor(SUPERVISOR_NAME, namespace=NAMESPACE)
            except ValueError:
                raise ServiceUnavailable("the gang supervisor is not running", self.retry_after_s) from None
        return self._supervisor

    async def _call(self, ref: Any) -> Any:
        return await asyncio.wait_for(ref, timeout=self.rpc_timeout_s)

    async def state(self) -> dict[str, Any]:
        now = time.monotonic()
        if self._state is not None and now - self._state_at < self._state_cache_s:
            return self._state
        try:
            st = await self._call(self._get_supervisor().get_state.remote())
        except ServiceUnavailable:
            return {"state": "starting", "restarts": 0, "last_error": "supervisor not running"}
        except TimeoutError:
            return {"state": "unknown", "restarts": None, "last_error": "supervisor did not answer in time"}
        except Exception as e:  # the supervisor itself died: state unknown until it is back
            if not _is_gang_failure(e):
                raise
            self._supervisor = None
            return {"state": "unknown", "restarts": None, "last_error": "supervisor unreachable"}
        self._state, self._state_at = dict(st), now
        if st.get("state") != READY:
            self._coordinator = None
        return self._state

    async def _get_coordinator(self) -> Any:
        st = await self.state()
        if st.get("state") != READY:
            raise self._unavailable(st)
        if self._coordinator is None:
            coord = await self._call(self._get_supervisor().get_coordinator.remote())
            if coord is None:
                self._state = None
                raise self._unavailable(await self.state())
            self._coordinator = coord
        return self._coordinator

    def _unavailable(self, st: dict[str, Any]) -> ServiceUnavailable:
        state = st.get("state", "unknown")
        if state == "failed":
            return ServiceUnavailable("the model gang has failed and is not restarting; see /status", None)
        return ServiceUnavailable(f"the model gang is {state}; retry shortly", self.retry_after_s)

    def _lost(self, exc: BaseException) -> ServiceUnavailable:
        self._coordinator = None
        self._state = None
        log.warning("gang call failed: %s", type(exc).__name__)
        return ServiceUnavailable("the model gang failed during the request and is restarting; retry shortly",
                                  self.retry_after_s)

    # -- requests ------------------------------------------------------------------------------------
    async def generate(self, req: GenerationRequest) -> AsyncIterator[list[TokenEvent]]:
        coord = await self._get_coordinator()
        try:
            gen = coord.generate.options(num_returns="streaming").remote(req)
        except Exception as e:
            if _is_gang_failure(e):
                raise self._lost(e) from None
            raise
        try:
            async for ref in gen:
                try:
                    events = await ref
                except Exception as e:
                    if _is_queue_full(e):
                        raise Overloaded("the request queue is full; retry shortly") from None
                    if _is_gang_failure(e):
                        raise self._lost(e) from None
                    raise
                yield list(events)
        finally:
            # Dropping the generator cancels the actor-side stream if it is still running.
            del gen

    async def abort(self, request_id: str) -> bool:
        coord = self._coordinator
        if coord is None:
            return False
        try:
            return bool(await self._call(coord.abort.remote(request_id)))
        except Exception as e:
            if _is_gang_failure(e) or isinstance(e, (TimeoutError, asyncio.TimeoutError)):
                self._coordinator = None
                return False
            raise

    async def stats(self) -> dict[str, Any]:
        try:
            coord = await self._get_coordinator()
            return dict(await self._call(coord.stats.remote()))
        except ServiceUnavailable:
            return {}
        except Exception as e:
            if _is_gang_failure(e) or isinstance(e, (TimeoutError, asyncio.TimeoutError)):
                self._coordinator = None
                return {}
            raise

    async def status(self) -> dict[str, Any]:
        try:
            return dict(await self._call(self._get_supervisor().get_status.remote()))
        except ServiceUnavailable:
            return {"state": "starting"}
        except Exception as e:
            if _is_gang_failure(e) or isinstance(e, (TimeoutError, asyncio.TimeoutError)):
                return {"state": "unknown", "last_error": "supervisor unreachable"}
            raise
