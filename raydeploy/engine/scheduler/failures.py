"""The scheduler's failures: every request ended at once when the gang fails or shuts down (`fail_all`), and a
step that failed for one request (`step_failed`: undone, the others planned again as they were) or for none that
can be named (`fail_step`). See the package's docstring (`raydeploy.engine.scheduler`) and docs/gang.md, "A step
that fails for one request". A mixin of `Scheduler` (`planner`) over its state, under its lock; no JAX here."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from raydeploy.engine.pages import PagePool
from raydeploy.engine.request import RequestFailed, TokenEvent
from raydeploy.engine.scheduler.pacing import Pacing
from raydeploy.engine.scheduler.records import Queued, Running, Sink
from raydeploy.engine.step import StepPlan


class Failures:
    """`Scheduler`'s failure handling; the attributes are the scheduler's (set in `Scheduler.__init__`)."""

    max_slots: int
    pools: list[PagePool]
    pacing: Pacing
    requests_failed: int
    _lock: threading.Lock
    _work: threading.Condition
    _queue: deque[Queued]
    _slots: list[Running | None]
    _release: list[int]
    _inflight: dict[int, list[tuple[int, Running]]]
    _prefilling: list[int]
    _emit: Callable[[list[tuple[Sink, TokenEvent]]], None]

    def fail_all(self, error: str, retriable: bool) -> None:
        """End every queued and running request with an error event (the gang failed, or shut down)."""
        events: list[tuple[Sink, TokenEvent]] = []
        with self._lock:
            while self._queue:
                q = self._queue.popleft()
                events.append((q.sink, TokenEvent(q.req.request_id, None, finish_reason="error", error=error,
                                                  retriable=retriable)))
            for slot, run in enumerate(self._slots):
                if run is not None:
                    events.append((run.sink, TokenEvent(run.req.request_id, None, index=run.generated,
                                                        finish_reason="error", error=error, retriable=retriable)))
                    if run.pages is not None:
                        run.pages.free()
                    self._slots[slot] = None
            # The device cache is gone with the gang or no longer trusted: forget every cached prefix.
            for pool in self.pools:
                pool.clear_cache()
            self._prefilling.clear()
            self.pacing.reset()  # plans that will never report back
            # The engine's slot table is gone with the gang, or it is cleared by these releases.
            self._release = [s for s in range(self.max_slots)]
            self._inflight.clear()
            self._work.notify_all()
        self._emit(events)


    def step_failed(self, plan: StepPlan, failure: RequestFailed) -> bool:
        """Undo `plan`, whose engine raised `failure` before any device work: the requests it names (by plan row or
        id) end with a non-retriable error; every other request of the plan is planned again as it was, and the
        plan's releases go out again (the engine may or may not have applied them: a release, like a whole
        page-table row, is idempotent). The prefix cache stays: no device page was written. Returns whether
        `failure` names a request of the plan (if not, nothing was undone: the caller must treat the failure as
        one it cannot attribute, or the same plan would fail again)."""
        events: list[tuple[Sink, TokenEvent]] = []
        named = set(failure.slots)
        ids = set(failure.request_ids)
        with self._lock:
            if not self._names_a_request(plan, named, ids):
                return False
            self.pacing.forget(plan.step_id)
            self._release = list(dict.fromkeys([*plan.release, *self._release]))
            entries = self._inflight.pop(plan.step_id)
            for seq, (slot, run) in zip(plan.seqs, entries, strict=True):
                if self._slots[slot] is not run:
                    continue  # aborted while the step ran
                if slot in named or run.req.request_id in ids:
                    events.append((run.sink, self._fail_one(slot, plan, failure)))
                    continue
                run.resend_row = True
                if seq.sampling is not None:  # its first chunk never reached the engine: send it as first again
                    run.started = False
            self._release = list(dict.fromkeys(self._release))
            self._work.notify_all()
        self._emit(events)
        return True

    def _names_a_request(self, plan: StepPlan, slots: set[int], ids: set[str]) -> bool:
        """Under the lock: whether a row of `plan` is in `slots`, or its request (unless aborted since) in `ids`."""
        rows = [(slot, run.req.request_id) for slot, run in self._inflight.get(plan.step_id, [])]
        return any(slot in slots or rid in ids for slot, rid in rows)

    def fail_step(self, plan: StepPlan, error: str) -> None:
        """End every request of `plan` with a non-retriable error: its step raised and the failure could not be
        followed to one request, so none of them is sent again (another gang would fail it alike)."""
        events: list[tuple[Sink, TokenEvent]] = []
        with self._lock:
            self.pacing.forget(plan.step_id)
            slots = [slot for slot, run in self._inflight.pop(plan.step_id, []) if self._slots[slot] is run]
            for slot in slots:
                run = self._slots[slot]
                assert run is not None
                events.append((run.sink, self._fail_one(slot, plan, RequestFailed(error))))
            self._release = list(dict.fromkeys(self._release))
            self._work.notify_all()
        self._emit(events)

    def _fail_one(self, slot: int, plan: StepPlan, failure: RequestFailed) -> TokenEvent:
        """Under the lock: end the request in `slot` with a non-retriable error naming it and the step. Its pages go
        back uncached (what the failed step would have written is not there)."""
        run = self._slots[slot]
        assert run is not None
        self._slots[slot] = None
        self._release.append(slot)
        if run.pages is not None:
            run.pages.free()
        if slot in self._prefilling:
            self._prefilling.remove(slot)
        self.requests_failed += 1
        rid = run.req.request_id
        why = failure.message.removeprefix(f"request {rid}: ")
        return TokenEvent(rid, None, index=run.generated, finish_reason="error", retriable=False,
                          invalid=failure.invalid, error=f"request {rid} failed in step {plan.step_id}: {why}")
