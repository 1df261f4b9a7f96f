"""Continuous batching, host-agnostic: requests -> slots -> `StepPlan`s, and `StepResult`s -> `TokenEvent`s.

No JAX here. The local runner and the gang's coordinator (on rank 0) both drive the same loop:

    plan = scheduler.next_plan()        # None when idle
    result = <every host runs Engine.step(plan)>
    scheduler.on_result(plan, result)   # emits TokenEvents to each request's sink, frees finished slots

New requests join free slots between decode steps. A request's events: one per generated token
(`token_id` set, `index` 0, 1, ...); the last event carries `finish_reason`:
- "length": max_tokens or max_seq_len reached; that event still carries the last token.
- "stop": an eos / stop token was sampled; that event has `token_id=None` (stop tokens are not output).
- "abort" (after `abort`) and "error" (after `fail_all`, with `error` and `retriable`): `token_id=None`.
`submit`, `abort` and `fail_all` may be called from other threads; sinks are called outside the lock and must
not block (put into a queue).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from raydeploy.engine.request import FinishReason, GenerationRequest, TokenEvent
from raydeploy.engine.step import PrefillItem, StepPlan, StepResult

if TYPE_CHECKING:
    from raydeploy.config import Config

Sink = Callable[[TokenEvent], None]


class QueueFullError(RuntimeError):
    """The wait queue is full; the client should retry later (HTTP 503 + Retry-After)."""

    def __init__(self, queue_depth: int, max_queue: int) -> None:
        super().__init__(f"queue is full: {queue_depth} requests waiting (max_queue={max_queue}); retry later")
        self.queue_depth = queue_depth
        self.max_queue = max_queue

    def __reduce__(self):  # pickles across Ray intact
        return (QueueFullError, (self.queue_depth, self.max_queue))


@dataclass
class _Running:
    req: GenerationRequest
    sink: Sink
    prompt_len: int
    submitted_s: float
    generated: int = 0
    first_token_s: float | None = None
    stop_ids: frozenset[int] = field(default_factory=frozenset)


class Scheduler:
    """Queue + slot table. Thread-safe; the step loop itself (next_plan/on_result) runs in one thread."""

    def __init__(self, max_slots: int, max_seq_len: int, eos_ids: Sequence[int], max_queue: int,
                 prefill_buckets: Sequence[int], clock: Callable[[], float] = time.monotonic,
                 max_prefills_per_step: int | None = None, slot_order: Sequence[int] | None = None,
                 decode_steps: int = 1) -> None:
        self.max_slots = max_slots
        self.slot_order = list(range(max_slots)) if slot_order is None else [int(s) for s in slot_order]
        if sorted(self.slot_order) != list(range(max_slots)):
            raise ValueError(f"slot_order must list each of the {max_slots} slots once, got {self.slot_order}")
        self.max_seq_len = max_seq_len
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.max_queue = max_queue
        self.buckets = sorted({min(b, max_seq_len) for b in prefill_buckets})
        self.max_prompt_len = min(self.buckets[-1], max_seq_len - 1) if self.buckets else max_seq_len - 1
        self.clock = clock
        self.max_prefills_per_step = max_prefills_per_step or max_slots
        self.decode_steps = decode_steps
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: deque[tuple[GenerationRequest, Sink, float]] = deque()
        self._slots: list[_Running | None] = [None] * max_slots
        self._release: list[int] = []
        self._inflight: dict[int, tuple[list[int], list[int]]] = {}  # step_id -> (prefill slots, decode slots)
        self._step_id = 0
        # counters
        self.steps = 0
        self.tokens_generated = 0
        self.prefills = 0
        self.ttft_s: deque[float] = deque(maxlen=256)
        """Recent times from submit to first token (seconds), for metrics."""

    @classmethod
    def for_engine(cls, engine: Any, cfg: Config, clock: Callable[[], float] = time.monotonic) -> Scheduler:
        """A scheduler sized for `engine` (max_slots, max_seq_len, eos ids, the order to fill slots in) with the
        config's queue and buckets."""
        return cls(engine.max_slots, engine.max_seq_len, engine.eos_ids, cfg.serving.max_queue,
                   cfg.engine.prefill_buckets, clock=clock, slot_order=engine.slot_order,
                   decode_steps=cfg.engine.decode_steps)

    def stats(self) -> dict[str, Any]:
        """Counters for metrics and /status."""
        ttft = sorted(self.ttft_s)
        return {"queue_depth": self.queue_depth, "slots_in_use": self.slots_in_use, "max_slots": self.max_slots,
                "steps": self.steps, "tokens_generated": self.tokens_generated, "prefills": self.prefills,
                "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None}

    # -- counters
    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def slots_in_use(self) -> int:
        return sum(r is not None for r in self._slots)

    def idle(self) -> bool:
        with self._lock:
            return not self._queue and self.slots_in_use == 0 and not self._release

    # -- requests
    def validate(self, req: GenerationRequest) -> None:
        """Raise ValueError saying what is wrong with a request that can never run."""
        n = len(req.prompt_token_ids)
        if n == 0:
            raise ValueError(f"request {req.request_id}: prompt is empty (prompt_token_ids has no tokens)")
        if n > self.max_prompt_len:
            raise ValueError(f"request {req.request_id}: prompt has {n} tokens, more than the {self.max_prompt_len} "
                             f"this engine accepts (max_seq_len {self.max_seq_len}, largest prefill bucket "
                             f"{self.buckets[-1] if self.buckets else 'none'}, at least one token must be generated)")
        if req.max_tokens < 1:
            raise ValueError(f"request {req.request_id}: max_tokens must be >= 1, found {req.max_tokens}")

    def submit(self, req: GenerationRequest, sink: Sink) -> None:
        """Queue a request; raises ValueError (never fits) or QueueFullError (try later)."""
        self.validate(req)
        with self._lock:
            if len(self._queue) >= self.max_queue:
                raise QueueFullError(len(self._queue), self.max_queue)
            self._queue.append((req, sink, self.clock()))
            self._work.notify_all()

    def abort(self, request_id: str) -> bool:
        """Stop a queued or running request (its sink gets a final "abort" event); False if unknown."""
        events: list[tuple[Sink, TokenEvent]] = []
        with self._lock:
            for i, (req, sink, _) in enumerate(self._queue):
                if req.request_id == request_id:
                    del self._queue[i]
                    events.append((sink, TokenEvent(request_id, None, index=0, finish_reason="abort")))
                    break
            else:
                for slot, run in enumerate(self._slots):
                    if run is not None and run.req.request_id == request_id:
                        events.append((run.sink, self._finish(slot, "abort")))
                        break
            self._work.notify_all()
        self._emit(events)
        return bool(events)

    def fail_all(self, error: str, retriable: bool) -> None:
        """End every queued and running request with an error event (the gang failed, or shut down)."""
        events: list[tuple[Sink, TokenEvent]] = []
        with self._lock:
            while self._queue:
                req, sink, _ = self._queue.popleft()
                events.append((sink, TokenEvent(req.request_id, None, finish_reason="error", error=error,
                                                retriable=retriable)))
            for slot, run in enumerate(self._slots):
                if run is not None:
                    events.append((run.sink, TokenEvent(run.req.request_id, None, index=run.generated,
                                                        finish_reason="error", error=error, retriable=retriable)))
                    self._slots[slot] = None
            # The engine's slot table is gone with the gang, or it is cleared by these releases.
            self._release = [s for s in range(self.max_slots)]
            self._inflight.clear()
            self._work.notify_all()
        self._emit(events)

    def wait_for_work(self, timeout_s: float) -> bool:
        """Block until there may be a plan to run (or timeout); True if there is work."""
        with self._lock:
            if self._queue or self.slots_in_use or self._release:
                return True
            self._work.wait(timeout_s)
            return bool(self._queue or self.slots_in_use or self._release)

    # -- the step loop
    def next_plan(self) -> StepPlan | None:
        """The next step: releases, prefills of queued requests into free slots, decode of running slots."""
        with self._lock:
            prefills: list[PrefillItem] = []
            prefill_slots: list[int] = []
            free = [i for i in self.slot_order if self._slots[i] is None]
            while self._queue and free and len(prefills) < self.max_prefills_per_step:
                req, sink, submitted = self._queue.popleft()
                slot = free.pop(0)
                self._slots[slot] = _Running(req, sink, len(req.prompt_token_ids), submitted,
                                             stop_ids=frozenset(req.stop_token_ids)
                                             | (frozenset() if req.ignore_eos else self.eos_ids))
                prefills.append(PrefillItem(slot, np.asarray(req.prompt_token_ids, np.int32), req.sampling))
                prefill_slots.append(slot)
            decode_slots = [i for i, r in enumerate(self._slots) if r is not None]
            release = tuple(self._release)
            self._release = []
            if not prefills and not decode_slots and not release:
                return None
            # A slot whose prefill token already ends it would decode once in vain; that is cheaper than a
            # second plan, and its decode token is dropped in on_result.
            plan = StepPlan(self._step_id, tuple(prefills), decode=bool(decode_slots), release=release,
                            decode_steps=self._decode_steps(bool(prefills), decode_slots))
            self._inflight[plan.step_id] = (prefill_slots, decode_slots)
            self._step_id += 1
            return plan

    def _decode_steps(self, prefilling: bool, decode_slots: list[int]) -> int:
        """Decode steps for the next plan: one while prompts are starting (their first token comes with the
        plan, so a long plan would delay it); otherwise `decode_steps`, but no more than the running requests
        still need and never past any slot's room in max_seq_len."""
        if prefilling or not decode_slots:
            return 1
        runs = [r for r in (self._slots[s] for s in decode_slots) if r is not None]
        # A running request has emitted `generated` tokens; all but the last are in its slot's cache.
        room = min(self.max_seq_len - (r.prompt_len + r.generated - 1) for r in runs)
        wanted = max(r.req.max_tokens - r.generated for r in runs)
        return max(1, min(self.decode_steps, room, wanted))

    def on_result(self, plan: StepPlan, result: StepResult) -> None:
        """Turn a step's tokens into events; finish requests on stop tokens, max_tokens or max_seq_len."""
        events: list[tuple[Sink, TokenEvent]] = []
        now = self.clock()
        with self._lock:
            prefill_slots, decode_slots = self._inflight.pop(plan.step_id, ([], []))
            self.steps += 1
            self.prefills += len(prefill_slots)
            for i, slot in enumerate(prefill_slots):
                run = self._slots[slot]
                if run is not None:
                    run.first_token_s = now
                    self.ttft_s.append(now - run.submitted_s)
                    self._token(slot, int(result.prefill_tokens[i]), float(result.prefill_logprobs[i]), events)
            if plan.decode and result.decode_tokens is not None:
                for k in range(result.decode_tokens.shape[0]):  # tokens after a slot finished are dropped
                    for slot in decode_slots:
                        if self._slots[slot] is not None:
                            lp = (float(result.decode_logprobs[k, slot]) if result.decode_logprobs is not None
                                  else None)
                            self._token(slot, int(result.decode_tokens[k, slot]), lp, events)
            self._work.notify_all()
        self._emit(events)

    # -- internals (lock held)
    def _token(self, slot: int, token: int, logprob: float | None, events: list) -> None:
        run = self._slots[slot]
        assert run is not None
        if token in run.stop_ids:
            events.append((run.sink, self._finish(slot, "stop")))
            return
        run.generated += 1
        self.tokens_generated += 1
        reason: FinishReason | None = None
        if run.generated >= run.req.max_tokens or run.prompt_len + run.generated >= self.max_seq_len:
            reason = "length"
        events.append((run.sink, TokenEvent(run.req.request_id, token, logprob, run.generated - 1, reason)))
        if reason is not None:
            self._slots[slot] = None
            self._release.append(slot)

    def _finish(self, slot: int, reason: FinishReason) -> TokenEvent:
        run = self._slots[slot]
        assert run is not None
        self._slots[slot] = None
        self._release.append(slot)
        return TokenEvent(run.req.request_id, None, index=run.generated, finish_reason=reason)

    @staticmethod
    def _emit(events: list[tuple[Sink, TokenEvent]]) -> None:
        for sink, ev in events:
            sink(ev)

