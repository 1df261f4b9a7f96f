"""The caller's side of rank 0's token streams: `stream_events` (one stream a request) and `Feed` (one stream a
caller, split back into one a request).

A caller that keeps many requests in flight on a gang (a Serve replica, `raydeploy predict`) opens one `Feed` on
the coordinator and starts each request with `Feed.stream(req)`: rank 0 then sends each step's events of all of
them as one Ray stream item instead of one item a request, which costs rank 0 (the gang's critical path) and the
caller CPU per item. `Feeds` keeps one feed per coordinator, so a restarted gang (a new coordinator) gets a new
one; close it when done, which aborts what is still running there.

Either way a coordinator that dies mid-stream becomes one final retriable error event, so callers handle one
failure shape; refusals at the start (a full queue, a gang that is not ready) are raised as before.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from raydeploy.engine.request import GenerationRequest, TokenEvent

log = logging.getLogger("raydeploy.gang")

CLOSE_TIMEOUT_S = 10.0
"""How long `Feed.close` waits for rank 0 to end the stream."""

_END = object()  # put in every open request's queue when the feed's stream ends


def _died(req: GenerationRequest, index: int, why: str) -> TokenEvent:
    return TokenEvent(req.request_id, None, index=index, finish_reason="error", retriable=True,
                      error=f"gang failure, retry: {why}")


async def stream_events(coordinator: Any, req: GenerationRequest) -> AsyncIterator[list[TokenEvent]]:
    """Lists of TokenEvents of `req` from rank 0 on a stream of its own; a dead coordinator becomes one final
    retriable error event."""
    import ray

    last_index = -1
    try:
        async for ref in coordinator.generate.remote(req):
            batch = await ref
            if batch:
                last_index = batch[-1].index
            yield batch
    except ray.exceptions.RayActorError as e:
        yield [_died(req, last_index + 1, f"the coordinator host died ({type(e).__name__})")]


class Feed:
    """One stream from rank 0 carrying the events of every request started through it, handed out per request.

    Must be created, used and closed on one event loop."""

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator
        self.name = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self.ended: str | None = None
        """Why the stream ended (None while it runs): every request still open then ends with an error event."""
        # An empty context: the feed is first opened inside some request's task, and Ray cancels a cancelled
        # task's children recursively, so a client that hangs up on that first request would end the feed of
        # every request of this replica (Ray's long-poll client does the same, ray-project/ray#52476).
        self._task = asyncio.get_running_loop().create_task(self._pump(), context=contextvars.Context())

    async def _pump(self) -> None:
        import ray

        why = "the coordinator closed the feed"
        try:
            async for ref in self.coordinator.feed.remote(self.name):
                for ev in await ref:
                    q = self.queues.get(ev.request_id)
                    if q is not None:
                        q.put_nowait(ev)
        except ray.exceptions.RayActorError as e:
            why = f"the coordinator host died ({type(e).__name__})"
        except asyncio.CancelledError:
            why = "the feed was closed"
            raise
        except Exception as e:  # noqa: BLE001 - whatever broke the stream ends its requests, retriably
            why = f"the feed from the coordinator failed ({type(e).__name__}: {e})"
            log.warning("feed %s: %s", self.name, why)
        finally:
            self.ended = why
            for q in self.queues.values():
                q.put_nowait(_END)

    async def stream(self, req: GenerationRequest) -> AsyncGenerator[list[TokenEvent], None]:
        """Start `req` and yield lists of its TokenEvents as rank 0 sends them, ending with the finishing event.
        A request left before its end (the caller stopped reading) is aborted at rank 0."""
        import ray

        q: asyncio.Queue[Any] = asyncio.Queue()
        self.queues[req.request_id] = q
        last_index, started, finished = -1, False, False
        try:
            if self.ended is None:
                try:
                    await self.coordinator.submit.remote(req, self.name)  # a refusal is raised here
                except ray.exceptions.RayActorError as e:
                    finished = True
                    yield [_died(req, 0, f"the coordinator host died ({type(e).__name__})")]
                    return
                started = True
            while True:
                if self.ended is not None and q.empty():
                    finished = True
                    yield [_died(req, last_index + 1, self.ended)]
                    return
                item = await q.get()
                batch: list[TokenEvent] = []
                while item is not _END:
                    batch.append(item)
                    if q.empty():
                        break
                    item = q.get_nowait()
                if batch:
                    last_index = batch[-1].index
                    finished = any(ev.finish_reason is not None for ev in batch)
                    yield batch
                    if finished:
                        return
                if item is _END:
                    finished = True
                    yield [_died(req, last_index + 1, self.ended or "the feed ended")]
                    return
        finally:
            self.queues.pop(req.request_id, None)
            if started and not finished and self.ended is None:  # the caller went away: free the slot now
                try:
                    self.coordinator.abort.remote(req.request_id)
                except Exception as e:  # noqa: BLE001 - the gang may be gone; its slots with it
                    log.warning("abort of %s failed: %s", req.request_id, type(e).__name__)

    async def close(self) -> None:
        """End the stream at rank 0 (which aborts this feed's unfinished requests) and here. Bounded."""
        if self.ended is None:
            try:
                await asyncio.wait_for(_await(self.coordinator.close_feed.remote(self.name)), CLOSE_TIMEOUT_S)
                await asyncio.wait_for(asyncio.shield(self._task), CLOSE_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - a dead or stuck coordinator: stop reading regardless
                log.debug("feed %s close: %s", self.name, type(e).__name__)
        self._task.cancel()


class Feeds:
    """A caller's feeds, one per coordinator: a gang that restarts has a new coordinator, and gets a new feed."""

    def __init__(self) -> None:
        self._feeds: dict[Any, Feed] = {}

    def get(self, coordinator: Any) -> Feed:
        key = coordinator  # actor handles of one actor are equal and hash alike
        feed = self._feeds.get(key)
        if feed is None or feed.ended is not None:
            self._feeds = {k: f for k, f in self._feeds.items() if f.ended is None}  # forget the dead
            feed = self._feeds[key] = Feed(coordinator)
        return feed

    def stream(self, coordinator: Any, req: GenerationRequest) -> AsyncGenerator[list[TokenEvent], None]:
        return self.get(coordinator).stream(req)

    async def close(self) -> None:
        feeds, self._feeds = list(self._feeds.values()), {}
        await asyncio.gather(*(f.close() for f in feeds))


async def _await(ref: Any) -> Any:
    return await ref
