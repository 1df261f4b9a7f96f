"""A step that fails for one request fails that request, not the others and not the gang, and is not resent.

No Ray and no model: the real `Scheduler` and `StepLoop` over the paged token engine of
test_engine_scheduler.py, wrapped by the `raise_on_token` fault (raydeploy.testing.faults); a two-host gang as a
`Dispatcher` and a `FollowerLoop` over an in-memory key-value store (test_gang_units.py); the ingress's failover
(`ReplicaBackend`) over a scripted handle. The real gangs behind HTTP: tests/test_serve_replicas.py.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from test_engine_scheduler import EOS, PagedTokenEngine, alone, paged, prompt_of
from test_gang_units import MemoryKV

from raydeploy.engine.local import LocalRunner, StepLoop
from raydeploy.engine.request import GenerationRequest, RequestFailed, TokenEvent
from raydeploy.engine.scheduler import Paging, Scheduler
from raydeploy.engine.step import SamplingParams, SeqStep, StepPlan
from raydeploy.gang.dispatch import Dispatcher, FollowerLoop
from raydeploy.testing.faults import PoisonTokenEngine, check_faults, wrap_engine

POISON = 999  # never produced by `prompt_of` (3..902) nor by the engines' tokens for these prompts


def _req(rid: str, prompt, n: int) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt), n, ignore_eos=True)


def _poisoned(n: int, at: int, seed: int) -> tuple[int, ...]:
    p = list(prompt_of(n, seed))
    p[at] = POISON
    return tuple(p)


def _run(engine, sched: Scheduler, reqs: list[GenerationRequest], later: list[GenerationRequest] = (),
         after_steps: int = 0) -> tuple[dict, StepLoop]:
    """Submit `reqs`, step `after_steps` times, submit `later`, run until idle; outputs by request id."""
    loop = StepLoop(sched, engine.step, idle_wait_s=0.01, failure="engine step failed", retriable=False)
    streams = {}

    def submit(r: GenerationRequest) -> None:
        events: list[TokenEvent] = []
        sched.submit(r, events.append)
        streams[r.request_id] = events

    for r in reqs:
        submit(r)
    for _ in range(after_steps):
        loop.step_once()
    for r in later:
        submit(r)
    loop.run_until_idle()
    assert loop.error is None, loop.error
    return streams, loop


def _tokens(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def _check_poisoned(events: list[TokenEvent], rid: str) -> TokenEvent:
    assert [e.finish_reason for e in events if e.finish_reason] == ["error"], events
    last = events[-1]
    assert last.finish_reason == "error" and not last.retriable, last
    assert f"request {rid} failed in step" in last.error and f"token id {POISON}" in last.error, last.error
    return last


@pytest.mark.parametrize("where", ["first chunk beside other first chunks", "later chunk beside decode rows"])
def test_paged_poison_fails_its_request_alone_and_the_others_produce_their_own_tokens(where):
    eng = PagedTokenEngine(max_slots=4, groups=2, page_size=4, pages_per_group=32, max_seq_len=64, step_tokens=16)
    sched = paged(eng)
    a, b = prompt_of(10, 1), prompt_of(7, 2)
    if where.startswith("first"):  # the poison's first chunk rides with a's and b's first chunks
        streams, loop = _run(PoisonTokenEngine(eng, POISON), sched,
                             [_req("a", a, 8), _req("p", _poisoned(6, 2, 3), 8), _req("b", b, 8)])
    else:  # a 30-token prompt poisoned in its second chunk, while a and b decode
        streams, loop = _run(PoisonTokenEngine(eng, POISON), sched, [_req("a", a, 12), _req("b", b, 12)],
                             later=[_req("p", _poisoned(30, 20, 3), 8)], after_steps=2)
    assert _tokens(streams["a"]) == alone(a, len(_tokens(streams["a"]))) and len(_tokens(streams["a"])) >= 8
    assert _tokens(streams["b"]) == alone(b, len(_tokens(streams["b"]))) and len(_tokens(streams["b"])) >= 8
    assert streams["a"][-1].finish_reason == streams["b"][-1].finish_reason == "length"
    _check_poisoned(streams["p"], "p")
    assert loop.steps_failed == 1 and sched.requests_failed == 1
    st = sched.stats()
    assert st["slots_in_use"] == 0 and st["queue_depth"] == 0 and st["requests_failed"] == 1
    # every page went back: a request using the whole pool of a group still fits, and is right
    full = prompt_of(20, 9)
    out, _ = _run(eng, sched, [_req("after", full, 5)])
    assert _tokens(out["after"]) == alone(full, 5)


def test_a_failed_plans_releases_and_page_rows_are_sent_again():
    """The plan that fails carries the release of a finished request's slot and the first page row of a new
    request in it; the engine never saw that plan (the fault raises before it), yet both reach it next."""
    eng = PagedTokenEngine(max_slots=2, groups=1, page_size=4, pages_per_group=32, max_seq_len=64, step_tokens=16)
    sched = paged(eng)
    first, after = prompt_of(4, 4), prompt_of(8, 5)
    # a: 3 tokens by step 3; p: chunks [0:12) [12:27) [27:42), then [42:50) with the poison at 45 in step 4
    streams, loop = _run(PoisonTokenEngine(eng, POISON), sched, [_req("a", first, 3), _req("p", _poisoned(50, 45, 6), 4)],
                         later=[_req("c", after, 6)], after_steps=3)
    assert _tokens(streams["a"]) == alone(first, 3)
    _check_poisoned(streams["p"], "p")
    assert _tokens(streams["c"]) == alone(after, 6)
    assert len(eng.plans) >= 4 and all(0 not in p.release for p in eng.plans[:3])
    resent = eng.plans[3]  # the plan after the failed one: a's slot 0 released, c's row in it whole
    assert 0 in resent.release, resent
    assert any(u.slot == 0 and u.first == 0 for u in resent.pages), resent.pages
    assert loop.steps_failed == 1


def test_prefix_cache_stays_right_after_a_failed_step():
    eng = PagedTokenEngine(max_slots=2, groups=1, page_size=4, pages_per_group=32, max_seq_len=64, step_tokens=16)
    sched = paged(eng)
    shared = prompt_of(12, 7)
    streams, _ = _run(PoisonTokenEngine(eng, POISON), sched,
                      [_req("a", shared + (5,), 4), _req("p", shared + (POISON,), 4)])
    assert _tokens(streams["a"]) == alone(shared + (5,), 4)
    _check_poisoned(streams["p"], "p")
    again, _ = _run(eng, sched, [_req("b", shared + (6,), 4)])
    assert _tokens(again["b"]) == alone(shared + (6,), 4)
    assert sched.prefix_hit_tokens > 0  # b reused a's cached pages


def test_poison_in_a_first_chunk_requeues_the_others_beside_it_and_keeps_decoding_rows():
    eng = PagedTokenEngine(4, 1, 4, 64, 64, 64, next_fn=lambda seq: seq[-1] + 1)
    sched = paged(eng, max_queue=8)
    streams, loop = _run(PoisonTokenEngine(eng, POISON), sched, [_req("a", (10, 11), 6)],
                         later=[_req("b", (20, 21), 4), _req("p", (30, POISON), 4), _req("c", (40,), 3)],
                         after_steps=2)
    assert _tokens(streams["a"]) == list(range(12, 18))
    assert _tokens(streams["b"]) == [22, 23, 24, 25] and _tokens(streams["c"]) == [41, 42, 43]
    _check_poisoned(streams["p"], "p")
    assert loop.steps_failed == 1 and sched.slots_in_use == 0


def test_a_failure_naming_no_request_of_the_plan_stops_the_loop_instead_of_failing_the_same_plan_forever():
    class NamesNobody:
        def __init__(self, engine) -> None:
            self.engine = engine

        def step(self, plan):
            raise RequestFailed("no such row", slots=(77,))

    eng = PagedTokenEngine(max_slots=2, groups=1)
    sched = paged(eng)
    runner = LocalRunner(NamesNobody(eng), sched)
    s = runner.submit(_req("a", prompt_of(5, 1), 3))
    with pytest.raises(RequestFailed):
        runner.run_until_idle()
    out = s.result(5)
    assert out.finish_reason == "error" and "no such row" in out.error


@pytest.mark.parametrize("host_failure", [False, True])
def test_an_unattributed_step_failure_is_not_retriable_for_the_steps_requests_but_a_host_failure_is(host_failure):
    class BreaksAtStep:
        def __init__(self, engine, at: int) -> None:
            self.engine, self.at, self.n = engine, at, 0

        def step(self, plan):
            self.n += 1
            if self.n == self.at:
                raise ConnectionResetError("peer gone") if host_failure else IndexError("bad row")
            return self.engine.step(plan)

    eng = PagedTokenEngine(max_slots=1, groups=1)
    sched = paged(eng)
    loop = StepLoop(sched, BreaksAtStep(eng, 3).step, idle_wait_s=0.01, failure="gang failure, retry",
                    retriable=True, host_failure=lambda e: isinstance(e, OSError))
    running, queued = [], []
    sched.submit(_req("running", prompt_of(4, 1), 10), running.append)
    sched.submit(_req("queued", prompt_of(4, 2), 10), queued.append)
    with pytest.raises((IndexError, ConnectionResetError)):
        loop.run_until_idle()
    assert loop.stopped and loop.error is not None
    assert queued[-1].finish_reason == "error" and queued[-1].retriable  # no step had it: another gang may
    last = running[-1]
    assert last.finish_reason == "error" and last.retriable is host_failure, last
    if not host_failure:
        assert "request running failed in step" in last.error and "IndexError: bad row" in last.error


def test_a_two_host_gang_stays_in_lockstep_through_a_failed_step():
    """Rank 0 (step loop + dispatcher) and one follower, each with its own engine wrapped by the fault: both
    skip the failed step, and their engines end in the same state, having run the same plans."""
    kv = MemoryKV()
    lead = PagedTokenEngine(max_slots=2, groups=1)
    follower = PagedTokenEngine(max_slots=2, groups=1)
    sched = paged(lead)
    dispatcher = Dispatcher(wrap_engine({"raise_on_token": POISON}, lead), kv, generation=3, num_followers=1)
    follower_loop = FollowerLoop(wrap_engine({"raise_on_token": POISON}, follower), kv, generation=3, rank=1,
                                 poll_ms=20)
    t = threading.Thread(target=follower_loop.run)
    t.start()
    try:
        a = prompt_of(9, 3)
        streams, loop = _run(_DispatchRun(dispatcher), sched,
                             [_req("a", a, 20), _req("p", _poisoned(8, 7, 4), 5)])
    finally:
        dispatcher.run(StepPlan(step_id=-1, shutdown=True))
        t.join(10)
    assert not t.is_alive()
    assert _tokens(streams["a"]) == alone(a, 20)
    _check_poisoned(streams["p"], "p")
    assert loop.steps_failed == 1 and follower_loop.steps_failed == 1
    assert [p.to_bytes() for p in follower.plans] == [p.to_bytes() for p in lead.plans]
    np.testing.assert_array_equal(follower.pool, lead.pool)
    np.testing.assert_array_equal(follower.table, lead.table)


class _DispatchRun:
    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def step(self, plan):
        return self.dispatcher.run(plan)


def test_token_ids_past_the_vocabulary_are_refused_at_submit_naming_the_id_and_the_size():
    sched = Scheduler(2, 64, (EOS,), 4, Paging(4, 32, 1, 16), vocab_size=100)
    with pytest.raises(RequestFailed) as info:
        sched.submit(_req("x", (5, 100, 7), 3), lambda ev: None)
    e = info.value
    assert e.invalid and e.request_ids == ("x",) and isinstance(e, ValueError)
    assert "request x: prompt token id 100 is outside the model's vocabulary" in str(e) and "vocab_size 100" in str(e)
    with pytest.raises(RequestFailed, match="token id -1"):
        sched.submit(_req("y", (-1,), 3), lambda ev: None)
    sched.submit(_req("ok", (0, 99), 3), lambda ev: None)
    back = pickle.loads(pickle.dumps(e))
    assert (back.message, back.request_ids, back.slots, back.invalid) == (e.message, ("x",), (), True)


def test_the_engine_refuses_plan_rows_past_the_vocabulary_before_any_device_work():
    from raydeploy.engine.engine import Engine

    fake = SimpleNamespace(vocab_size=100)
    ok = StepPlan(1, seqs=(SeqStep(0, np.asarray([1, 99], np.int32), 0, True, SamplingParams()),))
    Engine._check_tokens(fake, ok, [(q.slot, np.asarray(q.tokens)) for q in ok.seqs])
    bad = StepPlan(2, seqs=(SeqStep(0, np.asarray([1, 2], np.int32), 0, True),
                            SeqStep(3, np.asarray([5, 100], np.int32), 0, True)))
    with pytest.raises(RequestFailed) as info:
        Engine._check_tokens(fake, bad, [(q.slot, np.asarray(q.tokens)) for q in bad.seqs])
    assert info.value.slots == (3,) and info.value.invalid and "token id 100" in str(info.value)


def test_the_fault_is_known_and_names_the_rows_that_carry_the_token():
    check_faults({"raise_on_token": 5})
    with pytest.raises(ValueError, match="raise_on_token"):
        check_faults({"raise_on_tokens": 5})
    eng = PoisonTokenEngine(PagedTokenEngine(), 5)
    plan = StepPlan(0, seqs=(SeqStep(1, np.asarray([4, 5], np.int32), 0, True, SamplingParams()),
                             SeqStep(2, np.asarray([6], np.int32), 0, True, SamplingParams())))
    with pytest.raises(RequestFailed) as info:
        eng.step(plan)
    assert info.value.slots == (1,) and not info.value.invalid
    assert eng.plans == []  # the wrapped engine never saw the plan (and its figures show through the wrapper)


# -- the ingress: what is resent, and what the client gets -----------------------------------------------------

class _Gen:
    def __init__(self, items) -> None:
        self.items = items

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for item in self.items:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        pass


class _Handle:
    """A Serve handle whose successive calls give the scripted streams."""

    def __init__(self, *scripts) -> None:
        self.scripts = list(scripts)
        self.calls = 0

    def options(self, **kw):
        return self

    @property
    def generate(self):
        return self

    def remote(self, req):
        self.calls += 1
        return _Gen(self.scripts.pop(0))


class _Directory:
    async def state(self):
        return {"state": "ready", "ready_gangs": 2}


def _broke(rid: str) -> list[list[TokenEvent]]:
    return [[TokenEvent(rid, None, finish_reason="error", retriable=True, error="gang failure, retry: host 0 died")]]


def _not_ready(rid: str) -> list[list[TokenEvent]]:
    return [[TokenEvent(rid, None, finish_reason="error", retriable=True, refused=True,
                        error="gang failure, retry: gang g is restarting")]]


def _drive(handle, rid: str = "r1"):
    from raydeploy.serve.backend import ReplicaBackend

    backend = ReplicaBackend(handle, _Directory())

    async def run():
        return [ev async for batch in backend.generate(_req(rid, (1, 2), 3)) for ev in batch]

    return backend, asyncio.run(run())


@pytest.fixture()
def no_backoff(monkeypatch):
    import raydeploy.serve.backend as backend

    monkeypatch.setattr(backend, "FAILOVER_BACKOFF_S", (0.0,))


def test_a_request_whose_gang_broke_is_resent_once_and_not_to_a_third_gang(no_backoff):
    from raydeploy.serve.errors import RequestFailedError

    handle = _Handle(_broke("r1"), _broke("r1"), [[TokenEvent("r1", 5, finish_reason="length")]])
    with pytest.raises(RequestFailedError) as info:
        _drive(handle)
    assert handle.calls == 2 and info.value.status == 500
    assert "request r1 was in 2 model gangs that each failed" in info.value.message


def test_a_gang_that_never_took_the_request_does_not_count_against_it(no_backoff):
    done = [TokenEvent("r1", 5, finish_reason="length")]
    handle = _Handle(_not_ready("r1"), _broke("r1"), _not_ready("r1"), [done])
    backend, events = _drive(handle)
    assert handle.calls == 4 and events == done and backend.failovers == 3


def test_a_request_error_is_passed_on_and_never_resent(no_backoff):
    failed = [TokenEvent("r1", None, finish_reason="error", retriable=False, error="request r1 failed in step 3: x")]
    handle = _Handle([failed], [[TokenEvent("r1", 5, finish_reason="length")]])
    _, events = _drive(handle)
    assert handle.calls == 1 and events == failed


def test_a_refusal_at_submit_for_the_requests_content_is_a_400_naming_the_token(no_backoff):
    from raydeploy.serve.errors import InvalidRequest

    refusal = RequestFailed("request r1: prompt token id 50000 is outside the model's vocabulary (ids 0..49151, "
                            "vocab_size 49152)", request_ids=("r1",), invalid=True)
    handle = _Handle([refusal], [[TokenEvent("r1", 5, finish_reason="length")]])
    with pytest.raises(InvalidRequest) as info:
        _drive(handle)
    assert handle.calls == 1 and info.value.status == 400 and "token id 50000" in info.value.message


def test_error_events_become_400_500_or_503():
    from raydeploy.serve.generation import _event_error

    invalid = _event_error(TokenEvent("r9", None, finish_reason="error", invalid=True,
                                      error="request r9 failed in step 4: prompt token id 300 is outside"))
    assert invalid.status == 400 and "token id 300" in invalid.message
    failed = _event_error(TokenEvent("r9", None, finish_reason="error", error="IndexError: /srv/secret.py"))
    assert failed.status == 500 and "request r9" in failed.message and "secret" not in failed.message
    assert failed.body()["error"]["code"] == "request_failed"
    assert _event_error(TokenEvent("r9", None, finish_reason="error", retriable=True)).status == 503
