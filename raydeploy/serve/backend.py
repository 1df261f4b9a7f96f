"""The HTTP layer's one view of the gangs: their state, a token stream per request, stats and status.

Generation requests go through a Ray Serve DeploymentHandle to the gang replicas (raydeploy.serve.replica):
Serve's router sends each to a replica whose gang is ready, with a free slot (raydeploy.serve.routing), and
holds the admitted rest until a slot frees (admission is ServingCore's, and the queues below it are sized to
hold what it admits). A full queue below it all the same (Serve's BackPressureError, or a gang's QueueFullError:
a slot freed by a client that left is given back to the gang a moment after Serve counts it free) is a request
no gang took: it is sent again like the refusals below, and only after FAILOVER_ATTEMPTS full queues is it
answered as `Overloaded`, 503 with Retry-After.
State, status and stats come from every gang's supervisor (raydeploy.gang.directory): `/ready` is 200 while at
least one gang is ready.

Failover: a request the gang could not start (its gang is not ready, or broke before the first token: one
retriable error event without tokens, or the replica died) is sent again through the handle, with a short
backoff, so it lands on a healthy gang while the broken one is rebuilt; the client never sees it. Only a gang's
failure makes a request retriable, and how often it is resent depends on what happened to it:
- a gang that never took it (not ready, refused at submit: the event says `refused`): sent again, up to
  FAILOVER_ATTEMPTS tries in all;
- a gang that broke while holding it (a host died, the replica died): sent again once; a request that was in
  MAX_GANG_FAILURES gangs that broke is not sent to another (500 naming the request: it may be what breaks them);
- an error of the request's own (a non-retriable error event: the engine failed that request, or refused it
  at submit with `RequestFailed`): never sent again; a 400 when its content is at fault (a token id past the
  vocabulary), else a 500 naming the request (raydeploy.serve.generation).
A request that already streamed tokens ends with a retriable error (503, or an error event in the SSE
stream). Remote errors are matched by their class, imported from the modules that define them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from raydeploy.engine.request import GenerationRequest, RequestFailed, TokenEvent
from raydeploy.engine.scheduler import QueueFullError
from raydeploy.gang.bringup import GangError
from raydeploy.gang.coordinator import GangUnavailableError
from raydeploy.gang.fingerprint import FingerprintMismatchError
from raydeploy.gang.placement import PlacementError
from raydeploy.serve.errors import InvalidRequest, Overloaded, RequestFailedError, ServiceUnavailable

log = logging.getLogger("raydeploy.serve")

READY = "ready"
GANG_ERRORS: tuple[type[BaseException], ...] = (GangUnavailableError, GangError, PlacementError,
                                                FingerprintMismatchError)
"""Errors the gang raises when it cannot serve right now (503, retriable). These modules import no JAX, so
the ingress stays JAX-free (tests/test_serve_http.py checks)."""
FAILOVER_ATTEMPTS = 6
"""Tries per request that no gang started (the first plus resubmissions to other replicas)."""
MAX_GANG_FAILURES = 2
"""Gangs that may break while holding one request; after that many it is not sent to another."""
FAILOVER_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 2.0)
"""Waits between those tries: a broken gang's replica stops getting requests within one routing-stats period."""


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


def is_queue_full(exc: BaseException) -> bool:
    """A gang's own queue was full, or Serve's router queue (`max_queued_requests`) was."""
    from ray.serve.exceptions import BackPressureError

    return _raised(exc, (QueueFullError, BackPressureError))


def is_gang_failure(exc: BaseException) -> bool:
    """A gang, its coordinator or its replica failed or cannot serve now (retriable)."""
    import ray.exceptions as rex

    if isinstance(exc, (rex.RayActorError, rex.ActorUnavailableError, rex.ObjectLostError,
                        rex.WorkerCrashedError, rex.GetTimeoutError)):
        return True
    # the coordinator refuses work while the gang is not serving; bring-up, placement and fingerprint
    # failures reach here from the supervisor while it rebuilds the gang
    return _raised(exc, GANG_ERRORS)


def _cancel(gen: Any) -> None:
    """End the replica's stream (which frees the gang slot); a request that was never assigned to a replica
    (refused by the router) has nothing to cancel and re-raises its refusal here, which is already handled."""
    try:
        gen.cancel()
    except Exception as e:  # noqa: BLE001 - see above: the refusal was answered where it was raised
        log.debug("cancel of a request that never reached a replica: %s", type(e).__name__)


def request_error(exc: BaseException, request_id: str) -> InvalidRequest | RequestFailedError | None:
    """The HTTP error for a request refused at submit for its own content (`RequestFailed`), or None."""
    if not _raised(exc, (RequestFailed,)):
        return None
    cause = getattr(exc, "cause", None)
    failed = cause if isinstance(cause, RequestFailed) else exc
    assert isinstance(failed, RequestFailed)
    if failed.invalid:
        return InvalidRequest(failed.message, code="invalid_value")
    log.error("request %s refused by the gang: %s", request_id, failed.message)
    return RequestFailedError(f"request {request_id} failed in the model engine and was not retried; the "
                              f"details are in the server log", code="request_failed")


def _refused(events: list[TokenEvent]) -> bool:
    """A retriable error before any token: the gang never started the request, so another gang may."""
    return any(ev.finish_reason == "error" and ev.retriable for ev in events) and \
        not any(ev.token_id is not None for ev in events)


class ReplicaBackend:
    """`Backend` over the gang replicas: requests through a Serve DeploymentHandle, state from the supervisors."""

    def __init__(self, handle: Any, directory: Any, retry_after_s: float = 5.0) -> None:
        self.handle = handle
        self.directory = directory
        self.retry_after_s = retry_after_s
        self.failovers = 0
        """Requests resubmitted to another gang because theirs could not start them."""
        self.abandoned = 0
        """Requests not sent to another gang after MAX_GANG_FAILURES gangs broke while holding them."""

    async def state(self) -> dict[str, Any]:
        try:
            return dict(await self.directory.state())
        except TimeoutError:
            return {"state": "unknown", "restarts": None, "ready_gangs": 0, "last_error": "gangs did not answer in time"}

    def _unavailable(self, st: dict[str, Any]) -> ServiceUnavailable:
        state = st.get("state", "unknown")
        if state == "failed":
            return ServiceUnavailable("every model gang has failed; see /status", None)
        return ServiceUnavailable(f"no model gang is ready (state {state}); retry shortly", self.retry_after_s)

    def _lost(self) -> ServiceUnavailable:
        return ServiceUnavailable("the model gang failed during the request and is restarting; retry shortly",
                                  self.retry_after_s)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[list[TokenEvent]]:
        st = await self.state()
        if not st.get("ready_gangs"):
            raise self._unavailable(st)
        broken = 0  # gangs that broke while holding this request
        full = 0  # tries a full queue below the ingress refused
        for attempt in range(FAILOVER_ATTEMPTS):
            if broken >= MAX_GANG_FAILURES:
                self.abandoned += 1
                raise self._abandoned(req, broken)
            if attempt:
                self.failovers += 1
                await asyncio.sleep(FAILOVER_BACKOFF_S[min(attempt - 1, len(FAILOVER_BACKOFF_S) - 1)])
                st = await self.state()
                if not st.get("ready_gangs"):
                    raise self._unavailable(st)
            streamed, refused, ended = False, False, False
            gen = self.handle.options(stream=True).generate.remote(req)
            try:
                async for events in gen:
                    events = list(events)
                    if not streamed and _refused(events):
                        refused = True
                        if not any(ev.refused for ev in events):
                            broken += 1
                        log.info("request %s: %s; sending it to another gang", req.request_id,
                                 next((ev.error for ev in events if ev.error), "refused"))
                        break
                    streamed = streamed or any(ev.token_id is not None for ev in events)
                    ended = any(ev.finish_reason is not None for ev in events)
                    yield events
                if not refused:
                    return
            except Exception as e:
                if is_queue_full(e) and not streamed:  # see the module docstring: tried again, then a 503
                    full += 1
                    log.info("request %s: a queue below the ingress is full; trying again", req.request_id)
                    continue
                if is_queue_full(e):
                    raise Overloaded("every gang is busy and the request queue is full; retry shortly") from None
                if (refusal := request_error(e, req.request_id)) is not None:
                    raise refusal from None
                if not is_gang_failure(e):
                    raise
                log.warning("request %s: gang call failed: %s", req.request_id, type(e).__name__)
                if streamed:
                    raise self._lost() from None
                if not _raised(e, GANG_ERRORS):  # the replica or the gang died with the request in it
                    broken += 1
            finally:
                if not ended:
                    _cancel(gen)
        if broken >= MAX_GANG_FAILURES:
            self.abandoned += 1
            raise self._abandoned(req, broken)
        if full == FAILOVER_ATTEMPTS:
            raise Overloaded("every gang is busy and the request queue is full; retry shortly")
        raise ServiceUnavailable(f"no gang could start the request after {FAILOVER_ATTEMPTS} tries; retry shortly",
                                 self.retry_after_s)

    @staticmethod
    def _abandoned(req: GenerationRequest, broken: int) -> RequestFailedError:
        return RequestFailedError(f"request {req.request_id} was in {broken} model gangs that each failed while "
                                  f"running it; it is not sent to another", code="request_failed")

    async def abort(self, request_id: str) -> bool:
        """Nothing to do: closing the stream cancels the request on its replica, which frees its slot."""
        return False

    async def stats(self) -> dict[str, Any]:
        try:
            return dict(await self.directory.stats())
        except TimeoutError:
            return {}

    async def status(self) -> dict[str, Any]:
        try:
            return dict(await self.directory.status())
        except TimeoutError:
            return {"state": "unknown", "last_error": "gangs did not answer in time", "gangs": []}
