"""The two seams of the step loop, as Protocols: what drives the devices (`StepEngine`) and what decides each
step (`StepScheduler`).

The real ones are raydeploy.engine.engine.Engine and raydeploy.engine.scheduler.Scheduler; the stand-in
engine and scheduler of raydeploy.testing.toy, and test doubles, satisfy the same Protocols. The in-process
runner (raydeploy.engine.local) and the gang's coordinator (raydeploy.gang.coordinator) take these, never a
concrete class. No JAX here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from raydeploy.engine.geometry import EngineGeometry
from raydeploy.engine.request import GenerationRequest, RequestFailed, TokenEvent
from raydeploy.engine.step import StepPlan, StepResult

Sink = Callable[[TokenEvent], None]
"""Where a scheduler delivers one request's events, one at a time; called outside the scheduler's lock and must
not block."""


class StepEngine(Protocol):
    """What a host calls of its engine: compile its programs, run one plan on the devices (on every host, in the
    same order) and return what it sampled, describe its geometry and report its status."""

    def step(self, plan: StepPlan) -> StepResult: ...

    def warmup(self, threads: int = 1) -> Mapping[str, Any]:
        """Compile (or load) every program the engine will run, before the first plan; what it did, by name."""
        ...

    @property
    def geometry(self) -> EngineGeometry | None:
        """Slots, pages and step sizes (`raydeploy.engine.geometry`); None for an engine without KV pages (the
        stand-in of raydeploy.testing.toy)."""
        ...

    def status(self) -> dict[str, Any]:
        """What the host's status reports of the engine (the real one: `matmul`, `kv_dtype`, `programs` by
        source, `program_sources`); {} when there is nothing to say."""
        ...


class StepScheduler(Protocol):
    """Requests in, plans out, results back into per-request events."""

    def submit(self, req: GenerationRequest, sink: Sink) -> None:
        """Queue a request (raises QueueFullError when its queue is full, RequestFailed when it can never run here:
        the real scheduler also compiles a constrained request's grammar here, outside its lock)."""
        ...

    def abort(self, request_id: str) -> bool: ...

    def next_plan(self) -> StepPlan | None:
        """The next step's plan, or None when there is nothing to do."""
        ...

    def on_result(self, plan: StepPlan, result: StepResult) -> None: ...

    def fail_all(self, error: str, retriable: bool) -> None:
        """End every queued and running request with an error event."""
        ...

    def step_failed(self, plan: StepPlan, failure: RequestFailed) -> bool:
        """The engine raised `failure` for `plan` before any device work: fail the requests it names
        (non-retriable), plan the plan's other requests again; False (nothing done) if it names none of them."""
        ...

    def fail_step(self, plan: StepPlan, error: str) -> None:
        """End every request of `plan` with a non-retriable error (its step failed for a reason no one request
        can be blamed for)."""
        ...

    def wait_for_work(self, timeout_s: float) -> bool:
        """Block (at most `timeout_s`) until a submit or abort may have made a plan possible."""
        ...

    def stats(self) -> dict[str, Any]: ...
