"""Scheduler and LocalRunner logic, driven by a counting fake engine (no JAX; the real engine is tested in
test_engine_model.py). The fake's next token is the previous token + 1, so expected outputs are obvious."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from raydeploy.engine.local import LocalRunner
from raydeploy.engine.request import GenerationRequest, TokenEvent
from raydeploy.engine.scheduler import QueueFullError, Scheduler
from raydeploy.engine.step import StepPlan, StepResult

EOS = 2


class CountingEngine:
    """prefill -> last prompt token + 1; decode -> previous token + 1. Records every plan."""

    def __init__(self, max_slots: int) -> None:
        self.last = np.zeros(max_slots, np.int32)
        self.active = np.zeros(max_slots, bool)
        self.plans: list[StepPlan] = []

    def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for s in plan.release:
            self.active[s] = False
        toks = []
        for item in plan.prefills:
            self.last[item.slot] = int(item.tokens[-1]) + 1
            self.active[item.slot] = True
            toks.append(self.last[item.slot])
        res = StepResult(plan.step_id, np.asarray(toks, np.int32), np.full(len(toks), -0.5, np.float32))
        if plan.decode:
            steps = []
            for _ in range(plan.decode_steps):
                self.last = np.where(self.active, self.last + 1, self.last).astype(np.int32)
                steps.append(self.last.copy())
            res.decode_tokens = np.stack(steps)
            res.decode_logprobs = np.full(res.decode_tokens.shape, -0.25, np.float32)
        return res


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(max_slots=2, max_seq_len=64, max_queue=4, buckets=(16, 32), clock=None):
    sched = Scheduler(max_slots, max_seq_len, (EOS,), max_queue, list(buckets), clock=clock or Clock())
    return sched, CountingEngine(max_slots)


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
    plan_with_b = next(p for p in eng.plans if any(i.slot == 1 for i in p.prefills))
    assert plan_with_b.decode and plan_with_b.step_id == 2  # b's prefill rides along with a's decode
    assert [e.token_id for e in a_events] == [13, 14, 15, 16, 17, 18]
    assert b.result(5).token_ids == [41, 42, 43]


def test_queue_waits_for_a_free_slot_and_release_is_planned():
    sched, eng = make(max_slots=1)
    outs = collect(LocalRunner(eng, sched), req("a", max_tokens=2), req("b", prompt=(30,), max_tokens=2))
    assert outs["a"].token_ids == [13, 14] and outs["b"].token_ids == [31, 32]
    b_plan = next(p for p in eng.plans if p.prefills and p.prefills[0].tokens[-1] == 30)
    assert b_plan.release == (0,)


def test_queue_full_error_names_the_limit_and_pickles():
    sched, _ = make(max_queue=2)
    sched.submit(req("a"), lambda e: None)
    sched.submit(req("b"), lambda e: None)
    with pytest.raises(QueueFullError, match=r"queue is full: 2 requests waiting \(max_queue=2\)"):
        sched.submit(req("c"), lambda e: None)
    err = pickle.loads(pickle.dumps(QueueFullError(2, 2)))
    assert isinstance(err, QueueFullError) and err.max_queue == 2 and "max_queue=2" in str(err)


def test_prompt_too_long_and_empty_prompt_messages():
    sched, _ = make(max_seq_len=64, buckets=(16, 32))
    with pytest.raises(ValueError, match=r"request x: prompt has 33 tokens, more than the 32 this engine accepts"):
        sched.submit(req("x", prompt=range(33)), lambda e: None)
    with pytest.raises(ValueError, match="request y: prompt is empty"):
        sched.submit(req("y", prompt=()), lambda e: None)
    with pytest.raises(ValueError, match="max_tokens must be >= 1, found 0"):
        sched.submit(req("z", max_tokens=0), lambda e: None)
    sched2, _ = make(max_seq_len=16, buckets=(16,))
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
    assert out_a.finish_reason == "abort" and out_a.token_ids == [13, 14, 15]
    assert b.result(5).token_ids == [71, 72]
    assert any(p.release == (0,) and p.prefills for p in eng.plans)
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
    class Broken(CountingEngine):
        def step(self, plan):
            raise RuntimeError("device lost")

    sched, _ = make()
    runner = LocalRunner(Broken(2), sched).start()
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
    sched = Scheduler(4, 64, (EOS,), 4, [16], clock=Clock(), slot_order=[0, 2, 1, 3])
    eng = CountingEngine(4)
    outs = collect(LocalRunner(eng, sched), *(req(f"r{i}", prompt=(10 * (i + 1),), max_tokens=2) for i in range(3)))
    assert [outs[f"r{i}"].token_ids for i in range(3)] == [[11, 12], [21, 22], [31, 32]]
    assert [i.slot for i in eng.plans[0].prefills] == [0, 2, 1]
    with pytest.raises(ValueError, match=r"slot_order must list each of the 4 slots once, got \[0, 1, 1, 3\]"):
        Scheduler(4, 64, (EOS,), 4, [16], slot_order=[0, 1, 1, 3])


def test_decode_steps_group_tokens_but_not_first_tokens_or_past_the_end():
    sched = Scheduler(2, 16, (EOS,), 4, [8], clock=Clock(), decode_steps=4)
    eng = CountingEngine(2)
    runner = LocalRunner(eng, sched)
    a = runner.submit(req("a", prompt=(10, 11, 12), max_tokens=10))
    runner.step_once()  # a's prefill: one decode step, so its first token is not held back
    b = runner.submit(req("b", prompt=(40,), max_tokens=3))
    runner.run_until_idle()
    assert a.result(5).token_ids == list(range(13, 23)) and b.result(5).token_ids == [41, 42, 43]
    steps = [p.decode_steps for p in eng.plans if p.decode]
    assert steps[0] == 1 and steps[1] == 1  # plans with a prefill decode once
    assert 4 in steps  # plans without one decode four steps
    # never more than the running requests still want: a needs 10 tokens in all
    assert sum(steps) <= 10 + 1
    # never past max_seq_len: a 12-token prompt leaves room for 4 cached tokens in 16
    sched = Scheduler(1, 16, (EOS,), 4, [16], clock=Clock(), decode_steps=4)
    eng = CountingEngine(1)
    out = collect(LocalRunner(eng, sched), req("c", prompt=tuple(range(100, 112)), max_tokens=50))
    assert out["c"].token_ids == list(range(112, 116)) and out["c"].finish_reason == "length"
    assert [p.decode_steps for p in eng.plans if p.decode] == [1, 3]
