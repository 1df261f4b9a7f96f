"""Continuous batching, host-agnostic: requests -> slots -> `StepPlan`s, and `StepResult`s -> `TokenEvent`s.

No JAX here. The local runner and the gang's coordinator (on rank 0) both drive the same loop:

    plan = scheduler.next_plan()        # None when idle
    result = <every host runs Engine.step(plan)>
    scheduler.on_result(plan, result)   # emits TokenEvents to each request's sink, frees finished slots

New requests join free slots between decode steps. A request's events: one per generated token
(`token_id` set, `index` 0, 1, ...); the last event carries `finish_reason`:
- "length": max_tokens or max_seq_len reached; that event still carries the last token.
- "stop": an eos / stop token was sampled; that event has `token_id=None` (stop tokens are not output).
- "abort" (after `abort`) and "error" (after `fail_all`, `step_failed` or `fail_step`, with `error` and
  `retriable`): `token_id=None`.
`submit`, `abort` and `fail_all` may be called from other threads; sinks are called outside the lock and must
not block (put into a queue).

One mixed step per plan over the engine's KV pages (`Paging`). Each dp group has a page pool (`raydeploy.engine.pages`); a request gets a slot (a page-table row) in one group and
  is prefilled only there. Every plan carries the decode rows of all running streams plus prompt chunks up to
  the group's token budget (`max_step_tokens`, or the smaller `mixed_step_tokens` while streams decode), in
  arrival order, so a long prompt never stalls running streams and many arriving prompts prefill together.
  A prompt whose full pages are in the group's prefix cache starts after them with those pages shared in
  its table. Admission reserves every page a request may need (prompt + max_tokens within max_seq_len), so a
  running request never runs out of pages: a request waits in the queue (first come, first served) until its
  pages fit, and one that could never fit a whole pool is refused at submit. Page-table changes travel in
  the plan (`StepPlan.pages`), so every host holds the same tables.
See docs/scheduling.md.

Failures (docs/gang.md, "A step that fails for one request"): a request whose prompt holds a token id past the
model's vocabulary (`vocab_size`) is refused at submit with `RequestFailed`. A step whose engine raised
`RequestFailed` before any device work is undone with `step_failed`: the requests it names end with a
non-retriable error, every other request of the step is planned again exactly as it was (its chunk again, its
page-table row whole, its sampling again if that was its first chunk; the step's slot releases again), so it
produces the tokens it would have without the failed one. `fail_step` ends every request of a step the loop
could not attribute (non-retriable: it is not sent again).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from raydeploy.engine.pages import PagePool, SequencePages
from raydeploy.engine.request import FinishReason, GenerationRequest, RequestFailed, TokenEvent
from raydeploy.engine.step import PageUpdate, SeqStep, StepPlan, StepResult

if TYPE_CHECKING:
    from raydeploy.config import Config

Sink = Callable[[TokenEvent], None]

BURST_MAX_PASSES = 8.0
"""Longest burst wait, in decode passes after the first request, while arrivals keep coming within the burst
wait of each other. A request that misses the first step waits a whole step behind it, and then holds up the
step after it; a burst cut in two ends its last stream a step or more later (each arrival costs the serving
path some CPU beside the hosts, so 16 chat streams sent at once by one client reached rank 0 over ~100-300 ms
on the 2-core default: 8-20 one-stream passes)."""
MAX_HOLD_PASSES = 64
"""Most decode passes one decision holds prompt chunks back beside running streams (`Paging.max_decode_slowdown`)."""
DECODE_PASS_WINDOW = 16
"""Decode-only plans whose median pass time is the scheduler's decode pace."""


class QueueFullError(RuntimeError):
    """The wait queue is full; the client should retry later (HTTP 503 + Retry-After)."""

    def __init__(self, queue_depth: int, max_queue: int) -> None:
        super().__init__(f"queue is full: {queue_depth} requests waiting (max_queue={max_queue}); retry later")
        self.queue_depth = queue_depth
        self.max_queue = max_queue

    def __reduce__(self):  # pickles across Ray intact
        return (QueueFullError, (self.queue_depth, self.max_queue))


@dataclass(frozen=True)
class Paging:
    """What the scheduler needs to know about the engine's KV pages and step sizes."""

    page_size: int
    """Tokens per page."""
    pages_per_group: int
    """Pages in each dp group's pool."""
    groups: int
    """dp groups; slot s belongs to group s // (max_slots // groups)."""
    max_step_tokens: int
    """Most tokens one step computes per dp group (prompt chunks plus one per decode row)."""
    prefix_caching: bool = True
    """Reuse cached full pages of matching prompt prefixes."""
    mixed_step_tokens: int | None = None
    """Most tokens per dp group in a step that carries decode rows (the engine's smaller step program), so
    running streams keep a short step while a long prompt is prefilled; None = max_step_tokens."""
    max_decode_slowdown: float = 0.0
    """While streams decode: hold a prompt's next chunk back for as many decode passes as keep their mean time
    per token within this factor of a decode pass, from measured step times (`engine.max_decode_slowdown`);
    0 = a chunk every step."""
    burst_wait: float = 0.0
    """A request that finds the engine idle waits this fraction of a measured decode pass for others arriving
    with it (`engine.burst_wait`); 0 = its step starts at once."""


@dataclass
class _Queued:
    req: GenerationRequest
    sink: Sink
    submitted_s: float
    keys: list[bytes] | None = None
    """the prompt's prefix keys, computed once."""


@dataclass
class _Running:
    req: GenerationRequest
    sink: Sink
    prompt_len: int
    submitted_s: float
    generated: int = 0
    first_token_s: float | None = None
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    pages: SequencePages | None = None
    tokens: list[int] = field(default_factory=list)
    """Prompt and emitted tokens (position i holds tokens[i])."""
    computed: int = 0
    """Positions whose K/V is in the slot's pages: prefill progress, then len(tokens) - 1 while decoding."""
    cap: int = 0
    """Positions this request's reservation covers."""
    started: bool = False
    """Its first chunk was planned (the engine has its sampling parameters)."""
    resend_row: bool = False
    """A step that carried it failed before the engine ran it: its next plan sends its page-table row whole."""


def _halfway(limit: float) -> float:
    """The slowdown factor halfway from none (1) to `limit`: a held pass slower than this pace times it makes the
    next held plan longer, and held passes' median over it becomes the pace (`Scheduler._pace`)."""
    return (1 + limit) / 2


class Scheduler:
    """Queue + slot table + page pools. Thread-safe; the step loop itself
    (next_plan/on_result) runs in one thread."""

    def __init__(self, max_slots: int, max_seq_len: int, eos_ids: Sequence[int], max_queue: int, paging: Paging,
                 clock: Callable[[], float] = time.monotonic, slot_order: Sequence[int] | None = None,
                 decode_steps: int = 1, vocab_size: int | None = None) -> None:
        self.max_slots = max_slots
        self.vocab_size = vocab_size
        """The model's vocabulary: a prompt token id at or past it is refused at submit (None: not checked)."""
        self.slot_order = list(range(max_slots)) if slot_order is None else [int(s) for s in slot_order]
        if sorted(self.slot_order) != list(range(max_slots)):
            raise ValueError(f"slot_order must list each of the {max_slots} slots once, got {self.slot_order}")
        self.max_seq_len = max_seq_len
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.max_queue = max_queue
        self.max_prompt_len = max_seq_len - 1
        self.clock = clock
        self.decode_steps = decode_steps
        self.paging = paging
        self._check_paging(paging)
        self.pools = [PagePool(paging.pages_per_group, paging.page_size, g) for g in range(paging.groups)]
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: deque[_Queued] = deque()
        self._slots: list[_Running | None] = [None] * max_slots
        self._release: list[int] = []
        self._inflight: dict[int, list[tuple[int, _Running]]] = {}  # step_id -> (slot, request) per seq
        self._prefilling: list[int] = []  # paged: slots whose prompt is not fully computed, in arrival order
        self._step_id = 0
        # paged: plans with decode rows while a prompt prefills (an "episode"): when it began, its decode passes
        self._episode_t0: float | None = None
        self._episode_passes = 0
        self._planned_at: dict[int, tuple[float, str, int]] = {}  # step_id -> (clock, kind, passes)
        # kind: "chunk" (prompt chunks beside decode rows), "held" (decode rows between them), "decode" (neither)
        self._recent_passes: deque[float] = deque(maxlen=DECODE_PASS_WINDOW)
        self._held_passes: deque[float] = deque(maxlen=DECODE_PASS_WINDOW)  # this episode's, per pass (`_pace`)
        self.decode_pass_s: float | None = None
        """seconds per decode pass of a decode-only plan of `decode_steps` passes while no prompt
        prefills beside the streams, the median of the last `DECODE_PASS_WINDOW`: the pace `max_decode_slowdown`
        is a factor of (a median, as the plans just before a long prompt's first chunk run slower while its
        request is read and tokenized beside them; a moving average took that in). Passes
        between a prompt's chunks do not count: they run slower than undisturbed ones (measured: 5-10% on CPU,
        caches the chunk step evicted), and counting them let the streams drift past the limit."""
        self.chunk_step_s: float | None = None
        """seconds of the last step that carried prompt chunks beside decode rows."""
        self._chunk_growth_s = 0.0  # how much the last chunk step took over the one before (0 if less)
        self.held_floor = 1
        """the fewest passes a decode-only plan holding a prompt back may have. Every plan costs time
        beyond its passes (gathering inputs, the hosts' round trip, streaming tokens); a plan cut short to end
        where the prompt may go on spreads that over fewer tokens. Where it ran the streams slower per token than
        halfway from their pace to the limit, waiting in such plans makes the wait grow instead of end (measured:
        a 1500-token prompt beside 7 streams waited 140 s in one-pass plans), so the floor rises past it, up to
        `decode_steps`. A plan that runs past the wait is repaid: the episode's account lets the next chunks
        follow one another."""
        # counters
        self.steps = 0
        self.tokens_generated = 0
        self.prefills = 0
        self.prefill_tokens = 0
        """prompt tokens computed (prefix-cache hits excluded)."""
        self.prefix_hit_tokens = 0
        """prompt tokens not computed because their pages were in the prefix cache."""
        self.requests_failed = 0
        """Requests ended by a failure of their own (`step_failed`, `fail_step`), not by a gang failure."""
        self.ttft_s: deque[float] = deque(maxlen=256)
        """Recent times from submit to first token (seconds), for metrics."""

    def _check_paging(self, p: Paging) -> None:
        if p.groups < 1 or self.max_slots % p.groups:
            raise ValueError(f"paging: max_slots {self.max_slots} does not divide over {p.groups} dp groups")
        for name, tokens in (("max_step_tokens", p.max_step_tokens), ("mixed_step_tokens", p.mixed_step_tokens)):
            if tokens is not None and tokens < self.max_slots // p.groups:
                raise ValueError(f"paging: {name}={tokens} tokens per dp group in a step cannot hold a decode row for "
                                 f"each of the group's {self.max_slots // p.groups} slots (engine.prefill_chunk is "
                                 f"too small)")

    @classmethod
    def for_engine(cls, engine: Any, cfg: Config, clock: Callable[[], float] = time.monotonic) -> Scheduler:
        """A scheduler sized for `engine` (max_slots, max_seq_len, eos ids, the order to fill slots in, its pages
        and step sizes) with the config's queue, decode steps and pacing."""
        # a model whose sliding-window layers keep rings cannot reuse a prefix (its window is not in them)
        prefix = cfg.engine.prefix_caching and not engine.window_rings
        paging = Paging(engine.page_size, engine.pages_per_group, engine.groups, engine.max_step_tokens,
                        prefix, engine.mixed_step_tokens, cfg.engine.max_decode_slowdown, cfg.engine.burst_wait)
        return cls(engine.max_slots, engine.max_seq_len, engine.eos_ids, cfg.serving.max_queue, paging, clock=clock,
                   slot_order=engine.slot_order, decode_steps=cfg.engine.decode_steps, vocab_size=engine.vocab_size)

    def stats(self) -> dict[str, Any]:
        """Counters for metrics and /status (with the pages and the prefix cache, summed over the
        dp groups: hits, misses and evictions count pages)."""
        ttft = sorted(self.ttft_s)
        out: dict[str, Any] = {
            "queue_depth": self.queue_depth, "slots_in_use": self.slots_in_use, "max_slots": self.max_slots,
            "steps": self.steps, "tokens_generated": self.tokens_generated, "prefills": self.prefills,
            "requests_failed": self.requests_failed,
            "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None}
        with self._lock:
            for pool in self.pools:
                for k, v in pool.stats().items():
                    out[k] = out.get(k, 0) + v
        out["slots_in_use_per_group"] = self._rows_per_group(self.paging.groups)
        out["prefill_tokens"] = self.prefill_tokens
        out["prefix_hit_tokens"] = self.prefix_hit_tokens
        # the step times the chunk hold-back (max_decode_slowdown) works from
        for name, secs in (("decode_pass_ms", self.decode_pass_s), ("chunk_step_ms", self.chunk_step_s)):
            out[name] = None if secs is None else round(1e3 * secs, 2)
        out["held_floor_passes"] = self.held_floor
        return out

    # -- counters
    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def slots_in_use(self) -> int:
        return sum(r is not None for r in self._slots)

    def _rows_per_group(self, groups: int) -> list[int]:
        """Running requests in each dp group's slots."""
        per_group = self.max_slots // groups
        return [sum(r is not None for r in self._slots[g * per_group:(g + 1) * per_group]) for g in range(groups)]

    def idle(self) -> bool:
        with self._lock:
            return not (self._queue or self._busy())

    # -- requests
    def _reserve_for(self, prompt_len: int, max_tokens: int) -> int:
        """Positions a paged request may write: its prompt, all but its last generated token, and the
        positions a multi-step decode plan may run past a stop (within max_seq_len)."""
        return min(prompt_len + max_tokens - 1 + max(self.decode_steps - 1, 0), self.max_seq_len)

    def validate(self, req: GenerationRequest) -> None:
        """Raise `RequestFailed` (a ValueError; `invalid`: the request's content, HTTP 400) saying what is wrong with a
        request that can never run here."""
        def refuse(message: str) -> RequestFailed:
            return RequestFailed(f"request {req.request_id}: {message}", request_ids=(req.request_id,), invalid=True)

        n = len(req.prompt_token_ids)
        if n == 0:
            raise refuse("prompt is empty (prompt_token_ids has no tokens)")
        if n > self.max_prompt_len:
            raise refuse(f"prompt has {n} tokens, more than the {self.max_prompt_len} this engine accepts "
                         f"(max_seq_len {self.max_seq_len}, at least one token must be generated)")
        if req.max_tokens < 1:
            raise refuse(f"max_tokens must be >= 1, found {req.max_tokens}")
        if self.vocab_size is not None:
            ids = np.asarray(req.prompt_token_ids, np.int64)
            bad = ids[(ids < 0) | (ids >= self.vocab_size)]
            if bad.size:
                raise refuse(f"prompt token id {int(bad[0])} is outside the model's vocabulary (ids "
                             f"0..{self.vocab_size - 1}, vocab_size {self.vocab_size})")
        ps = self.paging.page_size
        need = -(-self._reserve_for(n, req.max_tokens) // ps)
        if need > self.paging.pages_per_group:
            raise refuse(f"needs up to {need} KV pages of {ps} tokens (prompt {n} + max_tokens {req.max_tokens}), "
                         f"more than the {self.paging.pages_per_group} pages of a dp group's pool "
                         f"(engine.num_pages); lower max_tokens or shorten the prompt")

    def submit(self, req: GenerationRequest, sink: Sink) -> None:
        """Queue a request; raises `RequestFailed` (never runs here: a ValueError) or QueueFullError (try later)."""
        self.validate(req)
        with self._lock:
            if len(self._queue) >= self.max_queue:
                raise QueueFullError(len(self._queue), self.max_queue)
            self._queue.append(_Queued(req, sink, self.clock()))
            self._work.notify_all()

    def abort(self, request_id: str) -> bool:
        """Stop a queued or running request (its sink gets a final "abort" event); False if unknown."""
        events: list[tuple[Sink, TokenEvent]] = []
        with self._lock:
            for i, q in enumerate(self._queue):
                if q.req.request_id == request_id:
                    del self._queue[i]
                    events.append((q.sink, TokenEvent(request_id, None, index=0, finish_reason="abort")))
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
            self._planned_at.clear()  # plans that will never report back
            self._episode_t0, self._episode_passes = None, 0
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
            self._planned_at.pop(plan.step_id, None)
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
            self._planned_at.pop(plan.step_id, None)
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

    def wait_for_work(self, timeout_s: float) -> bool:
        """Block until there may be a plan to run (or timeout); True if there is work. Requests that find the
        engine idle are held for the burst wait (`Paging.burst_wait`) before this returns."""
        with self._lock:
            if not (self._queue or self._busy()):
                self._work.wait(timeout_s)
            if self._queue and not self._busy():
                self._gather_burst()
            return bool(self._queue or self._busy())

    def _busy(self) -> bool:
        """Under the lock: requests are running or slots wait to be released (a plan is due whatever the queue)."""
        return bool(self.slots_in_use or self._release)

    def _gather_burst(self) -> None:
        """Under the lock, with requests queued at an idle engine: wait until `burst_wait` decode passes have gone by
        with no new arrival (from the first, then from each later one), at most `BURST_MAX_PASSES` decode passes
        after the first (nothing to wait for before a pass was measured), or until the queue holds a request for
        every slot. A burst sent at once reaches rank 0 over tens of milliseconds (HTTP, the proxy, the replica):
        every request of it that misses the first step waits a whole step behind it."""
        frac = self.paging.burst_wait
        if not frac or not self.decode_pass_s:
            return
        gap, cap = frac * self.decode_pass_s, BURST_MAX_PASSES * self.decode_pass_s
        now = time.monotonic()  # waited in real time, whatever the clock
        first = now - max(0.0, self.clock() - self._queue[0].submitted_s)
        deadline, seen = first + gap, len(self._queue)
        while len(self._queue) < self.max_slots and (left := min(deadline, first + cap) - time.monotonic()) > 0:
            self._work.wait(left)
            if len(self._queue) > seen:
                deadline, seen = time.monotonic() + gap, len(self._queue)

    # -- the step loop
    def next_plan(self) -> StepPlan | None:
        """The next step: releases, the decode rows of running streams, and prompt chunks of started and newly
        admitted requests (None when there is nothing to do)."""
        return self._next_paged_plan(self.paging)

    def _stop_ids(self, req: GenerationRequest) -> frozenset[int]:
        return frozenset(req.stop_token_ids) | (frozenset() if req.ignore_eos else self.eos_ids)

    # -- planning
    def _next_paged_plan(self, p: Paging) -> StepPlan | None:
        """Decode rows of every running stream, then prompt chunks (started prompts first, then queued requests
        admitted while a slot, their pages and the group's token budget allow), then the page-table changes."""
        with self._lock:
            per_group = self.max_slots // p.groups
            budget = [p.max_step_tokens] * p.groups
            seqs: list[SeqStep] = []
            entries: list[tuple[int, _Running]] = []
            updates: list[PageUpdate] = []
            decoding: list[tuple[int, _Running]] = []
            for slot in self.slot_order:
                run = self._slots[slot]
                if run is not None and run.started and run.computed >= run.prompt_len:
                    decoding.append((slot, run))
            one_step = p.max_step_tokens if p.mixed_step_tokens is None else min(p.max_step_tokens,
                                                                                 p.mixed_step_tokens)
            if decoding:  # a step costs its largest group's tokens
                budget = [one_step] * p.groups
            for slot, _ in decoding:
                budget[slot // per_group] -= 1
            wait = self._wait_passes() if decoding else 0
            held = False  # a started prompt's next chunk waits for decode passes (max_decode_slowdown)
            for slot in list(self._prefilling):
                run = self._slots[slot]
                assert run is not None
                # only a prompt longer than a step beside the streams waits: one that fits a step but was split
                # because other prompts shared its step goes on at once
                if wait and run.started and run.prompt_len > one_step:
                    held = True
                    continue
                n = min(run.prompt_len - run.computed, budget[slot // per_group])
                if n > 0:
                    budget[slot // per_group] -= n
                    seqs.append(self._chunk(slot, run, n, updates))
                    entries.append((slot, run))
            while self._queue:  # admission: a slot and pages (its prefill starts when its group has budget)
                placed = self._place(self._queue[0], p, budget)
                if placed is None:
                    break  # first come, first served: later requests wait behind the first that cannot start
                q = self._queue.popleft()
                slot, pages = placed
                run = _Running(q.req, q.sink, len(q.req.prompt_token_ids), q.submitted_s,
                               stop_ids=self._stop_ids(q.req), pages=pages, tokens=list(q.req.prompt_token_ids),
                               computed=pages.shared * p.page_size,
                               cap=self._reserve_for(len(q.req.prompt_token_ids), q.req.max_tokens))
                self.prefix_hit_tokens += run.computed
                self._slots[slot] = run
                self._prefilling.append(slot)
                n = min(run.prompt_len - run.computed, budget[slot // per_group])
                if n > 0:  # else it holds its slot and pages and starts when its group has budget again
                    budget[slot // per_group] -= n
                    seqs.append(self._chunk(slot, run, n, updates))
                    entries.append((slot, run))
            steps = 1 if seqs else self._paged_decode_steps([r for _, r in decoding])
            if held and not seqs:  # a decode-only plan ends where the held prompts may go on (`held_floor`)
                steps = max(1, min(steps, max(wait, self.held_floor)))
            now = self.clock()
            if decoding and self._prefilling:
                if self._episode_t0 is None:
                    self._episode_t0 = now
                self._episode_passes += steps
            else:
                self._episode_t0, self._episode_passes = None, 0
                self._held_passes.clear()
            if decoding:  # (seqs holds the prompt chunks so far) the plan's duration feeds `_wait_passes`
                kind = "chunk" if seqs else "held" if self._episode_t0 is not None else "decode"
                self._planned_at[self._step_id] = (now, kind, steps)
            for slot, run in decoding:
                self._grow(slot, run, run.computed + steps, updates)
                seqs.append(SeqStep(slot, np.zeros(0, np.int32), run.computed, True))
                entries.append((slot, run))
            release = tuple(self._release)
            self._release = []
            if not seqs and not release:
                return None
            plan = StepPlan(self._step_id, release=release, decode_steps=steps, seqs=tuple(seqs),
                            pages=tuple(updates))
            self._inflight[plan.step_id] = entries
            self._step_id += 1
            return plan

    def _place(self, q: _Queued, p: Paging, budget: list[int]) -> tuple[int, SequencePages] | None:
        """A slot and pages for a queued request, or None if no dp group has both now. Among the groups with a
        free slot and room for its pages, the one where it costs least, in tokens of a step (a decode row counts
        one): how much longer it makes this step (a step costs its largest group's tokens; the prompt computes
        its tokens here, its cached prefix pages excluded) plus how much longer every decode pass after it, for
        as many passes as its max_tokens allows (the groups run in lockstep, so a pass costs its largest
        group's rows: a request that makes its group hold more rows than any group holds now adds a row to
        each). Ties go to the group with the most step budget left, then the fewest running requests. So a
        cached prefix draws a prompt to its group only while computing it elsewhere costs more than the
        step and the passes it unbalances: a burst does not pile into the one group that served the last
        request while the others idle; streams whose short prompts were cached in one group split evenly
        (7 chat streams of 1536 tokens went 5 / 2 when only this step counted); a long shared system prompt
        keeps short requests on the group that caches it."""
        req = q.req
        per_group = self.max_slots // p.groups
        if q.keys is None:
            q.keys = SequencePages.prompt_keys(req.prompt_token_ids, p.page_size) if p.prefix_caching else []
        cap = self._reserve_for(len(req.prompt_token_ids), req.max_tokens)
        n = len(req.prompt_token_ids)
        rows = self._rows_per_group(p.groups)
        most_rows, least_budget = max(rows), min(budget)
        passes = max(0, min(req.max_tokens, self.max_seq_len - n) - 1)  # after the pass of its first token
        best: tuple[tuple[int, int, int, int], int, int] | None = None
        for slot in self.slot_order:
            g = slot // per_group
            if self._slots[slot] is not None or (best is not None and best[1] == g):
                continue
            hit, fits = SequencePages.fits(self.pools[g], q.keys, cap)
            if not fits:
                continue
            tokens = min(n - hit * p.page_size, max(budget[g], 0))  # what it computes here this step
            # how much longer this step gets (its largest group's tokens) and every pass after it
            cost = (max(0, tokens - (budget[g] - least_budget)) + max(0, rows[g] + 1 - most_rows) * passes)
            rank = (-cost, budget[g] - tokens, -rows[g], -self.slot_order.index(slot))
            if best is None or rank > best[0]:
                best = (rank, g, slot)
        if best is None:
            return None
        _, g, slot = best
        pages = SequencePages.admit(self.pools[g], req.prompt_token_ids, cap, q.keys)
        assert pages is not None  # `fits` said so, under the same lock
        return slot, pages

    def _grow(self, slot: int, run: _Running, positions: int, updates: list[PageUpdate]) -> None:
        """Give `run` pages for `positions` positions (from its reservation); the new entries of its row go
        into the plan. A first chunk sends the whole row, shared prefix pages included."""
        assert run.pages is not None
        before = len(run.pages.pages)
        new = run.pages.grow(positions)
        if not run.started or run.resend_row:
            run.resend_row = False
            updates.append(PageUpdate(slot, 0, np.asarray(run.pages.pages, np.int32)))
        elif new:
            updates.append(PageUpdate(slot, before, np.asarray(new, np.int32)))

    def _chunk(self, slot: int, run: _Running, n: int, updates: list[PageUpdate]) -> SeqStep:
        """The next `n` prompt tokens of `run` as a SeqStep (the first chunk carries sampling and the tokens
        of the reused prefix, for the repetition penalty)."""
        start = run.computed
        self._grow(slot, run, start + n, updates)
        first = not run.started
        run.started = True
        prompt = run.req.prompt_token_ids
        return SeqStep(slot, np.asarray(prompt[start:start + n], np.int32), start, start + n == run.prompt_len,
                       run.req.sampling if first else None,
                       np.asarray(prompt[:start], np.int32) if first and start > 0 else None)

    def _wait_passes(self) -> int:
        """Decode passes the prompts being prefilled must still wait before their next chunk (0: now), while
        streams decode: the time since the prefill began beside them, plus one more chunk step, must stay within
        `max_decode_slowdown` decode passes for each token the streams get. Counting the whole episode's wall
        time, not one chunk step at a time, corrects itself when chunk steps grow (a prompt's later chunks attend
        to more keys), when a step ran before one was measured, and for the host's time between plans."""
        limit = self._slowdown_limit
        d, m = self._pace(limit), self.chunk_step_s
        if not limit or d is None or m is None or d <= 0:
            return 0
        elapsed = 0.0 if self._episode_t0 is None else self.clock() - self._episode_t0
        m += self._chunk_growth_s  # a prompt's next chunk attends to more keys than its last: steps grow
        need = (elapsed + m) / (limit * d) - (self._episode_passes + 1)
        return min(MAX_HOLD_PASSES, max(0, int(np.ceil(need))))

    @property
    def _slowdown_limit(self) -> float:
        """`max_decode_slowdown` (0: nothing is held)."""
        return self.paging.max_decode_slowdown

    def _pace(self, limit: float) -> float | None:
        """The decode pass time the limit is a factor of: the pace before the prompt (`decode_pass_s`), unless
        this episode's passes between chunks run slower than halfway from it to the limit. Then the pace follows
        them (their median over that halfway factor): the streams' own passes slow as their keys grow (measured
        on the demo, 7 streams: 30 ms a pass at 256 cached tokens, 50 at 512, 65 at 1000), and against a pace
        they no longer reach, waiting would never pay for a chunk and the prompt would wait until the streams
        end. So a held pass always pays for at least (limit - 1) / (2 * limit) of a pass of the wait."""
        d = self.decode_pass_s
        if d is None or not self._held_passes or limit <= 1:
            return d
        return max(d, float(np.median(self._held_passes)) / _halfway(limit))

    def _timed(self, step_id: int, now: float) -> None:
        """Fold a finished plan's duration into the decode pass average or the last chunk step."""
        planned = self._planned_at.pop(step_id, None)
        if planned is None:
            return
        t0, kind, passes = planned
        dt = max(now - t0, 0.0)
        if kind == "held" and self.decode_pass_s is not None:
            limit = self._slowdown_limit
            pace = self._pace(limit)
            assert pace is not None
            if passes < self.decode_steps and dt / passes > _halfway(limit) * pace:
                self.held_floor = max(self.held_floor, min(passes + 1, self.decode_steps))
            elif passes == self.decode_steps:
                self._held_passes.append(dt / passes)
            return  # a pass between chunks: the pace before the prompt is what the limit refers to
        if kind in ("decode", "held"):
            if passes == self.decode_steps or self.decode_pass_s is None:
                # the usual pass: a plan of decode_steps passes (a shorter one pays its per-plan costs over fewer)
                self._recent_passes.append(dt / passes)
                self.decode_pass_s = float(np.median(self._recent_passes))
        else:
            self._chunk_growth_s = 0.0 if self.chunk_step_s is None else max(0.0, dt - self.chunk_step_s)
            self.chunk_step_s = dt

    def _paged_decode_steps(self, runs: list[_Running]) -> int:
        """Steps of a decode-only plan: `decode_steps`, but no more than the running requests still want and
        never past a request's reserved positions (which include max_seq_len's bound)."""
        if not runs:
            return 1
        room = min(r.cap - r.computed for r in runs)
        wanted = max(r.req.max_tokens - r.generated for r in runs)
        return max(1, min(self.decode_steps, room, wanted))

    def _on_paged_result(self, plan: StepPlan, result: StepResult, events: list, now: float) -> None:
        entries = self._inflight.pop(plan.step_id, [])
        self._timed(plan.step_id, now)
        if result.tokens is None:
            raise ValueError(f"step {plan.step_id}: the engine returned no tokens for a paged plan")
        if result.tokens.shape != (plan.decode_steps, len(entries)):
            raise ValueError(f"step {plan.step_id}: tokens shaped {result.tokens.shape}, expected "
                             f"{(plan.decode_steps, len(entries))} (decode_steps, sequences)")
        lps = result.logprobs
        for i, (seq, (slot, run)) in enumerate(zip(plan.seqs, entries, strict=True)):
            n = int(np.asarray(seq.tokens).shape[0])
            if n:  # a prompt chunk
                if self._slots[slot] is not run:
                    continue  # aborted (or failed) while the step ran
                run.computed += n
                self.prefill_tokens += n
                if seq.sample:
                    self._prefilling.remove(slot)
                    self.prefills += 1
                    run.first_token_s = now
                    self.ttft_s.append(now - run.submitted_s)
                    self._token(slot, int(result.tokens[0, i]), None if lps is None else float(lps[0, i]), events)
                if self._slots[slot] is run:
                    self._commit(run)
                continue
            for k in range(plan.decode_steps):  # tokens after a request finished are dropped
                if self._slots[slot] is not run:
                    break
                run.computed += 1
                self._token(slot, int(result.tokens[k, i]), None if lps is None else float(lps[k, i]), events)
            if self._slots[slot] is run:
                self._commit(run)

    def _commit(self, run: _Running) -> None:
        """Cache the request's pages that are now full and computed."""
        if run.pages is not None and self.paging.prefix_caching:
            run.pages.commit(run.tokens, run.computed)

    def on_result(self, plan: StepPlan, result: StepResult) -> None:
        """Turn a step's tokens into events; finish requests on stop tokens, max_tokens or max_seq_len."""
        events: list[tuple[Sink, TokenEvent]] = []
        now = self.clock()
        with self._lock:
            self.steps += 1
            self._on_paged_result(plan, result, events, now)
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
        if run.pages is not None:
            run.tokens.append(token)
        reason: FinishReason | None = None
        if run.generated >= run.req.max_tokens or run.prompt_len + run.generated >= self.max_seq_len:
            reason = "length"
        events.append((run.sink, TokenEvent(run.req.request_id, token, logprob, run.generated - 1, reason)))
        if reason is not None:
            self._finish(slot, reason)

    def _finish(self, slot: int, reason: FinishReason) -> TokenEvent:
        """Take a request out of its slot: its slot is released in the next plan; its
        computed full pages are cached and every page and reservation goes back to the pool."""
        run = self._slots[slot]
        assert run is not None
        self._slots[slot] = None
        self._release.append(slot)
        if run.pages is not None:
            self._commit(run)
            run.pages.free()
            if slot in self._prefilling:
                self._prefilling.remove(slot)
        return TokenEvent(run.req.request_id, None, index=run.generated, finish_reason=reason)

    @staticmethod
    def _emit(events: list[tuple[Sink, TokenEvent]]) -> None:
        for sink, ev in events:
            sink(ev)
