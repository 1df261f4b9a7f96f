"""Scheduler and LocalRunner logic, driven by fake paged engines (no JAX; the real engine is tested in
test_engine_model.py). `make`'s engine counts: its next token is the previous token + 1, so expected outputs are
obvious."""

from __future__ import annotations

import pickle
import time
from types import SimpleNamespace

import numpy as np
import pytest

from raydeploy.engine.local import LocalRunner
from raydeploy.engine.request import GenerationRequest, TokenEvent
from raydeploy.engine.scheduler import Paging, QueueFullError, Scheduler
from raydeploy.engine.step import StepPlan, StepResult

EOS = 2


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(max_slots=2, max_seq_len=64, max_queue=4, clock=None, decode_steps=1):
    """A scheduler and a counting paged engine (one dp group, pages of 4, a pool for every slot at max_seq_len)."""
    eng = PagedTokenEngine(max_slots, 1, 4, 64, max_seq_len, 64, next_fn=lambda seq: seq[-1] + 1)
    return paged(eng, max_queue=max_queue, clock=clock, decode_steps=decode_steps), eng


def chunks(plan: StepPlan) -> list[int]:
    """The slots of a plan's prompt chunks."""
    return [q.slot for q in plan.seqs if len(q.tokens)]


def decode_rows(plan: StepPlan) -> list[int]:
    """The slots of a plan's decode rows."""
    return [q.slot for q in plan.seqs if not len(q.tokens)]


def req(rid: str, prompt=(10, 11, 12), max_tokens=5, **kw) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt), max_tokens, **kw)


def collect(runner: LocalRunner, *reqs: GenerationRequest):
    return {o.request_id: o for o in runner.generate(list(reqs), timeout_s=5)}


def test_tokens_and_length_finish():
    sched, eng = make()
    out = collect(LocalRunner(eng, sched), req("a", max_tokens=4))["a"]
    assert out.token_ids == [13, 14, 15, 16] and out.finish_reason == "length"
    assert out.logprobs == [-0.5, -0.25, -0.25, -0.25]
    assert sched.slots_in_use == 0 and sched.tokens_generated == 4 and sched.prefills == 1


def test_eos_stops_without_emitting_the_stop_token():
    sched, eng = make()
    events: list[TokenEvent] = []
    sched.submit(req("a", prompt=(5, 0), max_tokens=10), events.append)  # 1, then eos 2
    LocalRunner(eng, sched).run_until_idle()
    assert [e.token_id for e in events] == [1, None]
    assert events[-1].finish_reason == "stop" and events[-1].index == 1


def test_a_request_reporting_logprobs_gets_its_stop_token_on_the_final_event():
    sched, eng = make()
    events: list[TokenEvent] = []
    sched.submit(req("a", prompt=(5, 0), max_tokens=10, report_stop=True), events.append)  # 1, then eos 2
    LocalRunner(eng, sched).run_until_idle()
    assert [e.token_id for e in events] == [1, EOS]  # the eos an evaluator scores, as vLLM reports it
    assert events[-1].finish_reason == "stop" and events[-1].index == 1 and events[-1].logprob is not None


def test_eos_as_first_token_and_ignore_eos():
    sched, eng = make()
    outs = collect(LocalRunner(eng, sched), req("a", prompt=(1,)), req("b", prompt=(1,), max_tokens=3, ignore_eos=True))
    assert outs["a"].token_ids == [] and outs["a"].finish_reason == "stop"
    assert outs["b"].token_ids == [2, 3, 4] and outs["b"].finish_reason == "length"


def test_stop_token_ids():
    sched, eng = make()
    out = collect(LocalRunner(eng, sched), req("a", max_tokens=20, stop_token_ids=(16,)))["a"]
    assert out.token_ids == [13, 14, 15] and out.finish_reason == "stop"


def test_max_seq_len_stops_with_length():
    sched, eng = make(max_seq_len=8)
    out = collect(LocalRunner(eng, sched), req("a", prompt=(10, 11, 12, 13, 14), max_tokens=50))["a"]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"  # 5 prompt + 3 = max_seq_len


def test_continuous_batching_joins_between_decode_steps():
    sched, eng = make(max_slots=2)
    runner = LocalRunner(eng, sched)
    a_events: list[TokenEvent] = []
    sched.submit(req("a", max_tokens=6), a_events.append)
    runner.step_once()
    runner.step_once()
    b = runner.submit(req("b", prompt=(40,), max_tokens=3))
    runner.run_until_idle()
    plan_with_b = next(p for p in eng.plans if 1 in chunks(p))
    assert decode_rows(plan_with_b) == [0] and plan_with_b.step_id == 2  # b's prompt rides along with a's decode
    assert [e.token_id for e in a_events] == [13, 14, 15, 16, 17, 18]
    assert b.result(5).token_ids == [41, 42, 43]


def test_queue_waits_for_a_free_slot_and_release_is_planned():
    sched, eng = make(max_slots=1)
    outs = collect(LocalRunner(eng, sched), req("a", max_tokens=2), req("b", prompt=(30,), max_tokens=2))
    assert outs["a"].token_ids == [13, 14] and outs["b"].token_ids == [31, 32]
    b_plan = next(p for p in eng.plans if chunks(p) and p.seqs[0].tokens[-1] == 30)
    assert b_plan.release == (0,)  # a's slot is released in the plan that gives it to b


def test_queue_full_error_names_the_limit_and_pickles():
    sched, _ = make(max_queue=2)
    sched.submit(req("a"), lambda e: None)
    sched.submit(req("b"), lambda e: None)
    with pytest.raises(QueueFullError, match=r"queue is full: 2 requests waiting \(max_queue=2\)"):
        sched.submit(req("c"), lambda e: None)
    err = pickle.loads(pickle.dumps(QueueFullError(2, 2)))
    assert isinstance(err, QueueFullError) and err.max_queue == 2 and "max_queue=2" in str(err)


def test_prompt_too_long_and_empty_prompt_messages():
    sched, _ = make(max_seq_len=64)
    with pytest.raises(ValueError, match=r"request x: prompt has 64 tokens, more than the 63 this engine accepts "
                                         r"\(max_seq_len 64, at least one token must be generated\)"):
        sched.submit(req("x", prompt=range(64)), lambda e: None)
    with pytest.raises(ValueError, match="request y: prompt is empty"):
        sched.submit(req("y", prompt=()), lambda e: None)
    with pytest.raises(ValueError, match="max_tokens must be >= 1, found 0"):
        sched.submit(req("z", max_tokens=0), lambda e: None)
    sched2, _ = make(max_seq_len=16)
    with pytest.raises(ValueError, match="prompt has 16 tokens, more than the 15"):  # no room to generate
        sched2.submit(req("w", prompt=range(16)), lambda e: None)
    assert sched.queue_depth == 0


def test_abort_running_request_frees_its_slot_for_the_next():
    sched, eng = make(max_slots=1)
    runner = LocalRunner(eng, sched)
    a = runner.submit(req("a", max_tokens=50))
    b = runner.submit(req("b", prompt=(70,), max_tokens=2))
    runner.step_once()
    runner.step_once()
    assert sched.slots_in_use == 1 and sched.queue_depth == 1
    assert sched.abort("a") is True
    assert sched.slots_in_use == 0
    runner.run_until_idle()
    out_a = a.result(5)
    # the first plan is the prompt alone (its first token), the second a's decode row
    assert out_a.finish_reason == "abort" and out_a.token_ids == [13, 14]
    assert b.result(5).token_ids == [71, 72]
    assert any(p.release == (0,) and any(q.sampling for q in p.seqs) for p in eng.plans)
    assert sched.abort("nope") is False


def test_abort_queued_request():
    sched, eng = make(max_slots=1)
    events: list[TokenEvent] = []
    sched.submit(req("a"), lambda e: None)
    sched.submit(req("b"), events.append)
    assert sched.abort("b")
    assert events == [TokenEvent("b", None, index=0, finish_reason="abort")] and sched.queue_depth == 1


def test_fail_all_ends_everything_with_a_retriable_error():
    sched, eng = make(max_slots=1)
    runner = LocalRunner(eng, sched)
    a, b = runner.submit(req("a", max_tokens=50)), runner.submit(req("b"))
    runner.step_once()
    sched.fail_all("host 1 died", retriable=True)
    for stream in (a, b):
        out = stream.result(5)
        assert out.finish_reason == "error" and out.error == "host 1 died"
    assert sched.slots_in_use == 0 and sched.queue_depth == 0
    assert sched.next_plan().release == (0,)  # the engine's slot is cleared too


def test_engine_failure_fails_requests_and_is_kept():
    class Broken:
        def step(self, plan):
            raise RuntimeError("device lost")

    sched, _ = make()
    runner = LocalRunner(Broken(), sched).start()
    try:
        out = runner.submit(req("a")).result(5)
    finally:
        runner.stop(5)
    assert out.finish_reason == "error" and "device lost" in out.error
    assert isinstance(runner.error, RuntimeError)


def test_threaded_runner_and_stats_with_injected_clock():
    clock = Clock()
    sched, eng = make(clock=clock)
    runner = LocalRunner(eng, sched).start()
    try:
        outs = [runner.submit(req(f"r{i}", prompt=(10 * i + 5,), max_tokens=3)) for i in range(4)]
        got = [o.result(5).token_ids for o in outs]
    finally:
        runner.stop(5)
    assert got == [[10 * i + 6, 10 * i + 7, 10 * i + 8] for i in range(4)]
    stats = sched.stats()
    assert stats["prefills"] == 4 and stats["tokens_generated"] == 12 and stats["ttft_p50_s"] == 0.0
    assert stats["queue_depth"] == 0 and stats["slots_in_use"] == 0


def test_slots_are_filled_in_the_given_order_and_a_bad_order_is_refused():
    eng = PagedTokenEngine(4, 1, 4, 64, 64, 64, next_fn=lambda seq: seq[-1] + 1)
    eng.slot_order = [0, 2, 1, 3]
    sched = paged(eng, max_queue=4)
    outs = collect(LocalRunner(eng, sched), *(req(f"r{i}", prompt=(10 * (i + 1),), max_tokens=2) for i in range(3)))
    assert [outs[f"r{i}"].token_ids for i in range(3)] == [[11, 12], [21, 22], [31, 32]]
    assert chunks(eng.plans[0]) == [0, 2, 1]
    with pytest.raises(ValueError, match=r"slot_order must list each of the 4 slots once, got \[0, 1, 1, 3\]"):
        Scheduler(4, 64, (EOS,), 4, Paging(4, 64, 1, 64), slot_order=[0, 1, 1, 3])


def test_decode_steps_group_tokens_but_not_first_tokens_or_past_the_end():
    sched, eng = make(max_slots=2, max_seq_len=16, decode_steps=4)
    runner = LocalRunner(eng, sched)
    a = runner.submit(req("a", prompt=(10, 11, 12), max_tokens=10))
    runner.step_once()  # a's prompt: one pass, so its first token is not held back
    b = runner.submit(req("b", prompt=(40,), max_tokens=3))
    runner.run_until_idle()
    assert a.result(5).token_ids == list(range(13, 23)) and b.result(5).token_ids == [41, 42, 43]
    assert all(p.decode_steps == 1 for p in eng.plans if chunks(p))  # plans with a prompt pass once
    assert 4 in [p.decode_steps for p in eng.plans]  # plans of decode rows only pass four times
    # never more than the running requests still want: a needs 10 tokens in all
    assert sum(p.decode_steps for p in eng.plans if 0 in [q.slot for q in p.seqs]) == 10
    # never past max_seq_len: a 12-token prompt leaves room for 4 tokens in 16 (the engine checks every write)
    sched, eng = make(max_slots=1, max_seq_len=16, decode_steps=4)
    out = collect(LocalRunner(eng, sched), req("c", prompt=tuple(range(100, 112)), max_tokens=50))
    assert out["c"].token_ids == list(range(112, 116)) and out["c"].finish_reason == "length"
    assert [p.decode_steps for p in eng.plans if p.seqs] == [1, 4]


# -- pages: a token engine that reads its inputs back from its pages ----------------------------------------------
# `PagedTokenEngine` is a paged KV cache whose "K/V" are the token ids themselves: a step writes each new input
# token into the page its slot's row names, and a sampled token is a function of the whole sequence READ BACK
# FROM THE PAGES. A wrong, stale or overwritten page therefore changes the tokens, and the expected tokens of a
# request are those of `alone(prompt, n)`, computed without any paging. It also checks the plan rules the
# real engine checks (one seq per slot, the token budget per dp group, page rows covering every write, multi-step
# plans of decode rows only, sampling on the first chunk).

V = 1000


def next_token(seq) -> int:
    return 3 + sum((i + 1) * int(t) for i, t in enumerate(seq)) % (V - 3)  # never eos (2)


def alone(prompt, n: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(seq))
        seq.append(out[-1])
    return out


class PagedTokenEngine:
    def __init__(self, max_slots=4, groups=2, page_size=4, pages_per_group=32, max_seq_len=64, step_tokens=16,
                 next_fn=next_token):
        self.next_fn = next_fn
        self.max_slots, self.groups, self.page_size = max_slots, groups, page_size
        self.pages_per_group, self.max_seq_len, self.max_step_tokens = pages_per_group, max_seq_len, step_tokens
        self.slots_per_group = max_slots // groups
        self.max_pages_per_seq = -(-max_seq_len // page_size)
        self.slot_order = [g * self.slots_per_group + r for r in range(self.slots_per_group) for g in range(groups)]
        self.eos_ids = (EOS,)
        self.vocab_size, self.window_rings, self.mixed_step_tokens = V, False, None
        self.geometry = SimpleNamespace(max_slots=max_slots, max_seq_len=max_seq_len, page_size=page_size,
                                        pages_per_group=pages_per_group, groups=groups, max_step_tokens=step_tokens,
                                        mixed_step_tokens=None)  # the fields of EngineGeometry the scheduler reads
        self.pool = np.full((groups, pages_per_group, page_size), -1, np.int64)
        self.table = np.full((max_slots, self.max_pages_per_seq), -1, np.int64)
        self.last = np.zeros(max_slots, np.int64)
        self.started = np.zeros(max_slots, bool)
        self.plans: list[StepPlan] = []
        self.writes: list[tuple[int, int]] = []  # (group, page) written, in order

    def _addr(self, slot: int, pos: int) -> tuple[int, int, int]:
        page = int(self.table[slot, pos // self.page_size])
        assert page >= 0, f"slot {slot} writes or reads position {pos} with no page in its row"
        return slot // self.slots_per_group, page, pos % self.page_size

    def _read(self, slot: int, n: int) -> list[int]:
        out = []
        for pos in range(n):
            g, p, o = self._addr(slot, pos)
            out.append(int(self.pool[g, p, o]))
        return out

    def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for s in plan.release:
            self.table[s] = -1
            self.started[s] = False
        for u in plan.pages:
            assert 0 <= u.first and u.first + len(u.pages) <= self.max_pages_per_seq
            assert all(0 <= int(p) < self.pages_per_group for p in u.pages)
            self.table[u.slot, u.first:u.first + len(u.pages)] = u.pages
        slots = [q.slot for q in plan.seqs]
        assert len(slots) == len(set(slots)), "one seq per slot"
        per_group = np.zeros(self.groups, int)
        for q in plan.seqs:
            per_group[q.slot // self.slots_per_group] += q.num_tokens
            if q.sampling is not None:
                self.started[q.slot] = True
            assert self.started[q.slot], f"slot {q.slot} runs before its first chunk carried sampling"
            if plan.decode_steps > 1:
                assert len(q.tokens) == 0 and q.sample
        assert per_group.max(initial=0) <= self.max_step_tokens, per_group
        tokens = np.zeros((plan.decode_steps, len(plan.seqs)), np.int32)
        logprobs = np.asarray([[-0.5 if len(q.tokens) else -0.25 for q in plan.seqs]] * plan.decode_steps,
                              np.float32).reshape(tokens.shape)
        for k in range(plan.decode_steps):
            for i, q in enumerate(plan.seqs):
                new = list(q.tokens) if len(q.tokens) else [int(self.last[q.slot])]
                start = q.start + k
                assert start + len(new) <= self.max_seq_len
                for j, t in enumerate(new):
                    g, p, o = self._addr(q.slot, start + j)
                    self.pool[g, p, o] = t
                    self.writes.append((g, p))
                if q.sample:
                    tokens[k, i] = self.last[q.slot] = self.next_fn(self._read(q.slot, start + len(new)))
        return StepResult(plan.step_id, tokens=tokens, logprobs=logprobs)


def paged(eng: PagedTokenEngine, max_queue=16, decode_steps=1, prefix_caching=True, clock=None) -> Scheduler:
    paging = Paging(eng.page_size, eng.pages_per_group, eng.groups, eng.max_step_tokens, prefix_caching)
    return Scheduler(eng.max_slots, eng.max_seq_len, eng.eos_ids, max_queue, clock=clock or Clock(),
                     slot_order=eng.slot_order, decode_steps=decode_steps, paging=paging)


def prompt_of(n: int, seed: int) -> tuple[int, ...]:
    return tuple(3 + (seed * 131 + 7 * i) % 900 for i in range(n))


def test_paged_tokens_equal_each_request_run_alone():
    eng = PagedTokenEngine()
    sched = paged(eng, decode_steps=3)
    reqs = [req(f"r{i}", prompt=prompt_of(3 + 7 * i, i), max_tokens=5 + i) for i in range(6)]
    outs = collect(LocalRunner(eng, sched), *reqs)
    for r in reqs:
        assert outs[r.request_id].token_ids == alone(r.prompt_token_ids, r.max_tokens)
        assert outs[r.request_id].finish_reason == "length"
    assert outs["r0"].logprobs[:2] == [-0.5, -0.25]
    st = sched.stats()
    assert st["pages_used"] == 0 and st["pages_reserved"] == 0 and st["slots_in_use"] == 0
    assert st["prefills"] == 6 and st["tokens_generated"] == sum(r.max_tokens for r in reqs)


def test_chunked_prefill_rides_with_decode_rows_within_the_token_budget():
    eng = PagedTokenEngine(max_slots=2, groups=1, step_tokens=8)
    sched = paged(eng)
    runner = LocalRunner(eng, sched)
    a = runner.submit(req("a", prompt=prompt_of(3, 1), max_tokens=12))
    runner.step_once()
    long_prompt = prompt_of(30, 2)
    b = runner.submit(req("b", prompt=long_prompt, max_tokens=2))
    runner.run_until_idle()
    assert a.result(5).token_ids == alone(prompt_of(3, 1), 12)
    assert b.result(5).token_ids == alone(long_prompt, 2)
    b_steps = [(p, q) for p in eng.plans for q in p.seqs if q.slot == 1]
    chunks = [q for _, q in b_steps if len(q.tokens)]
    # a decodes in every step while b's 30 prompt tokens go in chunks of 7 (8 minus a's decode row)
    assert [len(q.tokens) for q in chunks] == [7, 7, 7, 7, 2]
    assert [q.start for q in chunks] == [0, 7, 14, 21, 28]
    assert [q.sample for q in chunks] == [False] * 4 + [True]
    assert chunks[0].sampling is not None and all(q.sampling is None for q in chunks[1:])
    for p, _ in b_steps[:5]:
        assert any(x.slot == 0 and len(x.tokens) == 0 for x in p.seqs), "a's decode row rides in every step"


def test_an_arrival_takes_a_free_slot_at_once_and_prefills_when_its_group_has_budget():
    eng = PagedTokenEngine(max_slots=3, groups=1, step_tokens=8)
    sched = paged(eng)
    runner = LocalRunner(eng, sched)
    a = runner.submit(req("a", prompt=prompt_of(3, 1), max_tokens=10))
    runner.step_once()
    b = runner.submit(req("b", prompt=prompt_of(20, 2), max_tokens=3))
    runner.step_once()  # a's decode row + 7 of b's tokens: the step's budget is spent
    c = runner.submit(req("c", prompt=prompt_of(6, 3), max_tokens=3))
    runner.step_once()  # c gets its slot and pages (it does not count as queued) but no tokens yet
    assert sched.queue_depth == 0 and sched.slots_in_use == 3
    assert [(q.slot, len(q.tokens)) for q in eng.plans[-1].seqs] == [(1, 7), (0, 0)]
    runner.run_until_idle()
    c_chunks = [(i, q) for i, p in enumerate(eng.plans) for q in p.seqs if q.slot == 2]
    b_last = max(i for i, p in enumerate(eng.plans) for q in p.seqs if q.slot == 1 and len(q.tokens))
    assert c_chunks[0][0] == b_last  # c starts in the step that finishes b's prompt, with the budget left
    assert c_chunks[0][1].sampling is not None and len(c_chunks[0][1].tokens) == 8 - 1 - 6
    for name, stream, prompt, n in (("a", a, prompt_of(3, 1), 10), ("b", b, prompt_of(20, 2), 3),
                                    ("c", c, prompt_of(6, 3), 3)):
        assert stream.result(5).token_ids == alone(prompt, n), name


def test_steps_with_decode_rows_cap_prompt_tokens_at_the_mixed_step_size():
    eng = PagedTokenEngine(max_slots=4, groups=2, step_tokens=16)
    paging = Paging(eng.page_size, eng.pages_per_group, eng.groups, eng.max_step_tokens, True, mixed_step_tokens=6)
    sched = Scheduler(eng.max_slots, eng.max_seq_len, eng.eos_ids, 8, clock=Clock(), slot_order=eng.slot_order,
                      paging=paging)
    runner = LocalRunner(eng, sched)
    a = runner.submit(req("a", prompt=prompt_of(20, 1), max_tokens=12))  # group 0
    runner.step_once()
    runner.step_once()
    long_prompt = prompt_of(40, 2)
    b = runner.submit(req("b", prompt=long_prompt, max_tokens=2))  # group 1 (fewer running)
    c = runner.submit(req("c", prompt=prompt_of(30, 3), max_tokens=2))
    runner.run_until_idle()
    assert [len(q.tokens) for p in eng.plans[:2] for q in p.seqs] == [16, 4]  # alone, a prompt takes whole chunks
    for p in eng.plans[2:]:
        per_group = [0, 0]
        for q in p.seqs:
            per_group[q.slot // 2] += q.num_tokens
        decoding = any(len(q.tokens) == 0 for q in p.seqs)
        # while any group decodes, every group stays within the mixed step; otherwise a whole chunk
        assert max(per_group) <= (6 if decoding else 16), (per_group, decoding)
    assert a.result(5).token_ids == alone(prompt_of(20, 1), 12)
    assert b.result(5).token_ids == alone(long_prompt, 2) and c.result(5).token_ids == alone(prompt_of(30, 3), 2)


class TimedEngine(PagedTokenEngine):
    """A paged token engine whose steps take simulated time: `decode_s` per decode pass of a decode-only plan,
    `chunk_s` for a step that carries prompt tokens, and `plan_s` more for any plan (gathering its inputs, the
    hosts' round trip, streaming its tokens); after each plan a decode pass costs `pass_growth` times more for each
    of its passes (the streams' keys grow)."""

    def __init__(self, clock: Clock, decode_s: float, chunk_s: float, growth_s: float = 0.0, plan_s: float = 0.0,
                 pass_growth: float = 1.0, **kw) -> None:
        super().__init__(**kw)
        self.clock, self.decode_s, self.chunk_s, self.growth_s = clock, decode_s, chunk_s, growth_s
        self.plan_s, self.pass_growth = plan_s, pass_growth

    def step(self, plan: StepPlan) -> StepResult:
        out = super().step(plan)
        chunk = any(len(q.tokens) for q in plan.seqs)
        self.clock.t += self.plan_s + (self.chunk_s if chunk else self.decode_s * plan.decode_steps)
        self.chunk_s += self.growth_s if chunk else 0.0  # later chunks attend to more keys
        self.decode_s *= self.pass_growth ** plan.decode_steps
        return out


def _limited(eng: TimedEngine, clock: Clock, limit: float, decode_steps: int = 4) -> tuple[Scheduler, LocalRunner]:
    """A paged scheduler with `max_decode_slowdown` = limit over a timed engine, and its runner."""
    paging = Paging(eng.page_size, eng.pages_per_group, eng.groups, eng.max_step_tokens, True,
                    max_decode_slowdown=limit)
    sched = Scheduler(eng.max_slots, eng.max_seq_len, eng.eos_ids, 8, clock=clock, slot_order=eng.slot_order,
                      decode_steps=decode_steps, paging=paging)
    return sched, LocalRunner(eng, sched)


def _held_run(limit: float, chunk_s: float, decode_steps: int = 4, growth_s: float = 0.0, plan_s: float = 0.0):
    clock = Clock()
    eng = TimedEngine(clock, 1.0, chunk_s, growth_s, plan_s, max_slots=3, groups=1, step_tokens=8, max_seq_len=128,
                      pages_per_group=64)
    sched, runner = _limited(eng, clock, limit, decode_steps)
    a = runner.submit(req("a", prompt=prompt_of(3, 1), max_tokens=100))
    for _ in range(4):  # a decodes alone: the decode pass time is measured
        runner.step_once()
    long_prompt = prompt_of(60, 2)
    b = runner.submit(req("b", prompt=long_prompt, max_tokens=2))
    arrive = clock.t
    while not any(q.slot == 1 and q.sample for q in eng.plans[-1].seqs):  # until b's last chunk
        runner.step_once()
    first_b = clock.t
    runner.run_until_idle()
    assert a.result(5).token_ids == alone(prompt_of(3, 1), 100)
    assert b.result(5).token_ids == alone(long_prompt, 2)
    chunk_plans = [i for i, p in enumerate(eng.plans) if any(q.slot == 1 and len(q.tokens) for q in p.seqs)]
    held = [sum(p.decode_steps for p in eng.plans[i + 1:j]) for i, j in zip(chunk_plans, chunk_plans[1:],
                                                                              strict=False)]
    a_tokens_during = sum(p.decode_steps for p in eng.plans[chunk_plans[0]:chunk_plans[-1] + 1]
                          if any(q.slot == 0 for q in p.seqs))
    return eng, held, (first_b - arrive) / a_tokens_during, sched


@pytest.mark.parametrize("limit,chunk_s,steady", [(2.0, 4.0, 2), (1.5, 4.0, 5), (3.0, 4.0, 0.5), (2.0, 1.5, 0),
                                                  (0.0, 4.0, 0)])
def test_a_long_prompt_beside_decoding_streams_waits_as_many_passes_as_the_slowdown_limit_needs(limit, chunk_s,
                                                                                                 steady):
    eng, held, tpot, sched = _held_run(limit, chunk_s)
    assert sched.decode_pass_s == pytest.approx(1.0) and sched.chunk_step_s == pytest.approx(chunk_s)
    # a chunk step of M seconds beside decode passes of 1 s: the streams stay within the limit when each chunk
    # step is followed by (M - limit) / (limit - 1) decode passes on average (the first wait is longer: it
    # also pays for the first chunk step, which ran before any was measured)
    assert sum(held[1:]) / len(held[1:]) == pytest.approx(steady, abs=0.15), held
    assert held[0] >= held[1]
    for p in eng.plans:  # only decode rows between two chunks, never more than decode_steps
        if not any(len(q.tokens) for q in p.seqs):
            assert p.decode_steps <= 4
    # a's mean time per token from b's first chunk to its last: within the limit, or a chunk every step
    assert tpot <= (limit if limit else chunk_s) + 1e-9, tpot
    if limit and steady:
        assert tpot >= 0.9 * limit, tpot  # and not held back more than the limit needs


@pytest.mark.parametrize("growth_s", [0.5, 1.0])
def test_growing_chunk_steps_are_paid_for_in_advance(growth_s):
    _, held, tpot, _ = _held_run(2.0, 3.0, growth_s=growth_s)
    assert tpot <= 2.0 + 1e-9, (tpot, held)
    assert held[1:] == sorted(held[1:]), held  # dearer chunk steps, longer waits


@pytest.mark.parametrize("plan_s", [2.0, 4.0, 8.0])
def test_a_held_prompt_progresses_when_every_plan_has_a_fixed_cost(plan_s):
    # Each plan costs plan_s beyond its passes, so the pace before the prompt (plans of 4 passes) is
    # 1 + plan_s / 4 s per token, and a plan of fewer passes runs slower per token than that. Holding the
    # prompt in such short plans costs the streams more time per token than it saves them: the prompt must still
    # go on, and the streams stay within the limit.
    _, held, tpot, sched = _held_run(2.0, 4.0 + plan_s, plan_s=plan_s)
    assert sched.decode_pass_s == pytest.approx(1.0 + plan_s / 4)
    assert tpot <= 2.0 * sched.decode_pass_s + 1e-9, (tpot, held)
    assert 1 < sched.held_floor <= 4, sched.held_floor  # the plans cut short to one pass were too dear
    assert max(held) < 24, held  # (in one-pass plans the prompt waited until a's 100 tokens were done)


def test_a_held_prompt_progresses_while_the_streams_passes_slow_past_the_limit():
    # the streams' passes slow as their keys grow (here 2% a pass, from 1 s): after ~35 passes a pass alone
    # takes the limit's 2x the pace measured before the prompt, so waiting for that pace would hold the prompt
    # until the stream ends. The pace follows the passes between chunks instead, and the prompt goes on.
    clock = Clock()
    eng = TimedEngine(clock, 1.0, 6.0, pass_growth=1.02, max_slots=3, groups=1, step_tokens=8, max_seq_len=1024,
                      pages_per_group=300)
    sched, runner = _limited(eng, clock, 2.0)
    a = runner.submit(req("a", prompt=prompt_of(3, 1), max_tokens=600))
    for _ in range(2):
        runner.step_once()
    b = runner.submit(req("b", prompt=prompt_of(120, 2), max_tokens=2))
    n0 = len(eng.plans)
    while not any(q.slot == 1 and q.sample for q in eng.plans[-1].seqs):
        runner.step_once()
    a_passes = sum(p.decode_steps for p in eng.plans[n0:])
    assert a_passes < 300, a_passes  # b's first token long before a's 600 (held to a's end without the fix)
    chunks = [p for p in eng.plans[n0:] if any(q.slot == 1 and len(q.tokens) for q in p.seqs)]
    assert len(chunks) == -(-120 // 7)
    runner.run_until_idle()
    assert a.result(5).token_ids == alone(prompt_of(3, 1), 600)
    assert b.result(5).token_ids == alone(prompt_of(120, 2), 2)


def test_passes_between_chunks_do_not_move_the_pace_the_limit_refers_to():
    # decode passes run 30% slower once the long prompt's chunk steps start (caches the chunk steps evicted),
    # and a chunk step costs 12 passes, so whole plans of decode_steps passes run between chunks:
    # the limit still holds against the pace before the prompt arrived, not against the slower one
    clock = Clock()

    class Slower(TimedEngine):
        def step(self, plan: StepPlan) -> StepResult:
            if any(q.slot == 1 for q in plan.seqs):
                self.decode_s = 1.3
            return super().step(plan)

    eng = Slower(clock, 1.0, 12.0, max_slots=3, groups=1, step_tokens=8, max_seq_len=512, pages_per_group=300)
    sched, runner = _limited(eng, clock, 2.0)
    a = runner.submit(req("a", prompt=prompt_of(3, 1), max_tokens=400))
    for _ in range(4):
        runner.step_once()
    b = runner.submit(req("b", prompt=prompt_of(60, 2), max_tokens=2))
    arrive, n0 = clock.t, len(eng.plans)
    while not any(q.slot == 1 and q.sample for q in eng.plans[-1].seqs):
        runner.step_once()
    passes = sum(p.decode_steps for p in eng.plans[n0:])
    assert sched.decode_pass_s == pytest.approx(1.0)
    assert (clock.t - arrive) / passes <= 2.0 + 1e-9, (clock.t - arrive) / passes
    assert all(any(q.slot == 0 for q in p.seqs) for p in eng.plans[n0:])  # a decoded beside every chunk
    runner.run_until_idle()
    assert a.result(5).token_ids == alone(prompt_of(3, 1), 400)
    assert b.result(5).token_ids == alone(prompt_of(60, 2), 2)
    assert sched.decode_pass_s > 1.0  # once no prompt prefills, the slower passes count again


def test_a_prompt_that_fits_a_step_is_not_held_when_others_split_it():
    # b and c (6 tokens each) arrive together beside a decoding stream: the step's 7 free tokens take b whole and
    # c's first token; c's other 5 go in the next step although chunk steps are dear (a long prompt would wait)
    clock = Clock()
    eng = TimedEngine(clock, 1.0, 4.0, max_slots=3, groups=1, step_tokens=8, max_seq_len=64, pages_per_group=64)
    sched, runner = _limited(eng, clock, 2.0)
    a = runner.submit(req("a", prompt=prompt_of(3, 1), max_tokens=40))
    for _ in range(3):
        runner.step_once()
    runner.submit(req("x", prompt=prompt_of(20, 4), max_tokens=1))  # a chunk step is timed: 4 passes' worth
    while sched.chunk_step_s is None or sched._prefilling:
        runner.step_once()
    b = runner.submit(req("b", prompt=prompt_of(6, 2), max_tokens=2))
    c = runner.submit(req("c", prompt=prompt_of(6, 3), max_tokens=2))
    runner.step_once()
    assert sorted(len(q.tokens) for q in eng.plans[-1].seqs) == [0, 1, 6]  # a decodes, b whole, c's first token
    assert sched.pacing.wait_passes() > 0  # a long prompt would be held now
    runner.step_once()
    assert sorted(len(q.tokens) for q in eng.plans[-1].seqs) == [0, 0, 5]  # c's rest, at once
    runner.run_until_idle()
    for name, stream, prompt, n in (("a", a, prompt_of(3, 1), 40), ("b", b, prompt_of(6, 2), 2),
                                    ("c", c, prompt_of(6, 3), 2)):
        assert stream.result(5).token_ids == alone(prompt, n), name


def test_held_prompts_do_not_hold_back_new_prompts_or_a_prompt_alone():
    clock = Clock()
    eng = TimedEngine(clock, 1.0, 10.0, max_slots=3, groups=1, step_tokens=8)
    sched, runner = _limited(eng, clock, 2.0)
    a = runner.submit(req("a", prompt=prompt_of(30, 1), max_tokens=30))
    for _ in range(4):  # alone, a's prompt goes in whole chunks, one step after another
        runner.step_once()
    assert [len(q.tokens) for p in eng.plans for q in p.seqs] == [8, 8, 8, 6]
    runner.step_once()  # a decodes: its pass is timed
    b = runner.submit(req("b", prompt=prompt_of(30, 2), max_tokens=2))
    for _ in range(3):  # b's first two chunks (the first is not timed yet), then b waits
        runner.step_once()
    assert all(len(q.tokens) == 0 for q in eng.plans[-1].seqs)
    c = runner.submit(req("c", prompt=prompt_of(5, 3), max_tokens=2))  # fits one step: starts at once
    runner.step_once()
    assert [(q.slot, len(q.tokens)) for q in eng.plans[-1].seqs] == [(2, 5), (0, 0)]
    runner.run_until_idle()
    for name, stream, prompt, n in (("a", a, prompt_of(30, 1), 30), ("b", b, prompt_of(30, 2), 2),
                                    ("c", c, prompt_of(5, 3), 2)):
        assert stream.result(5).token_ids == alone(prompt, n), name


def test_many_arriving_prompts_prefill_together_on_the_group_that_owns_their_slot():
    eng = PagedTokenEngine(max_slots=4, groups=2, step_tokens=16)
    sched = paged(eng)
    reqs = [req(f"r{i}", prompt=prompt_of(5, i), max_tokens=3) for i in range(4)]
    outs = collect(LocalRunner(eng, sched), *reqs)
    first = eng.plans[0]  # all four prompts in the first step, two on each dp group, each only there
    assert [q.slot for q in first.seqs] == [0, 2, 1, 3] and all(q.sample and q.start == 0 for q in first.seqs)
    assert sorted(u.slot for u in first.pages) == [0, 1, 2, 3]
    assert sorted(g for g, _ in eng.writes[:20]) == [0] * 10 + [1] * 10
    for r in reqs:
        assert outs[r.request_id].token_ids == alone(r.prompt_token_ids, 3)


def test_a_burst_spreads_over_the_groups_when_the_cached_prefix_is_worth_less_than_the_imbalance():
    # one request warms group 0's cache with a one-page system prefix; then 4 prompts arrive together. Each costs
    # 6 tokens on group 0 and 10 on group 1: piling all four onto group 0 (24 tokens, group 1 idle) makes a longer
    # step than three there and one on group 1 (18 and 10; two on each would be 12 and 20)
    eng = PagedTokenEngine(max_slots=8, groups=2, step_tokens=32)
    sched = paged(eng)
    runner = LocalRunner(eng, sched)
    system = prompt_of(4, 7)
    collect(runner, req("warm", prompt=system + (5, 6), max_tokens=1))
    n_plans = len(eng.plans)
    burst = [req(f"b{i}", prompt=system + prompt_of(6, i), max_tokens=2) for i in range(4)]
    outs = collect(runner, *burst)
    first = eng.plans[n_plans]
    per_group = [sum(len(q.tokens) for q in first.seqs if q.slot // 4 == g) for g in (0, 1)]
    assert len(first.seqs) == 4 and per_group == [18, 10], per_group
    assert {q.start for q in first.seqs if q.slot // 4 == 0} == {4}  # group 0's prompts reuse the cached page
    for r in burst:
        assert outs[r.request_id].token_ids == alone(r.prompt_token_ids, 2)
    # a long cached prefix still draws prompts to its group: computing it elsewhere costs more than sharing a step
    long_system = prompt_of(20, 8)
    n_plans = len(eng.plans)
    collect(runner, req("warm2", prompt=long_system + (5,), max_tokens=1))
    warmed = eng.plans[n_plans].seqs[0].slot // 4
    n_plans = len(eng.plans)
    outs = collect(runner, *[req(f"c{i}", prompt=long_system + (30 + i,), max_tokens=1) for i in range(3)])
    assert [q.slot // 4 for q in eng.plans[n_plans].seqs] == [warmed] * 3
    assert all(q.start == 20 for q in eng.plans[n_plans].seqs)


def test_streams_whose_prompts_one_group_cached_still_split_evenly_over_the_groups():
    # 4 prompts run one at a time first: each lands in group 0 and caches its 2 full pages there. Sent again
    # together as streams of 24 tokens, each costs 1 token on group 0 and 9 on group 1 this step, but a third
    # or fourth row in group 0 would add a row to each of the 23 passes after it: two go to each group.
    eng = PagedTokenEngine(max_slots=8, groups=2, step_tokens=16)
    sched = paged(eng)
    runner = LocalRunner(eng, sched)
    prompts = [prompt_of(9, 40 + i) for i in range(4)]
    for i, prompt in enumerate(prompts):
        n_plans = len(eng.plans)
        collect(runner, req(f"warm{i}", prompt=prompt, max_tokens=1))
        assert eng.plans[n_plans].seqs[0].slot // 4 == 0
    n_plans = len(eng.plans)
    streams = [req(f"s{i}", prompt=prompt, max_tokens=24) for i, prompt in enumerate(prompts)]
    running = [runner.submit(r) for r in streams]
    runner.step_once()
    assert sched.stats()["slots_in_use_per_group"] == [2, 2]  # what /status shows
    runner.run_until_idle()
    outs = {r.request_id: s.result(5) for r, s in zip(streams, running, strict=True)}
    first = eng.plans[n_plans]
    assert sorted(q.slot // 4 for q in first.seqs) == [0, 0, 1, 1], [q.slot for q in first.seqs]
    assert all(q.start == 8 for q in first.seqs if q.slot // 4 == 0)  # group 0's reuse their cached pages
    most = max(max(sum(q.slot // 4 == g for q in pl.seqs) for g in (0, 1)) for pl in eng.plans[n_plans:])
    assert most == 2  # no plan after it runs more than 2 rows in a group
    for r in streams:
        assert outs[r.request_id].token_ids == alone(r.prompt_token_ids, 24)


def test_prefix_cache_reuses_full_pages_and_starts_after_them():
    eng = PagedTokenEngine(max_slots=2, groups=1)
    sched = paged(eng)
    system = prompt_of(18, 5)  # 4 full pages of 4 + 2 tokens
    first = req("a", prompt=system + (11, 12), max_tokens=4)
    runner = LocalRunner(eng, sched)
    assert collect(runner, first)["a"].token_ids == alone(first.prompt_token_ids, 4)
    n_plans = len(eng.plans)
    a_row = [int(p) for pl in eng.plans for u in pl.pages for p in u.pages]
    second = req("b", prompt=system + (21, 22, 23), max_tokens=4)
    assert collect(runner, second)["b"].token_ids == alone(second.prompt_token_ids, 4)
    q = eng.plans[n_plans].seqs[0]
    assert q.start == 16 and list(q.tokens) == list(system[16:]) + [21, 22, 23]  # 4 pages reused
    assert list(q.prefix_tokens) == list(system[:16]) and q.sampling is not None
    row = [int(p) for p in eng.plans[n_plans].pages[0].pages]
    assert row[:4] == a_row[:4] and row[4] != a_row[4]  # a's 5th page holds a's tokens 16-19: b has its own
    st = sched.stats()
    assert st["prefix_cache_hits"] == 4 and st["prefix_cache_misses"] == 4 + 1 and st["prefix_hit_tokens"] == 16
    assert st["prefill_tokens"] == 20 + 5


def test_divergence_mid_page_recomputes_that_page_and_leaves_the_cached_one_intact():
    eng = PagedTokenEngine(max_slots=2, groups=1)
    sched = paged(eng)
    base = prompt_of(17, 9)
    runner = LocalRunner(eng, sched)
    a = runner.submit(req("a", prompt=base, max_tokens=20))  # stays running while b diverges from it
    runner.step_once()
    runner.step_once()
    diverged = base[:6] + (999,) + base[7:]  # differs at position 6, inside page 1
    b = runner.submit(req("b", prompt=diverged, max_tokens=6))
    runner.run_until_idle()
    assert a.result(5).token_ids == alone(base, 20)
    assert b.result(5).token_ids == alone(diverged, 6)
    b_first = next(q for p in eng.plans for q in p.seqs if q.slot == 1)
    assert b_first.start == 4  # only page 0 is shared; page 1 is b's own and recomputed from position 4
    # a third request with a's prompt still finds all of a's pages intact
    n_plans = len(eng.plans)
    c = req("c", prompt=base, max_tokens=3)
    assert collect(runner, c)["c"].token_ids == alone(base, 3)
    assert eng.plans[n_plans].seqs[0].start == 16


def test_prefix_caching_off_reuses_nothing():
    eng = PagedTokenEngine(max_slots=2, groups=1)
    sched = paged(eng, prefix_caching=False)
    p = prompt_of(20, 3)
    runner = LocalRunner(eng, sched)
    outs = collect(runner, req("a", prompt=p, max_tokens=2))
    outs.update(collect(runner, req("b", prompt=p, max_tokens=2)))
    assert outs["a"].token_ids == outs["b"].token_ids == alone(p, 2)
    assert [q.start for pl in eng.plans for q in pl.seqs if q.sampling is not None] == [0, 0]
    st = sched.stats()
    assert st["prefix_cache_hits"] == 0 and st["prefix_cache_misses"] == 0 and st["pages_cached_idle"] == 0


def test_exhausted_pool_queues_requests_that_complete_later_unchanged():
    # 8 pages of 4 tokens: each request below reserves 4 pages (prompt 6 + 10 new), so two run at a time
    eng = PagedTokenEngine(max_slots=4, groups=1, pages_per_group=8, max_seq_len=32)
    sched = paged(eng)
    reqs = [req(f"r{i}", prompt=prompt_of(6, 20 + i), max_tokens=10) for i in range(4)]
    runner = LocalRunner(eng, sched)
    streams = [runner.submit(r) for r in reqs]
    runner.step_once()
    assert sched.slots_in_use == 2 and sched.queue_depth == 2  # slots are free, pages are not
    assert sched.stats()["pages_reserved"] + sched.stats()["pages_used"] == 8
    runner.run_until_idle()
    for r, s in zip(reqs, streams, strict=True):
        out = s.result(5)
        assert out.token_ids == alone(r.prompt_token_ids, 10) and out.finish_reason == "length"
    assert max(sum(1 for q in p.seqs) for p in eng.plans) == 2
    st = sched.stats()
    assert st["pages_used"] == 0 and st["pages_reserved"] == 0


def test_cached_pages_are_evicted_oldest_first_when_new_requests_need_room():
    eng = PagedTokenEngine(max_slots=2, groups=1, pages_per_group=10, max_seq_len=40)
    sched = paged(eng)
    runner = LocalRunner(eng, sched)
    pa, pb = prompt_of(17, 1), prompt_of(30, 2)
    collect(runner, req("a", prompt=pa, max_tokens=2))  # 4 full prompt pages of a stay cached
    assert sched.stats()["pages_cached_idle"] == 4
    collect(runner, req("b", prompt=pb, max_tokens=8))  # needs 10 pages: all of a's cached pages are evicted
    st = sched.stats()
    assert st["prefix_cache_evictions"] == 4 and st["pages_used"] == 0
    n_plans = len(eng.plans)
    again = collect(runner, req("a2", prompt=pa, max_tokens=2))["a2"]
    assert again.token_ids == alone(pa, 2)
    assert eng.plans[n_plans].seqs[0].start == 0  # nothing of a was left to reuse
    n_plans = len(eng.plans)
    b2 = collect(runner, req("b2", prompt=pb, max_tokens=2))["b2"]  # b's head pages outlived its tail
    assert b2.token_ids == alone(pb, 2) and 0 < eng.plans[n_plans].seqs[0].start < 28


def test_request_that_can_never_fit_the_pool_is_refused_with_the_reason():
    eng = PagedTokenEngine(max_slots=2, groups=1, pages_per_group=4, max_seq_len=64)
    sched = paged(eng)
    with pytest.raises(ValueError, match=r"request big: needs up to 5 KV pages of 4 tokens \(prompt 10 \+ max_tokens "
                                          r"10\), more than the 4 pages of a dp group's pool \(engine.num_pages\)"):
        sched.submit(req("big", prompt=prompt_of(10, 1), max_tokens=10), lambda e: None)
    with pytest.raises(ValueError, match=r"prompt has 64 tokens, more than the 63 this engine accepts \(max_seq_len "
                                          r"64, at least one token"):
        sched.submit(req("long", prompt=prompt_of(64, 1)), lambda e: None)
    assert sched.queue_depth == 0


def test_abort_and_stop_return_pages_and_keep_computed_full_pages_cached():
    eng = PagedTokenEngine(max_slots=2, groups=1, step_tokens=8)
    sched = paged(eng)
    runner = LocalRunner(eng, sched)
    p = prompt_of(20, 4)
    a = runner.submit(req("a", prompt=p, max_tokens=50))
    runner.step_once()  # 8 prompt tokens computed: pages 0 and 1 full
    assert sched.stats()["pages_reserved"] > 0
    assert sched.abort("a") is True
    assert a.result(5).finish_reason == "abort"
    st = sched.stats()
    assert st["pages_used"] == 0 and st["pages_reserved"] == 0 and st["pages_cached_idle"] == 2
    nxt = sched.next_plan()
    assert nxt is not None and nxt.release == (0,) and not nxt.seqs
    sched.on_result(nxt, eng.step(nxt))
    # a stop token ends a request and frees its pages
    stop_at = alone(p, 3)[2]
    assert stop_at not in alone(p, 2)
    n_plans = len(eng.plans)
    out = collect(runner, req("b", prompt=p, max_tokens=10, stop_token_ids=(stop_at,)))["b"]
    assert out.token_ids == alone(p, 2) and out.finish_reason == "stop"
    assert eng.plans[n_plans].seqs[0].start == 8  # the 2 pages a computed before its abort are reused
    assert sched.stats()["pages_used"] == 0 and sched.stats()["prefix_cache_hits"] == 2


def test_fail_all_forgets_the_prefix_cache_and_releases_every_slot():
    eng = PagedTokenEngine(max_slots=2, groups=1)
    sched = paged(eng)
    runner = LocalRunner(eng, sched)
    p = prompt_of(12, 6)
    collect(runner, req("a", prompt=p, max_tokens=2))
    b = runner.submit(req("b", prompt=p, max_tokens=30))
    runner.step_once()
    sched.fail_all("host 1 died", retriable=True)
    assert b.result(5).finish_reason == "error"
    st = sched.stats()
    assert st["pages_used"] == 0 and st["pages_cached_idle"] == 0 and st["pages_free"] == eng.pages_per_group
    plan = sched.next_plan()
    assert plan is not None and plan.release == (0, 1)


def test_paged_multi_step_decode_stays_within_reservations_and_max_seq_len():
    eng = PagedTokenEngine(max_slots=2, groups=1, max_seq_len=24)
    sched = paged(eng, decode_steps=4)
    reqs = [req("a", prompt=prompt_of(5, 1), max_tokens=9), req("b", prompt=prompt_of(17, 2), max_tokens=50)]
    outs = collect(LocalRunner(eng, sched), *reqs)
    assert outs["a"].token_ids == alone(reqs[0].prompt_token_ids, 9)
    assert outs["b"].token_ids == alone(reqs[1].prompt_token_ids, 7) and outs["b"].finish_reason == "length"
    assert 4 in [p.decode_steps for p in eng.plans]
    assert all(p.decode_steps == 1 for p in eng.plans if any(len(q.tokens) for q in p.seqs))


def test_paging_checks_its_engine_figures():
    with pytest.raises(ValueError, match="max_slots 4 does not divide over 3 dp groups"):
        Scheduler(4, 64, (EOS,), 4, paging=Paging(4, 8, 3, 16))
    with pytest.raises(ValueError, match=r"max_step_tokens=1 tokens per dp group in a step cannot hold a decode "
                                         r"row for each of the group's 2 slots \(engine.prefill_chunk is too small\)"):
        Scheduler(4, 64, (EOS,), 4, paging=Paging(4, 8, 2, 1))
    with pytest.raises(ValueError, match=r"mixed_step_tokens=1 tokens per dp group"):
        Scheduler(4, 64, (EOS,), 4, paging=Paging(4, 8, 2, 16, mixed_step_tokens=1))


def test_for_engine_sizes_the_scheduler_from_the_engine_and_the_config():
    from raydeploy.config import Config

    eng = PagedTokenEngine()
    sched = Scheduler.for_engine(eng, Config())
    assert sched.paging == Paging(4, 32, 2, 16, True, max_decode_slowdown=1.6, burst_wait=1.0) and len(sched.pools) == 2
    assert sched.max_prompt_len == 63 and sched.vocab_size == V
    eng.window_rings = True  # sliding-window rings cannot reuse a prefix
    assert not Scheduler.for_engine(eng, Config()).paging.prefix_caching


# -- the paged form on the real demo model ---------------------------------------------------------------------
# One small paged Engine (max_seq_len 512, chunks of 128 tokens) serves both tests; the scheduler decides every
# plan. Expected tokens come from the same engine driven by a scheduler without the feature under test (no
# prefix cache; a pool large enough for everything), so the comparison is exact.

SYSTEM = ("You are the support assistant of a company that rents bicycles in a small coastal town. "
          "Answer briefly and politely. Opening hours are 8 to 18 on weekdays and 9 to 17 on weekends. "
          "A city bike costs 12 euros a day, an electric bike 30 euros a day, a tandem 25 euros a day. "
          "Helmets and locks are free. Children under 12 ride only with an adult. Returns after closing time "
          "cost one extra day. Lost keys cost 20 euros. Rentals of a week get one day free. ")


class Recording:
    """An engine that keeps every plan it ran."""

    def __init__(self, engine) -> None:
        self.engine, self.plans = engine, []

    def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        return self.engine.step(plan)


@pytest.fixture(scope="module")
def real_paged(demo_checkpoint):
    import jax
    from transformers import AutoTokenizer

    from raydeploy.checkpoint.reader import CheckpointReader
    from raydeploy.config import Config, EngineConfig, ModelConfig
    from raydeploy.engine.engine import Engine
    from raydeploy.model.registry import from_hf_config
    from raydeploy.model.sharding import build_mesh, merge_rules

    mesh = build_mesh({"dp": 1}, jax.devices()[:1])
    rules = merge_rules({})
    reader = CheckpointReader(demo_checkpoint)
    params, _ = reader.load(reader.param_specs(), mesh, rules, "float32", 4, progress=False)
    cfg = Config(model=ModelConfig(max_seq_len=512),
                 engine=EngineConfig(max_slots=4, max_new_tokens=64, prefill_chunk=128,
                                     decode_steps=4))
    engine = Engine(*from_hf_config(reader.hf_config), params, mesh, rules, cfg.model, cfg.engine)
    tok = AutoTokenizer.from_pretrained(str(demo_checkpoint), local_files_only=True)
    return engine, tok, cfg


def _chat(tok, system: str | None, user: str) -> tuple[int, ...]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return tuple(int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids))


def _real_sched(engine, cfg, prefix_caching=True, pages_per_group=None) -> Scheduler:
    paging = Paging(engine.page_size, pages_per_group or engine.pages_per_group, engine.groups,
                    engine.max_step_tokens, prefix_caching)
    return Scheduler(engine.max_slots, engine.max_seq_len, engine.eos_ids, 16, clock=Clock(),
                     slot_order=engine.slot_order, decode_steps=cfg.engine.decode_steps, paging=paging)


@pytest.mark.model
def test_real_model_second_request_with_the_same_system_prompt_reuses_its_pages(real_paged):
    engine, tok, cfg = real_paged
    serving = Scheduler.for_engine(engine, cfg)  # what the gang and `raydeploy generate` build
    assert serving.paging == Paging(16, engine.pages_per_group, 1, 128, True, mixed_step_tokens=32,
                                    max_decode_slowdown=1.6, burst_wait=1.0)
    system = (SYSTEM * 5)[:1600]  # about 430 tokens
    a_ids = _chat(tok, system, "How much is an electric bike for two days?")
    b_ids = _chat(tok, system, "Can my 10 year old son ride alone?")
    common = next(i for i, (x, y) in enumerate(zip(a_ids, b_ids, strict=False)) if x != y)
    assert common >= 400, f"the shared system prompt has {common} tokens"
    eng = Recording(engine)
    sched = _real_sched(engine, cfg)
    runner = LocalRunner(eng, sched)
    a = collect(runner, req("a", prompt=a_ids, max_tokens=32))["a"]
    hits_before = sched.stats()["prefix_cache_hits"]
    n_plans = len(eng.plans)
    b = collect(runner, req("b", prompt=b_ids, max_tokens=32))["b"]
    b_first = next(q for p in eng.plans[n_plans:] for q in p.seqs if q.sampling is not None)
    ps = engine.page_size
    assert b_first.start == common // ps * ps  # every full page of the shared prefix was reused
    assert sched.stats()["prefix_cache_hits"] - hits_before == common // ps
    n_plans = len(eng.plans)
    a_again = collect(runner, req("a2", prompt=a_ids, max_tokens=32))["a2"]
    assert next(q for p in eng.plans[n_plans:] for q in p.seqs if q.sampling is not None).start == \
        (len(a_ids) - 1) // ps * ps

    # the same requests with the prefix cache off compute every prompt token
    plain = _real_sched(engine, cfg, prefix_caching=False)
    ref = collect(LocalRunner(engine, plain), req("a", prompt=a_ids, max_tokens=32),
                  req("b", prompt=b_ids, max_tokens=32))
    assert plain.stats()["prefix_hit_tokens"] == 0
    assert len(a.token_ids) >= 8
    assert b.token_ids == ref["b"].token_ids and a_again.token_ids == a.token_ids == ref["a"].token_ids
    assert np.allclose(b.logprobs, ref["b"].logprobs, atol=1e-3)


@pytest.mark.model
def test_real_model_exhausted_pool_queues_requests_that_complete_later_unchanged(real_paged):
    engine, tok, cfg = real_paged
    prompts = [_chat(tok, None, q) for q in ("What is the capital of France?", "Write a haiku about the sea.",
                                             "Give me three tips for learning Python.")]
    reqs = [req(f"r{i}", prompt=p, max_tokens=24, ignore_eos=True) for i, p in enumerate(prompts)]
    roomy = _real_sched(engine, cfg, prefix_caching=False)
    alone_out = {r.request_id: collect(LocalRunner(engine, roomy), r)[r.request_id].token_ids for r in reqs}
    # each request reserves ceil((prompt + 24 - 1 + 3) / 16) pages; a pool of that many + 1 holds one at a time
    ps = engine.page_size
    need = max(-(-(len(p) + 24 - 1 + cfg.engine.decode_steps - 1) // ps) for p in prompts)
    tight = _real_sched(engine, cfg, prefix_caching=False, pages_per_group=need + 1)
    runner = LocalRunner(engine, tight)
    streams = [runner.submit(r) for r in reqs]
    runner.step_once()
    assert tight.slots_in_use == 1 and tight.queue_depth == 2  # slots are free, pages are not
    runner.run_until_idle()
    for r, s in zip(reqs, streams, strict=True):
        out = s.result(5)
        assert out.finish_reason == "length" and out.token_ids == alone_out[r.request_id]
    st = tight.stats()
    assert st["pages_used"] == 0 and st["pages_reserved"] == 0 and st["tokens_generated"] == 3 * 24


def _burst_scheduler(eng: PagedTokenEngine, burst_wait: float, clock=None, wait_clock=time.monotonic) -> Scheduler:
    paging = Paging(eng.page_size, eng.pages_per_group, eng.groups, eng.max_step_tokens, True, burst_wait=burst_wait)
    return Scheduler(eng.max_slots, eng.max_seq_len, eng.eos_ids, 16, clock=clock or Clock(),
                     slot_order=eng.slot_order, paging=paging, wait_clock=wait_clock)


def _burst_shares_the_first_step(gaps_s: list[float]) -> None:
    """An idle engine (burst wait a quarter of an 8 s pass: 2 s) gets 4 requests, `gaps_s[i]` seconds after
    request i; all four must share the first step, each with its own tokens."""
    import time

    eng = PagedTokenEngine(max_slots=4, groups=2, step_tokens=16)
    sched = _burst_scheduler(eng, 0.25)
    sched.decode_pass_s = 8.0  # as measured from earlier decode plans
    runner = LocalRunner(eng, sched, idle_wait_s=0.05).start()
    try:
        time.sleep(0.2)  # the loop waits for work
        reqs = [req(f"r{i}", prompt=prompt_of(5 + i, i), max_tokens=3) for i in range(4)]
        streams = []
        for r, gap in zip(reqs, [*gaps_s, 0.0], strict=True):
            streams.append(runner.submit(r))
            time.sleep(gap)
        outs = [s.result(20) for s in streams]
    finally:
        runner.stop()
    assert sorted(q.slot for q in eng.plans[0].seqs) == [0, 1, 2, 3], [q.slot for q in eng.plans[0].seqs]
    for r, out in zip(reqs, outs, strict=True):
        assert out.token_ids == alone(r.prompt_token_ids, 3)


def test_a_burst_reaching_an_idle_engine_over_some_milliseconds_starts_in_one_step():
    """The loop thread is idle when the first request arrives; the other three come 50 ms later. With a burst
    wait they share the first step (the wait ends early once every slot has a request); each request's tokens
    are still its own."""
    _burst_shares_the_first_step([0.05, 0.0, 0.0])


def test_a_burst_that_keeps_arriving_keeps_the_idle_engine_waiting():
    """Arrivals 1.2 s apart, with a burst wait of 2 s (a quarter of an 8 s pass): each arrival starts the wait
    again, so all four share the first step although the last comes 3.6 s after the first (a wait fixed from
    the first arrival would have started the step with two)."""
    _burst_shares_the_first_step([1.2, 1.2, 1.2])


def test_a_burst_that_never_stops_arriving_waits_at_most_burst_max_passes():
    """Arrivals every half pass, each within the burst wait (a whole pass) of the last, at an idle engine with
    a slot for each of them: the wait still ends BURST_MAX_PASSES passes after the first request. The clock
    is the test's (both the plans' clock and the burst wait's): each wait moves it on by its timeout, at most
    half a pass, and a request arrives."""
    from raydeploy.engine import scheduler as scheduler_mod

    pass_s, now = 0.01, [1000.0]
    eng = PagedTokenEngine(max_slots=64, groups=2, step_tokens=64, pages_per_group=256)
    sched = _burst_scheduler(eng, 1.0, clock=lambda: now[0], wait_clock=lambda: now[0])
    sched.max_queue = 64
    sched.decode_pass_s = pass_s
    arrivals = iter(range(1, 64))

    class Arriving(_RecordingCondition):
        def wait(self, timeout=None) -> bool:
            self.timeouts.append(timeout)
            assert timeout <= pass_s + 1e-9, f"waited {timeout} s past the burst wait of one pass ({pass_s} s)"
            now[0] += min(timeout, pass_s / 2)
            i = next(arrivals)
            self.cond.release()  # submit takes the lock, as a request arriving from another thread does
            try:
                sched.submit(req(f"r{i}", prompt=prompt_of(5, i), max_tokens=3), lambda ev: None)
            finally:
                self.cond.acquire()
            return True

    sched._work = rec = Arriving(sched._work)
    sched.submit(req("r0", prompt=prompt_of(5, 0), max_tokens=3), lambda ev: None)
    assert sched.wait_for_work(1.0)
    waited_passes = (now[0] - 1000.0) / pass_s
    assert waited_passes == pytest.approx(scheduler_mod.BURST_MAX_PASSES), (waited_passes, rec.timeouts)
    assert 2 * scheduler_mod.BURST_MAX_PASSES <= sched.queue_depth < eng.max_slots


class _RecordingCondition:
    """The scheduler's condition variable with every wait's timeout recorded (and not slept)."""

    def __init__(self, cond) -> None:
        self.cond, self.timeouts = cond, []

    def wait(self, timeout=None) -> bool:
        self.timeouts.append(timeout)
        return False

    def __getattr__(self, name):
        return getattr(self.cond, name)


@pytest.mark.parametrize(("burst_wait", "pass_s", "waits"), [(0.25, 0.4, True), (0.25, None, False),
                                                            (0.0, 0.4, False)])
def test_burst_wait_is_a_fraction_of_a_measured_pass_and_only_when_idle(burst_wait, pass_s, waits):
    eng = PagedTokenEngine(max_slots=4, groups=2, step_tokens=16)
    sched = _burst_scheduler(eng, burst_wait)
    sched.decode_pass_s = pass_s
    sched._work = rec = _RecordingCondition(sched._work)
    sched.submit(req("a", prompt=prompt_of(5, 1), max_tokens=20), lambda ev: None)
    assert sched.wait_for_work(1.0)
    if waits:  # one wait of about a quarter pass (0.1 s), then the deadline has passed (waits are not slept here)
        assert rec.timeouts and 0.05 < rec.timeouts[0] <= 0.1, rec.timeouts
    else:
        assert rec.timeouts == []
    rec.timeouts.clear()
    LocalRunner(eng, sched).step_once()  # a runs now: the engine is busy, so new arrivals never wait
    sched.submit(req("b", prompt=prompt_of(5, 2), max_tokens=3), lambda ev: None)
    assert sched.wait_for_work(1.0) and rec.timeouts == []


@pytest.mark.parametrize(("slots", "chunk", "platform", "want"), [
    (8, 256, "cpu", [1, 4, 8, 16, 32, 64, 96, 128, 192, 256]),  # powers of two above twice the slots, and 3/2 of
    (4, 256, "cpu", [1, 4, 16, 32, 64, 96, 128, 192, 256]),     # them from 64; from 16 at least
    (8, 256, "tpu", [1, 4, 8, 64, 256]),               # the chunk and a quarter chunk
    (8, 256, "gpu", [1, 4, 8, 64, 256]),
    (2, 32, "cpu", [1, 2, 8, 16, 32]),                 # a quarter chunk off the ladder is kept
    (4, 16, "tpu", [1, 4, 16]),                        # a quarter chunk within the slots is not
])
def test_token_buckets_are_finer_for_prompts_on_cpu(slots, chunk, platform, want):
    from raydeploy.engine.programs import default_decode_rows, default_token_buckets

    assert default_token_buckets(default_decode_rows(slots), slots, chunk, platform) == want


@pytest.mark.parametrize(("platform", "buckets", "want"), [
    ("cpu", [1, 4, 8, 16, 32, 64, 96, 128, 192, 256], 64),  # a quarter chunk beside running streams
    ("tpu", [1, 4, 8, 64, 256], None),                      # the whole chunk: a chunk step costs ~a weight read
    ("gpu", [1, 4, 8, 64, 256], None),
    ("cpu", [1, 2, 32], None),                              # no quarter bucket: the whole chunk
])
def test_quarter_chunk_beside_running_streams_only_on_cpu(platform, buckets, want):
    """`Engine.mixed_step_tokens` over a stand-in program set (the real CPU engine's 32 is checked with the demo
    model above; tests/test_gpu.py checks None on a real GPU)."""
    from raydeploy.engine.engine import Engine

    engine = SimpleNamespace(max_step_tokens=max(buckets),
                             programs_set=SimpleNamespace(platform=platform, token_buckets=buckets))
    assert Engine.mixed_step_tokens.fget(engine) == want  # type: ignore[attr-defined]
