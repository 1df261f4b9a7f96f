"""The step loop, and the in-process runner over it (`raydeploy generate`, tests and benchmarks).

`StepLoop` is the one loop that drives a scheduler: `plan = next_plan()` -> `run(plan)` -> `on_result(plan,
result)`, with every scheduler call under one lock. The gang's coordinator (raydeploy.gang.coordinator) runs it
with `run` = the dispatcher's broadcast to every host; `LocalRunner` runs it with `run` = one engine's step in
this process. It runs either in a background thread (`start`/`stop`) or in the caller's thread
(`step_once`, `run_until_idle`).

A step that raises, three cases (docs/gang.md, "A step that fails for one request"):
- `RequestFailed` (raydeploy.engine.request): the engine found, before any device work, that some rows of the
  plan cannot run. The scheduler fails just those requests (non-retriable, naming each) and plans the others
  again (`Scheduler.step_failed`); the loop goes on. On a gang every host raised it at the same point of the
  same plan, so the hosts are still in lockstep.
- a host failure (`host_failure(e)`, the owner's test: on a gang, jax's runtime error from a collective or the
  coordination service): every request ends with an "error" event, retriable as the owner says, and the loop
  stops; the exception is kept in `.error`.
- anything else cannot be followed to one request: the requests of that step end with a non-retriable error
  (they are not sent again: another gang would fail them alike), the rest as for a host failure, and the loop
  stops, since the engine (and a gang's followers) may be part-way through the step.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from raydeploy.engine.interfaces import StepEngine, StepScheduler
from raydeploy.engine.request import GenerationRequest, RequestFailed, TokenEvent
from raydeploy.engine.step import StepPlan, StepResult

__all__ = ["GenerationOutput", "LocalRunner", "RequestStream", "StepEngine", "StepLoop"]

FAIL_LOCK_WAIT_S = 5.0
"""How long failing every request waits for the scheduler's lock (a step stuck in a collective holds none)."""


class StepLoop:
    """One scheduler, one `run(plan) -> result`, one thread (or the caller's)."""

    def __init__(self, scheduler: StepScheduler, run: Callable[[StepPlan], StepResult], *, idle_wait_s: float,
                 failure: str, retriable: bool, name: str = "raydeploy-step-loop",
                 host_failure: Callable[[BaseException], bool] | None = None) -> None:
        self.scheduler = scheduler
        self.run = run
        self.idle_wait_s = idle_wait_s
        self.failure = failure
        """What every request's error event says when a step raises (the exception follows)."""
        self.retriable = retriable
        self.host_failure = host_failure or (lambda e: False)
        """Whether a step's exception is a failure of the hosts (every request retriable as the owner says) rather
        than one the step raised for its requests (those are not retried)."""
        self.name = name
        self.steps_failed = 0
        """Steps undone because the engine raised `RequestFailed` (the loop went on)."""
        self.lock = threading.Lock()
        """Held around every scheduler call; the owner takes it too for submit, abort and stats."""
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step_once(self) -> bool:
        """Run one plan if there is one; False when idle. A step that raises `RequestFailed` naming requests of
        the plan fails those and returns True; any other failing step fails every request and re-raises."""
        with self.lock:
            plan = self.scheduler.next_plan()
        if plan is None:
            return False
        try:
            result = self.run(plan)
        except RequestFailed as e:
            with self.lock:
                undone = self.scheduler.step_failed(plan, e)
            if undone:
                self.steps_failed += 1
                return True
            self._fail(plan, e)
            raise
        except Exception as e:
            self._fail(plan, e)
            raise
        with self.lock:
            self.scheduler.on_result(plan, result)
        return True

    def _fail(self, plan: StepPlan, e: Exception) -> None:
        """A step raised and the loop stops: see the module docstring for who gets which error."""
        self.error = e
        if not self.host_failure(e):
            with self.lock:
                self.scheduler.fail_step(plan, f"the step raised {type(e).__name__}: {e} (not attributable to one "
                                               f"request of the step, so none of them is run again)")
        self.fail_all(f"{self.failure}: {type(e).__name__}: {e}", self.retriable)

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
                    self.scheduler.wait_for_work(self.idle_wait_s)  # wakes on submit/abort
            except Exception:  # in self.error and reported to every request; the trace goes to the log
                traceback.print_exc()
                return

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def request_stop(self) -> None:
        """Ask the loop to stop after the current step (returns at once)."""
        self._stop.set()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop after the current step; TimeoutError if the thread does not end within `timeout_s`."""
        self._stop.set()
        self.join(timeout_s)
        if self._thread is not None and self._thread.is_alive():
            raise TimeoutError(f"{self.name} did not stop within {timeout_s} s")
        self._thread = None

    def join(self, timeout_s: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def fail_all(self, error: str, retriable: bool) -> None:
        """End every queued and running request with an error event and stop the loop. The lock is taken with
        a bound: a step stuck in a collective must never keep the requests from being failed."""
        got = self.lock.acquire(timeout=FAIL_LOCK_WAIT_S)
        try:
            self.scheduler.fail_all(error, retriable)
        finally:
            if got:
                self.lock.release()
        self._stop.set()


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
    """One engine, one scheduler, one `StepLoop` in this process."""

    def __init__(self, engine: StepEngine, scheduler: StepScheduler, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.loop = StepLoop(scheduler, engine.step, idle_wait_s=idle_wait_s, failure="engine step failed",
                             retriable=False, name="raydeploy-engine-loop")

    @property
    def error(self) -> BaseException | None:
        return self.loop.error

    # -- driving
    def step_once(self) -> bool:
        """Run one plan if there is one; False when idle."""
        return self.loop.step_once()

    def run_until_idle(self, max_steps: int = 1_000_000) -> int:
        """Step in this thread until nothing is queued or running; returns the number of steps."""
        return self.loop.run_until_idle(max_steps)

    def start(self) -> LocalRunner:
        self.loop.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.loop.stop(timeout_s)

    # -- requests
    def submit(self, req: GenerationRequest) -> RequestStream:
        stream = RequestStream(req.request_id)
        with self.loop.lock:
            self.scheduler.submit(req, stream.put)
        return stream

    def generate(self, requests: Sequence[GenerationRequest], timeout_s: float = 600.0) -> list[GenerationOutput]:
        """Run requests to completion (in the loop thread if started, else in this thread)."""
        streams = [self.submit(r) for r in requests]
        if not self.loop.alive():
            self.run_until_idle()
        return [s.result(timeout_s) for s in streams]
