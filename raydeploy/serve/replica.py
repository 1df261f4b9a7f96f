"""One Ray Serve replica, one gang: the deployment Serve routes generation requests to and autoscales.

Serve reserves each replica a placement group of its own from `placement_group_bundles` (one bundle per host
of the gang, the way Ray Serve LLM reserves a vLLM engine's workers); the replica actor itself (no CPU, no
JAX) sits in bundle 0 beside host 0. The replica starts a gang supervisor named after itself
(raydeploy.gang.directory.gang_name) that puts host `rank` in bundle `rank` of that group, watches the gang
and rebuilds it in the same group after a failure. The supervisor is owned by the replica: when Serve stops
the replica (downscaling, after its requests have finished; or a replacement) the gang goes with it and
Serve removes the group.

How the replica tells Serve about its gang:
- `record_routing_stats` reports `{"ready": ...}` every `replicas.routing_stats_period_s`; the router
  (raydeploy.serve.routing) sends new requests only to replicas whose gang is ready, so a gang that is
  being rebuilt gets none.
- `check_health` fails once the gang has failed for good (its restarts spent): Serve then replaces the
  replica, which starts a fresh gang.
- `max_ongoing_requests` is the gang's slot count: Serve's router holds further requests in its queue
  (`max_queued_requests`) and answers 503 beyond it (raydeploy.serve.deployment).

A request the gang could not start (the gang is not ready, or failed before the first token) ends with one
retriable error event without tokens, and the ingress sends it again, to another replica: at no cost when the
gang never took it (`refused`: not ready, or refused at submit), at most once when the gang broke while holding
it (raydeploy.serve.backend). A request the engine failed on its own (a non-retriable error event) is passed on
as it is, never resent.

Every request the replica sends its gang travels on one feed (raydeploy.gang.feed): rank 0 sends each step's tokens
of all of them as one stream item, and the replica hands them to each request's Serve stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from raydeploy.config import Config
from raydeploy.engine.request import GenerationRequest, TokenEvent
from raydeploy.engine.scheduler import QueueFullError

if TYPE_CHECKING:
    from raydeploy.gang.engines import EngineSource

log = logging.getLogger("raydeploy.serve")

STATE_CACHE_S = 0.2


class GangReplica:
    """The Serve deployment class (bound with options by raydeploy.serve.deployment.gang_deployment)."""

    # Serve awaits an async constructor (the supervisor's start is awaited, not blocked on)
    async def __init__(self, cfg: Config, checkpoint_path: str | None,  # type: ignore[misc]
                       engine: str | EngineSource = "real", ready_timeout_s: float | None = None) -> None:
        from ray import serve
        from ray.util import get_current_placement_group

        from raydeploy.gang.directory import gang_name
        from raydeploy.gang.feed import Feeds
        from raydeploy.gang.gang import create_supervisor
        from raydeploy.gang.placement import pins_tpu_slice

        ctx = serve.get_replica_context()
        self.cfg = cfg
        self.name = gang_name(ctx.app_name, ctx.replica_id.unique_id)
        # a TPU slice is pinned by the supervisor itself (the slice is known only once its head is held)
        pg = None if pins_tpu_slice(cfg.cluster) else get_current_placement_group()
        self.supervisor = create_supervisor(cfg, name=self.name, engine=engine, checkpoint_path=checkpoint_path,
                                            placement_group=pg)
        self.rpc_timeout_s = min(cfg.cluster.rpc_timeout_s, 30.0)
        await asyncio.wait_for(_await(self.supervisor.start.remote()), self.rpc_timeout_s)
        self._state: dict[str, Any] = {"state": "starting"}
        self._state_at = -1e9
        self._coordinator: Any = None
        self._coordinator_generation: int | None = None
        self._feeds = Feeds()  # one token stream from rank 0 for all of this replica's requests
        log.info("gang replica %s started (placement group %s)", self.name, "Serve's" if pg else "its own")
        if ready_timeout_s is not None:  # RayService: the application turns RUNNING only with a ready gang
            await self._wait_ready(ready_timeout_s)

    async def _wait_ready(self, timeout_s: float) -> None:
        from raydeploy.gang.bringup import GangError

        deadline = time.monotonic() + timeout_s
        while (st := await self.state())["state"] != "ready":
            if st["state"] in ("failed", "stopped"):
                raise GangError(f"gang {st['state']}: {st.get('last_error')}", phase="bring-up", retriable=False)
            if time.monotonic() > deadline:
                raise GangError(f"gang not ready within {timeout_s:g}s (state {st['state']})", phase="bring-up")
            await asyncio.sleep(1.0)

    async def state(self) -> dict[str, Any]:
        """The supervisor's state, cached for a moment (every request reads it)."""
        now = time.monotonic()
        if now - self._state_at >= STATE_CACHE_S:
            self._state = dict(await asyncio.wait_for(_await(self.supervisor.get_state.remote()), self.rpc_timeout_s))
            self._state_at = now
        return self._state

    async def _coordinator_handle(self) -> Any:
        st = await self.state()
        if st["state"] != "ready":
            return None
        if self._coordinator is None or self._coordinator_generation != st["generation"]:
            self._coordinator = await asyncio.wait_for(_await(self.supervisor.get_coordinator.remote()),
                                                       self.rpc_timeout_s)
            self._coordinator_generation = st["generation"]
        return self._coordinator

    # -- Serve's calls -------------------------------------------------------------------------------
    async def generate(self, req: GenerationRequest) -> AsyncIterator[list[TokenEvent]]:
        """Token events of `req` from this replica's gang (a streaming call); a gang failure ends the stream
        with one retriable error event (without tokens when the gang never started the request)."""
        from raydeploy.serve.backend import GANG_ERRORS, _raised, is_gang_failure, is_queue_full

        coord = await self._coordinator_handle()
        if coord is None:
            yield [_refusal(req, f"gang {self.name} is {self._state.get('state')}", refused=True)]
            return
        n_tokens = 0
        stream = self._feeds.stream(coord, req)
        try:
            async for batch in stream:
                n_tokens += sum(ev.token_id is not None for ev in batch)
                yield batch
        except Exception as e:
            if is_queue_full(e):
                raise QueueFullError(getattr(_cause(e), "queue_depth", 0), getattr(_cause(e), "max_queue", 0)) from None
            if not is_gang_failure(e):
                raise
            self._state_at = -1e9  # read the state afresh: the gang is breaking
            # a gang error before any token (GangUnavailableError at submit): the gang never took the request
            refused = n_tokens == 0 and _raised(e, GANG_ERRORS)
            yield [_refusal(req, f"gang {self.name} failed: {type(_cause(e)).__name__}", index=n_tokens,
                            refused=refused)]
        finally:
            await stream.aclose()  # now: a request the caller left (client gone, timeout) is aborted at rank 0

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the router reads: whether this replica's gang can take requests now."""
        try:
            st = await self.state()
        except Exception:  # noqa: BLE001 - a supervisor that does not answer has no ready gang
            return {"ready": False}
        return {"ready": st.get("state") == "ready", "state": st.get("state")}

    async def check_health(self) -> None:
        """Fails when the gang has failed for good, so that Serve replaces this replica (and its gang)."""
        self._state_at = -1e9
        st = await self.state()
        if st.get("state") in ("failed", "stopped"):
            raise RuntimeError(f"gang {self.name} {st['state']}: {st.get('last_error')}")

    def __del__(self) -> None:
        """Serve stops the replica (its requests have drained): ask the supervisor to take the gang down. Not
        waited for: the supervisor and its hosts are owned by this replica and end with it in any case."""
        supervisor = getattr(self, "supervisor", None)
        if supervisor is None:  # the constructor failed before the gang started
            return
        try:
            supervisor.shutdown.remote()
        except Exception as e:  # noqa: BLE001 - Ray may already be gone (process exit)
            log.warning("gang %s shutdown: %s", getattr(self, "name", "?"), type(e).__name__)


def _refusal(req: GenerationRequest, why: str, index: int = 0, refused: bool = False) -> TokenEvent:
    return TokenEvent(req.request_id, None, index=index, finish_reason="error", retriable=True, refused=refused,
                      error=f"gang failure, retry: {why}")


def _cause(e: BaseException) -> BaseException:
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


async def _await(ref: Any) -> Any:
    return await ref
