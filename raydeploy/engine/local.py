"""Drive an `Engine` with a `Scheduler` in one process: for `raydeploy generate`, tests and benchmarks.

The loop is the same one the gang's coordinator runs on rank 0, minus the fan-out to other hosts:
`next_plan` -> `engine.step` -> `on_result`. It runs either in a background thread (`start`/`stop`, with
`submit` returning a stream of events) or in the caller's thread (`run_until_idle`). A step that raises fails
every request (their sinks get an "error" event) and stops the loop; the exception is kept in `.error`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from raydeploy.engine.request import GenerationRequest, TokenEvent
from raydeploy.engine.scheduler import Scheduler
from raydeploy.engine.step import StepPlan, StepResult


class StepEngine(Protocol):
    def step(self, plan: StepPlan) -> StepResult: ...


@dataclass
class GenerationOutput:
    """Everything one request produced."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    first_token_s: float | None = None
    """Seconds from submit to the first event."""
    total_s: float | None = None

    def add(self, ev: TokenEvent, elapsed_s: float) -> None:
        if self.first_token_s is None:
            self.first_token_s = elapsed_s
        if ev.token_id is not None:
            self.token_ids.append(ev.token_id)
            self.logprobs.append(ev.logprob if ev.logprob is not None else float("nan"))
        if ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason
            self.error = ev.error
            self.total_s = elapsed_s


class RequestStream:
    """The events of one request, in order; iterate, or `result(timeout_s)` to collect them all."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._q: queue.Queue[tuple[TokenEvent, float]] = queue.Queue()
        self._t0 = time.perf_counter()
        self.output = GenerationOutput(request_id)

    def put(self, ev: TokenEvent) -> None:
        """The scheduler's sink: timestamps each event as it is produced."""
        self._q.put((ev, time.perf_counter() - self._t0))

    def events(self, timeout_s: float) -> Iterator[TokenEvent]:
        """Yield events until the final one; raises TimeoutError if none arrives within timeout_s."""
        while True:
            try:
                ev, elapsed_s = self._q.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"request {self.request_id}: no token within {timeout_s} s") from None
            self.output.add(ev, elapsed_s)
            yield ev
            if ev.finish_reason is not None:
                return

    def result(self, timeout_s: float) -> GenerationOutput:
        for _ in self.events(timeout_s):
            pass
        return self.output


class LocalRunner:
    """One engine, one scheduler, one loop."""

    def __init__(self, engine: StepEngine, scheduler: Scheduler, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.idle_wait_s = idle_wait_s
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- driving
    def step_once(self) -> bool:
        """Run one plan if there is one; False when idle."""
        plan = self.scheduler.next_plan()
        if plan is None:
            return False
        try:
            result = self.engine.step(plan)
        except Exception as e:
            self.error = e
            self.scheduler.fail_all(f"engine step failed: {type(e).__name__}: {e}", retriable=False)
            raise
        self.scheduler.on_result(plan, result)
        return True

    def run_until_idle(self, max_steps: int = 1_000_000) -> int:
        """Step in this thread until nothing is queued or running; returns the number of steps."""
        n = 0
        while n < max_steps and self.step_once():
            n += 1
        return n

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.step_once():
                    self.scheduler.wait_for_work(self.idle_wait_s)
            except Exception:  # already recorded in self.error and reported to every request
                return

    def start(self) -> LocalRunner:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="raydeploy-engine-loop", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"engine loop did not stop within {timeout_s} s")
            self._thread = None

    # -- requests
    def submit(self, req: GenerationRequest) -> RequestStream:
        stream = RequestStream(req.request_id)
        self.scheduler.submit(req, stream.put)
        return stream

    def generate(self, requests: Sequence[GenerationRequest], timeout_s: float = 600.0) -> list[GenerationOutput]:
        """Run requests to completion (in the loop thread if started, else in this thread)."""
        streams = [self.submit(r) for r in requests]
        if self._thread is None:
            self.run_until_idle()
        return [s.result(timeout_s) for s in streams]
