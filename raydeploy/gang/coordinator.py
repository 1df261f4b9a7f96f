"""The coordinator inside rank 0: the scheduler, the step loop, and the entry points the HTTP layer calls.

One thread runs the step loop (raydeploy.engine.local.StepLoop, the same loop as the in-process runner) with
`run` = the dispatcher, which broadcasts each plan so every host runs the same step.
Requests arrive on the host actor's event loop (`submit`/`abort`), never blocking the loop thread; token
events go back through a thread-safe sink. Two ways out:
- a feed (`submit` + `feed`): one stream per caller carries the events of every request that caller submitted
  to it, a step's events of all of them in one message (raydeploy.gang.feed is the caller's side). Each Ray
  stream item costs both ends CPU, and rank 0's is the gang's critical path: 16 streams would pay it 16 times
  a step;
- `generate`: one stream per request (tests and tools that want one request's events alone), a feed of one.
The scheduler is only ever touched under one lock.

Failures (docs/gang.md, "A step that fails for one request"): only a host's failure makes a request retriable.
- A step whose engine raised `RequestFailed` (checked before any device work, on every host alike) fails the
  requests it names with a non-retriable error event, and the loop goes on: no gang failure, no restart.
- A host failure (`is_host_failure`: jax's runtime error, from a collective whose peer is gone or from the
  coordination service; an OS-level connection error), or the supervisor declaring the gang failed: every
  in-flight request gets a retriable error event, the loop stops, the gang is rebuilt.
- Any other exception from a step cannot be followed to one request: the requests of that step get a
  non-retriable error event (not resent), and since the followers may be part-way through the step, the
  loop stops and the gang is rebuilt (its queued requests, which no step had started, are retriable).
After the loop stops, new requests are refused with :class:`GangUnavailableError`.

LoRA adapters (docs/lora.md): the coordinator owns the adapter table (`raydeploy.lora.slots.AdapterTable`). A
request naming an adapter is resolved at submit: the adapter is pinned (loaded first, into a free or the least
recently used idle slot, if it is known but not resident) and the request carries its slot and prefix-cache key;
its last event unpins it. Loads and unloads go through the dispatcher to every host between two steps, one at a
time (`_adapter_lock`); a request for an adapter the table does not know gets an error event naming it
(`adapter_unknown`, HTTP 404), a bad adapter file an `AdapterError` naming the tensor (HTTP 400).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from raydeploy.engine.interfaces import StepScheduler
from raydeploy.engine.local import StepLoop
from raydeploy.engine.request import GenerationRequest, TokenEvent
from raydeploy.engine.step import StepPlan, StepResult
from raydeploy.gang.dispatch import Dispatcher
from raydeploy.lora.commands import AdapterCommand
from raydeploy.lora.slots import AdapterConflict, AdapterSlotsBusy, AdapterTable, Residence, UnknownAdapter

ADAPTER_WAIT_S = 60.0
"""Longest an adapter load waits: for the step in flight to end, or for a slot whose requests are all done."""
ADAPTER_UNKNOWN = "adapter_unknown"
"""The `error` prefix of the event that ends a request naming an adapter the gang does not know (HTTP 404)."""


class GangUnavailableError(RuntimeError):
    """The gang cannot take requests now (restarting or failed); retry later if `retriable`."""

    def __init__(self, message: str, retriable: bool = True) -> None:
        super().__init__(message)
        self.retriable = retriable

    def __reduce__(self):
        return (GangUnavailableError, (str(self), self.retriable))


def is_host_failure(e: BaseException) -> bool:
    """Whether a step's exception is a failure of the hosts rather than of its requests: jax's runtime error (a
    collective whose peer died, the coordination service, a device) or an OS-level error (a connection reset).
    Matched by type, never by message text."""
    from raydeploy.compat import jax_runtime_error

    return isinstance(e, (jax_runtime_error(), OSError))


class _Feed:
    """The events of the requests one caller submitted, held until its `feed` stream takes them: `put` from any
    thread, `take` on the actor's event loop. A step's events wake the stream once, not once per event."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.events: deque[TokenEvent] = deque()
        self.wake = asyncio.Event()
        self.waking = False
        self.requests: set[str] = set()
        """Requests submitted to this feed whose last event it has not yet sent."""
        self.closed = False

    def put(self, ev: TokenEvent) -> None:
        self.events.append(ev)
        if not self.waking:
            self.waking = True
            self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self.waking = False  # before the stream takes: an event put after this schedules another wake
        self.wake.set()

    async def take(self) -> list[TokenEvent]:
        await self.wake.wait()
        self.wake.clear()
        out: list[TokenEvent] = []
        while self.events:
            out.append(self.events.popleft())
        return out


class Coordinator:
    """Owns the scheduler and drives the dispatcher from one thread."""

    def __init__(self, scheduler: StepScheduler, dispatcher: Dispatcher, idle_wait_s: float = 0.1,
                 adapters: AdapterTable | None = None) -> None:
        self.scheduler = scheduler
        self.adapters = adapters
        """The LoRA adapter table (None: the engine has no adapter slots)."""
        self._adapter_lock: asyncio.Lock | None = None
        self.dispatcher = dispatcher
        self.idle_wait_s = idle_wait_s
        self.loop = StepLoop(scheduler, self._step, idle_wait_s=idle_wait_s,
                             failure="gang failure, retry: coordinator step loop failed", retriable=True,
                             name="raydeploy-coordinator", host_failure=is_host_failure)
        self._lock = self.loop.lock
        self._failed: str | None = None
        self.started_s = time.monotonic()
        self.tokens_generated = 0
        self.requests_done = 0
        self.requests_submitted = 0
        self.open_streams = 0
        """Requests whose last event is not yet sent (fail_all waits for them to deliver it)."""
        self._feeds: dict[str, _Feed] = {}

    # -- the loop thread ------------------------------------------------------------------------------
    def _step(self, plan: StepPlan) -> StepResult:
        """One plan through the dispatcher (broadcast, then run here); the loop never sends a shutdown plan."""
        result = self.dispatcher.run(plan)
        if result is None:
            raise RuntimeError(f"the dispatcher returned no result for step {plan.step_id}")
        return result

    @property
    def error(self) -> str | None:
        """Why the gang stopped taking requests: the supervisor's verdict or the loop's failure; None while well."""
        if self._failed is not None:
            return self._failed
        e = self.loop.error
        return None if e is None else f"{self.loop.failure}: {type(e).__name__}: {e}"

    def start(self) -> None:
        self.loop.start()

    def join(self, timeout_s: float | None = None) -> None:
        self.loop.join(timeout_s)

    def alive(self) -> bool:
        return self.loop.alive()

    def stop(self) -> None:
        """Stop after the current step and broadcast a shutdown plan so followers leave their loops."""
        self.loop.request_stop()
        self.join(timeout_s=30.0)
        if self.error is None:
            self.dispatcher.publish(StepPlan(step_id=-1, shutdown=True))

    # -- the actor's event loop -------------------------------------------------------------------------
    async def generate(self, req: GenerationRequest) -> AsyncIterator[list[TokenEvent]]:
        """Submit and yield lists of TokenEvents as steps produce them, ending with the finishing event: a feed of
        this one request."""
        name = f"request-{req.request_id}"
        await self.submit(req, name)
        events = self.feed(name)
        try:
            async for batch in events:
                yield batch
                if any(ev.finish_reason is not None for ev in batch):
                    return
        finally:
            await events.aclose()  # a caller gone before the end (disconnect, cancel) frees the slot here

    def _feed(self, name: str) -> _Feed:
        feed = self._feeds.get(name)
        if feed is None:
            feed = self._feeds[name] = _Feed(asyncio.get_running_loop())
        return feed

    async def submit(self, req: GenerationRequest, feed: str) -> None:
        """Start `req`; its events go out on the stream `feed(feed)` (opened before or after this call). Raises
        QueueFullError when the queue is full, GangUnavailableError when the gang cannot take requests."""
        if self.error is not None:
            raise GangUnavailableError(f"gang is unavailable: {self.error}")
        # the adapter first: loading it on demand waits, and the caller may open feed `feed` meanwhile, so the
        # feed is looked up only after that wait (a feed made before it would replace the caller's unread)
        res = None if req.adapter is None else await self._pin_adapter(req)
        f = self._feeds.get(feed) or _Feed(asyncio.get_running_loop())
        sink = f.put
        if isinstance(res, str):  # an error event naming the adapter ends the request
            self._feeds[feed] = f
            f.requests.add(req.request_id)
            self.open_streams += 1
            f.put(TokenEvent(req.request_id, None, finish_reason="error", invalid=True, error=res))
            return
        if res is not None:
            req = dataclasses.replace(req, adapter_slot=res.slot, adapter_key=res.key)
            sink = self._unpinning(f.put, res)
        try:
            with self._lock:
                self.scheduler.submit(req, sink)  # QueueFullError propagates to the caller
                self.requests_submitted += 1
        except BaseException:
            if req.adapter is not None and self.adapters is not None:
                self.adapters.unpin(req.adapter, req.adapter_key)
            raise
        self._feeds[feed] = f  # only now: a refused request leaves no feed behind
        f.requests.add(req.request_id)
        self.open_streams += 1

    # -- LoRA adapters (raydeploy.lora) ------------------------------------------------------------------
    def _table(self) -> AdapterTable:
        if self.adapters is None:
            raise AdapterConflict("this server serves no LoRA adapters (lora.max_adapters is 0)")
        return self.adapters

    def _lock_adapters(self) -> asyncio.Lock:
        if self._adapter_lock is None:
            self._adapter_lock = asyncio.Lock()
        return self._adapter_lock

    async def _pin_adapter(self, req: GenerationRequest) -> Residence | str:
        """The residence of the request's adapter, pinned (loaded first if it is known but not resident), or the
        error that ends the request (unknown adapter, LoRA off)."""
        name = str(req.adapter)
        try:
            table = self._table()
            res = table.pin(name)
            if res is None:
                async with self._lock_adapters():
                    res = table.pin(name)
                    if res is None:
                        await self._make_resident(name)
                        res = table.pin(name)
            if res is None:
                raise UnknownAdapter(name)
            return res
        except (UnknownAdapter, AdapterConflict) as e:
            return f"{ADAPTER_UNKNOWN}: {e}"

    def _unpinning(self, put: Any, res: Residence) -> Any:
        """The request's sink, unpinning its adapter with its last event."""
        table = self._table()

        def sink(ev: TokenEvent) -> None:
            if ev.finish_reason is not None:
                table.unpin(res.name, res.key)
            put(ev)
        return sink

    async def _command(self, cmd: AdapterCommand) -> dict[str, Any]:
        """One adapter command through the dispatcher (every host, between two steps), off the event loop."""
        return await asyncio.to_thread(self.dispatcher.command, cmd, ADAPTER_WAIT_S)

    async def _make_resident(self, name: str) -> Residence:
        """Load known adapter `name` into a slot (free, or the least recently used idle one; waits at most
        `ADAPTER_WAIT_S` while every slot is in use). Call under `_adapter_lock`."""
        table = self._table()
        deadline = time.monotonic() + ADAPTER_WAIT_S
        while True:
            try:
                slot, _ = table.place(name)
                break
            except AdapterSlotsBusy:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        try:
            await self._command(AdapterCommand("load", slot, table.paths[name]))
        except BaseException:
            table.abandon(slot)
            raise
        return table.loaded(name, slot)

    async def load_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Know adapter `name` at `path` and load it on every host (`POST /v1/load_lora_adapter`); AdapterError
        naming the file or tensor when it cannot be served (then it stays unknown), AdapterConflict when the name
        is known already."""
        table = self._table()
        async with self._lock_adapters():
            table.register(name, path)
            try:
                res = await self._make_resident(name)
            except BaseException:
                table.forget(name)
                raise
        return {"name": name, "slot": res.slot}

    async def restore_adapters(self, adapters: dict[str, str]) -> dict[str, str]:
        """Know `adapters` (name -> path: those loaded over HTTP before this gang restarted) at once, so requests
        naming them find them, then load each while slots are free (the others load on demand). Returns the ones
        that could not be loaded again, with why; they are forgotten (a bad or vanished file fails no gang)."""
        table = self._table()
        for name, path in adapters.items():
            table.register(name, path)
        failed: dict[str, str] = {}
        for name in adapters:
            async with self._lock_adapters():
                try:
                    if len(table.resident) < table.slots:
                        await self._make_resident(name)
                except Exception as e:  # noqa: BLE001 - reported and forgotten; the gang serves on
                    failed[name] = str(e)
                    table.forget(name)
        return failed

    async def unload_adapter(self, name: str) -> None:
        """Forget adapter `name` and clear its slot on every host (`POST /v1/unload_lora_adapter`);
        UnknownAdapter when not known, AdapterConflict while running requests use it."""
        table = self._table()
        async with self._lock_adapters():
            slot = table.forget(name)
            if slot is not None:
                await self._command(AdapterCommand("unload", slot))

    def adapter_names(self) -> list[str]:
        """The known adapters (/v1/models); empty without LoRA."""
        return [] if self.adapters is None else self.adapters.names()

    async def feed(self, name: str) -> AsyncGenerator[list[TokenEvent], None]:
        """The events of every request submitted to feed `name`, as the steps produce them: one list a wake-up
        (a step's events of all those requests). When the caller goes away, its unfinished requests are aborted."""
        f = self._feed(name)
        try:
            while not f.closed:
                batch = await f.take()
                if not batch:
                    continue
                for ev in batch:
                    if ev.token_id is not None:
                        self.tokens_generated += 1
                    if ev.finish_reason is not None and ev.request_id in f.requests:
                        f.requests.discard(ev.request_id)
                        self.open_streams -= 1
                        self.requests_done += 1
                yield batch
        finally:
            self._feeds.pop(name, None)
            if f.requests:
                with self._lock:
                    for rid in f.requests:
                        self.scheduler.abort(rid)
                self.open_streams -= len(f.requests)

    def close_feed(self, name: str) -> None:
        """End feed `name`'s stream (its caller is done with it); its unfinished requests are aborted."""
        f = self._feeds.get(name)
        if f is not None:
            f.closed = True
            f.wake.set()

    def abort(self, request_id: str) -> bool:
        with self._lock:
            found = bool(self.scheduler.abort(request_id))
        return found

    def fail_all(self, error: str, retriable: bool = True) -> None:
        """End every in-flight request with an error event; refuse new ones from now on."""
        self._failed = self.error or error
        self.loop.fail_all(error, retriable)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            sched = dict(self.scheduler.stats())
        clock = self.dispatcher.clock.snapshot()
        if self.adapters is not None:
            sched["adapters"] = self.adapters.stats()
        return {"tokens_generated": self.tokens_generated, **sched, **clock,
                "requests_submitted": self.requests_submitted, "requests_done": self.requests_done,
                "steps_failed": self.loop.steps_failed,
                "uptime_s": round(time.monotonic() - self.started_s, 1), "error": self.error}
