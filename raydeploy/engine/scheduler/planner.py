"""The planner: the scheduler's request lifecycle and its plans, over admission (`admission`), placement
(`placement`) and pacing (`pacing`), with the failures' handling (`failures`) and the events' logprobs
(`logprobs`). The package's docstring (`raydeploy.engine.scheduler`) tells the whole story; no JAX here."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from raydeploy.constraints.matcher import GrammarEngine
from raydeploy.engine.pages import PagePool
from raydeploy.engine.request import (
    FinishReason,
    GenerationRequest,
    TokenEvent,
)
from raydeploy.engine.scheduler.admission import Admission, QueueFullError
from raydeploy.engine.scheduler.constrained import ConstrainedDraws
from raydeploy.engine.scheduler.failures import Failures
from raydeploy.engine.scheduler.logprobs import add_prompt_logprobs, alternatives, first_event
from raydeploy.engine.scheduler.pacing import Pacing
from raydeploy.engine.scheduler.placement import Placement, rows_per_group
from raydeploy.engine.scheduler.records import Paging, Queued, Running, Sink
from raydeploy.engine.speculative import ngram
from raydeploy.engine.speculative.draft import DRAFT_PLACEHOLDER
from raydeploy.engine.speculative.policy import SpecCounters, SpeculationPolicy
from raydeploy.engine.step import PageUpdate, SeqStep, StepPlan, StepResult

if TYPE_CHECKING:
    from raydeploy.config import Config

class Scheduler(Failures):
    """Queue + slot table + page pools. Thread-safe; the step loop itself
    (next_plan/on_result) runs in one thread."""

    def __init__(self, max_slots: int, max_seq_len: int, eos_ids: Sequence[int], max_queue: int, paging: Paging,
                 clock: Callable[[], float] = time.monotonic, slot_order: Sequence[int] | None = None,
                 decode_steps: int = 1, vocab_size: int | None = None,
                 wait_clock: Callable[[], float] = time.monotonic, grammar: GrammarEngine | None = None,
                 speculation: SpeculationPolicy | None = None) -> None:
        self.max_slots = max_slots
        self.slot_order = list(range(max_slots)) if slot_order is None else [int(s) for s in slot_order]
        if sorted(self.slot_order) != list(range(max_slots)):
            raise ValueError(f"slot_order must list each of the {max_slots} slots once, got {self.slot_order}")
        self.max_seq_len = max_seq_len
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.max_queue = max_queue
        self.decode_steps = decode_steps
        self.paging = paging
        paging.check(max_slots)
        self.admission = Admission(max_seq_len, paging, decode_steps, vocab_size)
        self.max_prompt_len = self.admission.max_prompt_len
        self.pools = [PagePool(paging.pages_per_group, paging.page_size, g) for g in range(paging.groups)]
        self.placement = Placement(paging, self.pools, self.slot_order, max_seq_len)
        self.pacing = Pacing(decode_steps, paging.max_decode_slowdown, paging.burst_wait, clock, wait_clock)
        self.constrained = ConstrainedDraws(grammar)
        """Constrained requests' matchers and masks (structured outputs)."""
        self.speculation = speculation
        """Speculative decoding's proposals and back-off (`raydeploy.engine.speculative`); None: off."""
        self.spec = SpecCounters()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: deque[Queued] = deque()
        self._slots: list[Running | None] = [None] * max_slots
        self._release: list[int] = []
        self._inflight: dict[int, list[tuple[int, Running]]] = {}  # step_id -> (slot, request) per seq
        self._prefilling: list[int] = []  # slots whose prompt is not fully computed, in arrival order
        self._step_id = 0
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

    @classmethod
    def for_engine(cls, engine: Any, cfg: Config, clock: Callable[[], float] = time.monotonic,
                   grammar: GrammarEngine | None = None) -> Scheduler:
        """A scheduler sized for `engine` (its geometry: slots, max_seq_len, pages and step sizes; its eos ids, the
        order to fill slots in and its vocabulary) with the config's queue, decode steps and pacing; `grammar`
        compiles constrained requests (built over the same tokenizer and vocabulary)."""
        g = engine.geometry
        # a model whose sliding-window layers keep rings cannot reuse a prefix (its window is not in them)
        prefix = cfg.engine.prefix_caching and not engine.window_rings
        paging = Paging.from_geometry(g, prefix, cfg.engine.max_decode_slowdown, cfg.engine.burst_wait)
        return cls(g.max_slots, g.max_seq_len, engine.eos_ids, cfg.serving.max_queue, paging, clock=clock,
                   slot_order=engine.slot_order, decode_steps=cfg.engine.decode_steps, vocab_size=engine.vocab_size,
                   grammar=grammar, speculation=SpeculationPolicy.from_config(cfg.engine.speculative))

    @property
    def clock(self) -> Callable[[], float]:
        """The clock plans are timed and requests stamped with (the pacing's)."""
        return self.pacing.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.pacing.clock = clock

    @property
    def decode_pass_s(self) -> float | None:
        """Seconds per undisturbed decode pass (`Pacing.decode_pass_s`)."""
        return self.pacing.decode_pass_s

    @decode_pass_s.setter
    def decode_pass_s(self, seconds: float | None) -> None:
        self.pacing.decode_pass_s = seconds

    @property
    def chunk_step_s(self) -> float | None:
        """Seconds of the last step of prompt chunks beside decode rows (`Pacing.chunk_step_s`)."""
        return self.pacing.chunk_step_s

    @property
    def held_floor(self) -> int:
        """The fewest passes of a plan that holds a prompt back (`Pacing.held_floor`)."""
        return self.pacing.held_floor

    @property
    def vocab_size(self) -> int | None:
        return self.admission.vocab_size

    @property
    def grammar(self) -> GrammarEngine | None:
        """Compiles requests' constraints (structured outputs); None: a constrained request is refused."""
        return self.constrained.grammar

    def stats(self) -> dict[str, Any]:
        """Counters for metrics and /status (with the pages and the prefix cache, summed over the
        dp groups: hits, misses and evictions count pages)."""
        ttft = sorted(self.ttft_s)
        out: dict[str, Any] = {
            "queue_depth": self.queue_depth, "slots_in_use": self.slots_in_use, "max_slots": self.max_slots,
            "steps": self.steps, "tokens_generated": self.tokens_generated, "prefills": self.prefills,
            "requests_failed": self.requests_failed, "constraint_masks": self.constrained.masks,
            "constraint_mask_s": self.constrained.mask_s,
            "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None}
        with self._lock:
            for pool in self.pools:
                for k, v in pool.stats().items():
                    out[k] = out.get(k, 0) + v
        out["slots_in_use_per_group"] = rows_per_group(self._slots, self.paging.groups)
        out["prefill_tokens"] = self.prefill_tokens
        out["prefix_hit_tokens"] = self.prefix_hit_tokens
        out.update(self.pacing.stats())  # the step times the chunk hold-back (max_decode_slowdown) works from
        out["spec_decode_method"] = "none" if self.speculation is None else self.speculation.method
        out.update(self.spec.stats())
        return out

    # -- counters
    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def slots_in_use(self) -> int:
        return sum(r is not None for r in self._slots)

    def idle(self) -> bool:
        with self._lock:
            return not (self._queue or self._busy())

    # -- requests
    def validate(self, req: GenerationRequest) -> None:
        """Raise `RequestFailed` (a ValueError, HTTP 400) for a request that can never run here (`Admission`)."""
        self.admission.validate(req)

    def submit(self, req: GenerationRequest, sink: Sink) -> None:
        """Queue a request; raises `RequestFailed` (never runs here: a ValueError) or QueueFullError (try later).
        A constrained request's grammar is compiled here with its first mask, in the caller's thread and outside
        the lock (a constraint that does not compile, or one sent to a scheduler without a grammar engine, is
        refused)."""
        self.validate(req)
        matcher, first = (None, None) if req.constraint is None else self.constrained.compile(req)
        with self._lock:
            if len(self._queue) >= self.max_queue:
                raise QueueFullError(len(self._queue), self.max_queue)
            self._queue.append(Queued(req, sink, self.clock(), matcher=matcher, allowed=first))
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
        """Under the lock, with requests queued at an idle engine: hold them for the burst wait
        (`Pacing.gather_burst`), until a request for every slot is queued."""
        self.pacing.gather_burst(self._queue[0].submitted_s, lambda: len(self._queue), self.max_slots,
                                 self._work.wait)

    # -- the step loop
    def next_plan(self) -> StepPlan | None:
        """The next step: releases, the decode rows of running streams, and prompt chunks of started and newly
        admitted requests (None when there is nothing to do). The masks of the constrained streams that draw in
        it are filled first, with the lock released (`constrained`): only this thread touches their matchers, and a
        request aborted meanwhile is simply not planned."""
        with self._lock:
            decoding = [run for _, run in self._decoding()]
        self.constrained.fill(decoding)
        events: list[tuple[Sink, TokenEvent]] = []
        plan = self._next_plan(self.paging, events)
        self._emit(events)  # requests whose grammar allowed no next token
        return plan

    def _stop_ids(self, req: GenerationRequest) -> frozenset[int]:
        return frozenset(req.stop_token_ids) | (frozenset() if req.ignore_eos else self.eos_ids)

    # -- planning
    def _next_plan(self, p: Paging, events: list[tuple[Sink, TokenEvent]]) -> StepPlan | None:
        """Decode rows of every running stream, then prompt chunks (started prompts first, then queued requests
        admitted while a slot, their pages and the group's token budget allow), then the page-table changes.
        A constrained request's sampling row carries its allowed tokens (one whose grammar allows none ends with
        an error event in `events`), and a plan with such a row runs one pass."""
        with self._lock:
            per_group = self.max_slots // p.groups
            budget = [p.max_step_tokens] * p.groups
            seqs: list[SeqStep] = []
            entries: list[tuple[int, Running]] = []
            updates: list[PageUpdate] = []
            decoding = self._decoding()
            one_step = p.max_step_tokens if p.mixed_step_tokens is None else min(p.max_step_tokens,
                                                                                 p.mixed_step_tokens)
            if decoding:  # a step costs its largest group's tokens
                budget = [one_step] * p.groups
            for slot, _ in decoding:
                budget[slot // per_group] -= 1
            wait = self.pacing.wait_passes() if decoding else 0
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
                if n > 0 and self._chunk(slot, run, n, seqs, entries, updates, events):
                    budget[slot // per_group] -= n
            while self._queue:  # admission: a slot and pages (its prefill starts when its group has budget)
                head = self._queue[0]
                cap = self.admission.reserve_for(len(head.req.prompt_token_ids), head.req.max_tokens)
                placed = self.placement.place(head, cap, self._slots, budget)
                if placed is None:
                    break  # first come, first served: later requests wait behind the first that cannot start
                q = self._queue.popleft()
                slot, pages = placed
                run = Running(q.req, q.sink, len(q.req.prompt_token_ids), q.submitted_s,
                               stop_ids=self._stop_ids(q.req), pages=pages, tokens=list(q.req.prompt_token_ids),
                               computed=pages.shared * p.page_size, cap=cap, matcher=q.matcher,
                               allowed=q.allowed, cached_tokens=pages.shared * p.page_size,
                               prompt_logprobs=None if q.req.prompt_logprobs is None else [None])
                self.prefix_hit_tokens += run.computed
                self._slots[slot] = run
                self._prefilling.append(slot)
                n = min(run.prompt_len - run.computed, budget[slot // per_group])
                # n == 0: it holds its slot and pages and starts when its group has budget again
                if n > 0 and self._chunk(slot, run, n, seqs, entries, updates, events):
                    budget[slot // per_group] -= n
            proposals, retry = ({}, False) if seqs else self._proposals(decoding)
            steps = 1 if seqs or proposals or retry else self._decode_steps([r for _, r in decoding])
            if held and not seqs:  # a decode-only plan ends where the held prompts may go on (`held_floor`)
                steps = self.pacing.held_steps(steps, wait)
            # (seqs holds the prompt chunks so far) the plan's duration feeds the chunk hold-back
            self.pacing.planned(self._step_id, self.clock(), bool(decoding), bool(self._prefilling), bool(seqs), steps)
            for slot, run in decoding:
                allowed = self._allowed(slot, run, events)
                if self._slots[slot] is not run:
                    continue  # its grammar allowed no next token
                entries.append((slot, run))
                proposed = proposals.get(slot)
                if proposed:  # a speculating row: its last token, then the proposals, verified as one chunk
                    self._grow(slot, run, run.computed + 1 + len(proposed), updates)
                    seqs.append(SeqStep(slot, np.asarray([run.tokens[-1], *proposed], np.int32), run.computed, True,
                                        spec=len(proposed)))
                    continue
                self._grow(slot, run, run.computed + steps, updates)
                seqs.append(SeqStep(slot, np.zeros(0, np.int32), run.computed, True, allowed=allowed,
                                    top_logprobs=run.req.top_logprobs > 0))
            release = tuple(self._release)
            self._release = []
            if not seqs and not release:
                return None
            plan = StepPlan(self._step_id, release=release, decode_steps=steps, seqs=tuple(seqs),
                            pages=tuple(updates))
            self._inflight[plan.step_id] = entries
            self._step_id += 1
            return plan

    def _grow(self, slot: int, run: Running, positions: int, updates: list[PageUpdate]) -> None:
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

    def _decoding(self) -> list[tuple[int, Running]]:
        """Under the lock: (slot, request) of the streams past their prompt (each draws in the next plan)."""
        runs = [(slot, self._slots[slot]) for slot in self.slot_order]
        return [(slot, run) for slot, run in runs if run is not None and run.started and run.computed >= run.prompt_len]

    def _allowed(self, slot: int, run: Running, events: list[tuple[Sink, TokenEvent]]) -> np.ndarray | None:
        """Under the lock: the packed allowed tokens of `run`'s next draw, filled ahead (None when it has no
        constraint). A grammar that allows no token (or a failed matcher) ends the request with an error event
        naming it, instead of a draw from nothing or a wait that never ends; the caller then leaves it out."""
        if run.matcher is None:
            return None
        refusal = self.constrained.refusal(run)
        if refusal is not None:
            events.append((run.sink, self._end_with_error(slot, *refusal)))
            return None
        return run.allowed

    def _end_with_error(self, slot: int, why: str, invalid: bool) -> TokenEvent:
        """Under the lock: end the request in `slot` (not for a failed step: its computed pages are good) with a
        non-retriable error naming it; `invalid`: its own content is at fault (HTTP 400)."""
        event = self._finish(slot, "error")
        self.requests_failed += 1
        return dataclasses.replace(event, error=f"request {event.request_id} failed: {why}", invalid=invalid)

    def _chunk(self, slot: int, run: Running, n: int, seqs: list[SeqStep], entries: list[tuple[int, Running]],
               updates: list[PageUpdate], events: list[tuple[Sink, TokenEvent]]) -> bool:
        """Plan the next `n` prompt tokens of `run` (the first chunk carries sampling and the tokens of the reused
        prefix, for the repetition penalty; a last chunk of a constrained request its allowed tokens). False
        when its grammar allows no first token (it has ended with an error in `events`)."""
        start = run.computed
        allowed = self._allowed(slot, run, events) if start + n == run.prompt_len else None
        if self._slots[slot] is not run:
            return False
        self._grow(slot, run, start + n, updates)
        first = not run.started
        run.started = True
        prompt = run.req.prompt_token_ids
        last = start + n == run.prompt_len
        min_tokens = run.req.sampling.min_tokens
        # min_tokens: the engine bans the request's stop ids from draws before prompt_len + min_tokens
        stop_ids = np.asarray(sorted(run.stop_ids), np.int32) if first and min_tokens > 0 and run.stop_ids else None
        seqs.append(SeqStep(slot, np.asarray(prompt[start:start + n], np.int32), start, start + n == run.prompt_len,
                            run.req.sampling if first else None,
                            np.asarray(prompt[:start], np.int32) if first and start > 0 else None, allowed,
                            stop_ids=stop_ids, stop_until=run.prompt_len + min_tokens if stop_ids is not None else 0,
                            top_logprobs=last and run.req.top_logprobs > 0,
                            prompt_logprobs=run.req.prompt_logprobs is not None,
                            next_token=-1 if last else int(prompt[start + n]),
                            adapter=run.req.adapter_slot if first else -1))
        entries.append((slot, run))
        return True

    def _proposals(self, decoding: list[tuple[int, Running]]) -> tuple[dict[int, list[int]], bool]:
        """Under the lock, for a plan of decode rows only: each speculating row's proposed tokens by slot (none
        when speculation is off, or when a dp group holds more than `max_rows` decode rows: the per-step
        back-off), and whether a warm request found none (`Acceptance.retry`: the plan then runs one pass). A
        row speculates while its request allows it (`_may_speculate`) and its lookup finds a match; its
        proposals stay within its reserved positions, max_seq_len, its max_tokens and its group's token budget
        of a step (`Paging.max_step_tokens`: the largest verify program; a plan of decode rows only)."""
        policy = self.speculation
        if policy is None or not decoding:
            return {}, False
        per_group = self.max_slots // self.paging.groups
        counts = [0] * self.paging.groups
        for slot, _ in decoding:
            counts[slot // per_group] += 1
        if max(counts) > policy.max_rows:
            self.spec.backoff_steps += 1
            return {}, False
        budget = [self.paging.max_step_tokens - c for c in counts]
        out: dict[int, list[int]] = {}
        retry = False
        for slot, run in decoding:
            if not self._may_speculate(run):
                continue
            g = slot // per_group
            k = min(policy.num_tokens, run.cap - run.computed - 1, self.max_seq_len - 2 - run.computed,
                    run.req.max_tokens - run.generated - 1, budget[g])
            proposed = self._propose(run, k, policy) if k > 0 else []
            if proposed:
                out[slot] = proposed
                budget[g] -= len(proposed)
            elif k > 0 and run.acceptance.retry():
                retry = True
        return out, retry

    @staticmethod
    def _propose(run: Running, k: int, policy: SpeculationPolicy) -> list[int]:
        """`run`'s proposals: the prompt lookup's (ngram), or k placeholders that every host's engine replaces with
        its draft model's proposals (draft: `raydeploy.engine.speculative.draft`)."""
        if policy.method == "draft":
            return [DRAFT_PLACEHOLDER] * k
        return ngram.propose(run.tokens, k, policy.ngram_max, policy.ngram_min)

    def _may_speculate(self, run: Running) -> bool:
        """Whether `run` may speculate in the plan being made: not constrained (its mask after a proposal needs
        its grammar past it), no alternatives asked, past its min_tokens ban, not paused by its back-off, and
        with its pages (it needs its tokens on rank 0)."""
        return (run.matcher is None and run.req.top_logprobs == 0 and run.pages is not None
                and run.generated >= run.req.sampling.min_tokens and run.acceptance.allows(self._step_id))

    def _decode_steps(self, runs: list[Running]) -> int:
        """Steps of a decode-only plan: `decode_steps`, but no more than the unconstrained running requests still
        want and never past a request's reserved positions (which include max_seq_len's bound). A plan of
        constrained rows only runs one pass (each next mask needs this token). One that mixes both kinds runs one
        pass too, unless `ConstrainedDraws.shared_passes`: then its constrained rows draw in its first pass only
        (`SeqStep.first_pass_only`) and the others take every pass (the trade is measured in
        benchmarks/results/structured_decode.json: docs/structured-outputs.md)."""
        free = [r for r in runs if r.matcher is None]
        if not free or (len(free) < len(runs) and not self.constrained.shared_passes):
            return 1
        room = min(r.cap - r.computed for r in runs)
        wanted = max(r.req.max_tokens - r.generated for r in free)
        return max(1, min(self.decode_steps, room, wanted))

    def _on_result(self, plan: StepPlan, result: StepResult, events: list, now: float) -> None:
        entries = self._inflight.pop(plan.step_id, [])
        self.pacing.timed(plan.step_id, now)
        if result.tokens is None:
            raise ValueError(f"step {plan.step_id}: the engine returned no tokens for a paged plan")
        if result.tokens.shape != (plan.decode_steps, len(entries)):
            raise ValueError(f"step {plan.step_id}: tokens shaped {result.tokens.shape}, expected "
                             f"{(plan.decode_steps, len(entries))} (decode_steps, sequences)")
        lps = result.logprobs
        for i, (seq, (slot, run)) in enumerate(zip(plan.seqs, entries, strict=True)):
            n = int(np.asarray(seq.tokens).shape[0])
            if seq.spec:
                self._spec_result(plan, result, i, seq, slot, run, events)
                continue
            if n:  # a prompt chunk
                if self._slots[slot] is not run:
                    continue  # aborted (or failed) while the step ran
                run.computed += n
                self.prefill_tokens += n
                missing = add_prompt_logprobs(run, seq, None if result.prompt is None else result.prompt[i])
                if missing is not None:  # an engine that computes no prompt logprobs: this request fails alone
                    events.append((run.sink, self._end_with_error(slot, missing, invalid=False)))
                    continue
                if seq.sample:
                    self._prefilling.remove(slot)
                    self.prefills += 1
                    run.first_token_s = now
                    self.ttft_s.append(now - run.submitted_s)
                    self._token(slot, int(result.tokens[0, i]), None if lps is None else float(lps[0, i]), events,
                                alternatives(run, result, 0, i))
                if self._slots[slot] is run:
                    self._commit(run)
                continue
            # tokens after a request finished are dropped; a constrained row drew in the first pass only
            for k in range(1 if seq.first_pass_only else plan.decode_steps):
                if self._slots[slot] is not run:
                    break
                run.computed += 1
                self._token(slot, int(result.tokens[k, i]), None if lps is None else float(lps[k, i]), events,
                            alternatives(run, result, k, i))
            if self._slots[slot] is run:
                self._commit(run)

    def _spec_result(self, plan: StepPlan, result: StepResult, i: int, seq: SeqStep, slot: int, run: Running,
                     events: list) -> None:
        """A speculating row's emitted tokens (its accepted proposals, then the draw after them) as events, one by
        one, so a stop token, max_tokens or max_seq_len among them ends the request there and drops the rest; the
        pages that only rejected positions needed go back (`SequencePages.shrink`)."""
        if result.spec_tokens is None or result.spec_logprobs is None:
            raise ValueError(f"step {plan.step_id}: the engine returned no speculative tokens for a plan with "
                             f"speculating rows")
        emitted = [int(t) for t in result.spec_tokens[i] if t >= 0]
        if not 1 <= len(emitted) <= seq.spec + 1:
            raise ValueError(f"step {plan.step_id}: slot {slot} emitted {len(emitted)} tokens for {seq.spec} "
                             f"proposals (1..{seq.spec + 1} expected)")
        accepted = len(emitted) - 1
        self.spec.note(seq.spec, accepted)
        if self._slots[slot] is not run:
            return  # aborted while the step ran
        if self.speculation is not None:
            run.acceptance.note(seq.spec, accepted, plan.step_id, self.speculation.min_acceptance)
        for j, token in enumerate(emitted):
            if self._slots[slot] is not run:
                break  # ended by an earlier token: the rest are dropped
            run.computed += 1
            self._token(slot, token, float(result.spec_logprobs[i, j]), events)
        if self._slots[slot] is run:
            assert run.pages is not None
            run.pages.shrink(run.computed)
            self._commit(run)

    def _commit(self, run: Running) -> None:
        """Cache the request's pages that are now full and computed."""
        if run.pages is not None and self.paging.prefix_caching:
            run.pages.commit(run.tokens, run.computed)

    def on_result(self, plan: StepPlan, result: StepResult) -> None:
        """Turn a step's tokens into events; finish requests on stop tokens, max_tokens or max_seq_len."""
        events: list[tuple[Sink, TokenEvent]] = []
        now = self.clock()
        with self._lock:
            self.steps += 1
            self._on_result(plan, result, events, now)
            self._work.notify_all()
        self._emit(events)

    # -- internals (lock held)
    def _token(self, slot: int, token: int, logprob: float | None, events: list,
               top: tuple[tuple[int, float], ...] | None = None) -> None:
        run = self._slots[slot]
        assert run is not None
        refused = None if run.matcher is None else self.constrained.accept(run, token)
        if refused is not None:  # the engine drew a token its mask did not allow: an engine fault
            events.append((run.sink, self._end_with_error(slot, refused, invalid=False)))
            return
        if token in run.stop_ids:  # eos where the grammar may end
            end = self._finish(slot, "stop")
            if run.req.report_stop:  # the stop token itself, with its logprob, on the final event
                end = dataclasses.replace(end, token_id=token, logprob=logprob, top_logprobs=top)
            events.append((run.sink, first_event(run, end)))
            return
        run.generated += 1
        self.tokens_generated += 1
        if run.pages is not None:
            run.tokens.append(token)
        reason: FinishReason | None = None
        if self.constrained.ended(run):
            reason = "stop"  # the grammar has ended: this token is its last
        elif run.generated >= run.req.max_tokens or run.prompt_len + run.generated >= self.max_seq_len:
            reason = "length"
        events.append((run.sink, first_event(run, TokenEvent(run.req.request_id, token, logprob, run.generated - 1,
                                                             reason, top_logprobs=top))))
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
