"""The coordinator inside rank 0: the scheduler, the step loop, and the entry points the HTTP layer calls.

One thread runs the loop `plan = scheduler.next_plan(); result = dispatcher.run(plan);
scheduler.on_result(plan, result)`; the dispatcher broadcasts each plan so every host runs the same step.
Requests arrive on the host actor's event loop (`submit`/`abort`), never blocking the loop thread; token
events go back through a thread-safe sink into an asyncio queue per request. The scheduler is only ever
touched under one lock. If the loop thread dies, or the supervisor declares the gang failed, every
in-flight request gets a final TokenEvent with finish_reason "error" (retriable for gang failures) and
new requests are refused with :class:`GangUnavailableError`.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections.abc import AsyncIterator
from typing import Any

from raydeploy.engine.request import GenerationRequest, TokenEvent
from raydeploy.gang.dispatch import Dispatcher


class GangUnavailableError(RuntimeError):
    """The gang cannot take requests now (restarting or failed); retry later if `retriable`."""

    def __init__(self, message: str, retriable: bool = True) -> None:
        super().__init__(message)
        self.retriable = retriable

    def __reduce__(self):
        return (GangUnavailableError, (str(self), self.retriable))


class Coordinator:
    """Owns the scheduler and drives the dispatcher from one thread."""

    def __init__(self, scheduler: Any, dispatcher: Dispatcher, idle_wait_s: float = 0.1) -> None:
        self.scheduler = scheduler
        self.dispatcher = dispatcher
        self.idle_wait_s = idle_wait_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None
        self.started_s = time.monotonic()
        self.tokens_generated = 0
        self.requests_done = 0
        self.requests_submitted = 0
        self.open_streams = 0
        """`generate` calls not yet finished (fail_all waits for them to deliver their last event)."""

    # -- the loop thread ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="raydeploy-coordinator", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    plan = self.scheduler.next_plan()
                if plan is None:
                    if hasattr(self.scheduler, "wait_for_work"):  # wakes on submit/abort
                        self.scheduler.wait_for_work(self.idle_wait_s)
                    else:
                        self._wake.wait(self.idle_wait_s)
                        self._wake.clear()
                    continue
                result = self.dispatcher.run(plan)
                with self._lock:
                    self.scheduler.on_result(plan, result)
        except Exception as e:  # noqa: BLE001 - the loop must report any failure, then end the gang
            self.error = f"gang failure, retry: coordinator step loop failed: {type(e).__name__}: {e}"
            traceback.print_exc()
            self.fail_all(self.error, retriable=True)
            raise

    def join(self, timeout_s: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop after the current step and broadcast a shutdown plan so followers leave their loops."""
        from raydeploy.engine.step import StepPlan

        self._stop.set()
        self._wake.set()
        self.join(timeout_s=None if self._thread is None else 30.0)
        if self.error is None:
            self.dispatcher.publish(StepPlan(step_id=-1, shutdown=True))

    # -- the actor's event loop -------------------------------------------------------------------------
    async def generate(self, req: GenerationRequest) -> AsyncIterator[list[TokenEvent]]:
        """Submit and yield lists of TokenEvents as steps produce them, ending with the finishing event."""
        if self.error is not None:
            raise GangUnavailableError(f"gang is unavailable: {self.error}")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def sink(events: TokenEvent | list[TokenEvent]) -> None:  # called from the loop thread
            for ev in events if isinstance(events, list | tuple) else [events]:
                loop.call_soon_threadsafe(queue.put_nowait, ev)

        with self._lock:
            self.scheduler.submit(req, sink)  # QueueFullError propagates to the caller
            self.requests_submitted += 1
        self._wake.set()
        finished = False
        self.open_streams += 1
        try:
            while not finished:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                finished = any(ev.finish_reason is not None for ev in batch)
                self.tokens_generated += sum(1 for ev in batch if ev.token_id is not None)
                yield batch
            self.requests_done += 1
        finally:
            self.open_streams -= 1
            if not finished:  # the caller went away (disconnect, cancel): free the slot
                with self._lock:
                    self.scheduler.abort(req.request_id)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            found = bool(self.scheduler.abort(request_id))
        self._wake.set()
        return found

    def fail_all(self, error: str, retriable: bool = True) -> None:
        """End every in-flight request with an error event; refuse new ones from now on."""
        self.error = self.error or error
        # the loop thread may be stuck inside a step holding no lock; take the lock with a bound so a stuck
        # step never blocks failing the requests
        got = self._lock.acquire(timeout=5.0)
        try:
            self.scheduler.fail_all(error, retriable)
        finally:
            if got:
                self._lock.release()
        self._stop.set()
        self._wake.set()

    def stats(self) -> dict[str, Any]:
        sched: dict[str, Any] = {}
        if hasattr(self.scheduler, "stats"):
            with self._lock:
                sched = dict(self.scheduler.stats())
        clock = self.dispatcher.clock.snapshot()
        return {"tokens_generated": self.tokens_generated, **sched, **clock,
                "requests_submitted": self.requests_submitted, "requests_done": self.requests_done,
                "uptime_s": round(time.monotonic() - self.started_s, 1), "error": self.error}
