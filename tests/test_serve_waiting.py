"""Waiting, not refusing: requests beyond the capacity wait in a bounded first-come-first-served line at the
ingress (raydeploy.serve.limits.CapacityQueue), and are served in order as room frees; the wait is bounded in
time (503 + Retry-After after serving.queue_wait_s) and in count (serving.max_waiting); a client that
disconnects while waiting leaves the line at once.

The line itself is tested alone (asyncio, no server), then through the app over real HTTP on loopback with an
in-process fake gang that holds every request at a gate (every slot busy) until the test opens it.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
import time
from typing import Any

import httpx
import pytest
from ray.serve.exceptions import BackPressureError
from serve_fakes import FakeBackend, ThreadedServer, tokenizer_dir

import raydeploy.serve.backend as backend_mod
from raydeploy.config import load_config
from raydeploy.engine.request import GenerationRequest, TokenEvent
from raydeploy.engine.scheduler import QueueFullError
from raydeploy.serve.app import create_app
from raydeploy.serve.auth import ApiKeyCheck
from raydeploy.serve.backend import FAILOVER_ATTEMPTS, ReplicaBackend
from raydeploy.serve.deployment import gang_deployment_options
from raydeploy.serve.errors import APIError, Overloaded
from raydeploy.serve.generation import Limits, ServingCore
from raydeploy.serve.limits import (
    INGRESS_HEADROOM,
    WAITED_RETRY_AFTER_S,
    CapacityQueue,
    ClientGone,
    FrontDoorLimits,
    WaitedTooLong,
    WaitingFull,
    ingress_bound,
)
from raydeploy.serve.text import TextCodec

KEY = "sk-waiting-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
SCRIPT = " Hello! I am a small model."


# -- the line alone --------------------------------------------------------------------------------------------


def _fixed(capacity: int):
    async def read() -> int:
        return capacity
    return read


async def _until(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def test_requests_beyond_capacity_wait_and_are_admitted_in_arrival_order():
    async def main() -> None:
        q = CapacityQueue(max_waiting=16, wait_s=30)
        cap = _fixed(2)
        held = [await q.take(1, cap), await q.take(1, cap)]
        assert q.in_flight == 2 and q.waiting == 0
        order: list[int] = []

        async def waiter(i: int, n: int):
            ticket = await q.take(n, cap)
            order.append(i)
            return ticket

        tasks = []
        for i, n in enumerate([1, 2, 1, 1]):  # arrival order is task creation order, one at a time
            tasks.append(asyncio.create_task(waiter(i, n)))
            await _until(lambda i=i: q.waiting == i + 1, f"waiter {i} in line")
        assert q.waiting_sequences == 5 and order == []
        held.pop(0).release()  # one free: waiter 0 (n=1) fits
        await _until(lambda: order == [0], "waiter 0 admitted")
        held.pop(0).release()  # one free: waiter 1 needs 2 -> nobody, and waiter 2 (n=1) must not jump it
        await asyncio.sleep(0.05)
        assert order == [0] and q.waiting == 3 and q.in_flight == 1
        tasks[0].result().release()  # two free: waiter 1
        await _until(lambda: order == [0, 1], "waiter 1 admitted")
        tasks[1].result().release()  # two free: waiters 2 and 3 both
        await _until(lambda: order == [0, 1, 2, 3], "waiters 2 and 3 admitted")
        for t in tasks[2:]:
            t.result().release()
            t.result().release()  # idempotent
        assert q.in_flight == 0 and q.waiting == 0 and q.waited == 4 and not q.refused

    asyncio.run(main())


def test_the_wait_is_bounded_in_time_and_count():
    async def main() -> None:
        q = CapacityQueue(max_waiting=2, wait_s=0.3)
        cap = _fixed(1)
        held = await q.take(1, cap)
        started = time.monotonic()
        first = asyncio.create_task(q.take(1, cap))
        second = asyncio.create_task(q.take(1, cap))
        await _until(lambda: q.waiting == 2, "two in line")
        with pytest.raises(WaitingFull) as full:  # the line is full: refused at once, not after a wait
            await q.take(1, cap)
        assert time.monotonic() - started < 0.3
        assert full.value.status == 503 and full.value.headers() == {"Retry-After": "1"}
        assert "serving.max_waiting = 2" in full.value.message
        for t in (first, second):
            with pytest.raises(WaitedTooLong) as late:
                await t
            assert late.value.status == 503 and "0.3 s" in late.value.message
            assert "serving.queue_wait_s" in late.value.message
            assert late.value.headers() == {"Retry-After": str(int(WAITED_RETRY_AFTER_S))}
        assert time.monotonic() - started >= 0.3
        assert q.waiting == 0 and q.in_flight == 1
        assert q.refused == {"line_full": 1, "wait_timeout": 2}
        held.release()
        assert q.in_flight == 0

    asyncio.run(main())


def test_a_client_gone_or_a_cancelled_task_leaves_the_line_and_the_next_moves_up():
    async def main() -> None:
        q = CapacityQueue(max_waiting=8, wait_s=30)
        cap = _fixed(1)
        held = await q.take(1, cap)
        gone = asyncio.Event()

        async def client_gone() -> None:
            await gone.wait()

        leaving = asyncio.create_task(q.take(1, cap, client_gone))
        cancelled = asyncio.create_task(q.take(1, cap))
        staying = asyncio.create_task(q.take(1, cap))
        await _until(lambda: q.waiting == 3, "three in line")
        gone.set()
        with pytest.raises(ClientGone):
            await asyncio.wait_for(leaving, 2)
        cancelled.cancel()
        await _until(lambda: q.waiting == 1, "the two gone from the line")
        assert q.refused == {"client_gone": 1, "cancelled": 1}
        held.release()  # the room goes to the one that stayed, not to those that left
        ticket = await asyncio.wait_for(staying, 2)
        assert q.in_flight == 1
        ticket.release()
        assert q.in_flight == 0

    asyncio.run(main())


def test_room_that_appears_without_a_release_reaches_the_head_of_the_line():
    """A gang that turns ready adds capacity; the first waiter reads it afresh every refresh_s."""
    async def main() -> None:
        capacity = [1]

        async def read() -> int:
            return capacity[0]

        q = CapacityQueue(max_waiting=8, wait_s=30, refresh_s=0.05)
        held = await q.take(1, read)
        waiting = [asyncio.create_task(q.take(1, read)) for _ in range(2)]
        await _until(lambda: q.waiting == 2, "two in line")
        capacity[0] = 3
        tickets = await asyncio.wait_for(asyncio.gather(*waiting), 2)
        assert q.in_flight == 3 and q.capacity == 3
        for t in [held, *tickets]:
            t.release()

    asyncio.run(main())


def test_a_ticket_released_on_another_thread_wakes_the_waiter_on_its_loop():
    async def main() -> None:
        q = CapacityQueue(max_waiting=8, wait_s=30)
        cap = _fixed(1)
        held = await q.take(1, cap)
        waiter = asyncio.create_task(q.take(1, cap))
        await _until(lambda: q.waiting == 1, "one in line")
        t = threading.Thread(target=held.release)  # as garbage collection may, on any thread
        t.start()
        t.join()
        ticket = await asyncio.wait_for(waiter, 2)
        assert q.in_flight == 1
        ticket.release()

    asyncio.run(main())


def test_a_waiter_granted_as_it_times_out_gives_the_room_back():
    async def main() -> None:
        q = CapacityQueue(max_waiting=8, wait_s=30)
        cap = _fixed(1)
        held = await q.take(1, cap)
        first = asyncio.create_task(q.take(1, cap))
        second = asyncio.create_task(q.take(1, cap))
        await _until(lambda: q.waiting == 2, "two in line")
        held.release()  # grants `first` (its wake-up is scheduled, not yet run) ...
        first.cancel()  # ... which is cancelled before it runs: its room must pass on to `second`
        ticket = await asyncio.wait_for(second, 2)
        assert first.cancelled() and q.in_flight == 1 and q.waiting == 0
        ticket.release()
        assert q.in_flight == 0

    asyncio.run(main())


# -- through the app, over HTTP ----------------------------------------------------------------------------


class GatedBackend(FakeBackend):
    """The fake gang, but no request gets a token until `gate` is set (every slot busy), or until `let_one`
    lets one more of the held requests through."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self._lock = threading.Lock()
        self._budget = 0
        self.entered: list[str] = []
        """Request ids of the requests that reached the gang, in order."""

    def let_one(self) -> None:
        with self._lock:
            self._budget += 1

    def _pass(self) -> bool:
        with self._lock:
            if self._budget:
                self._budget -= 1
                return True
        return self.gate.is_set()

    async def generate(self, req):  # type: ignore[no-untyped-def]
        self.entered.append(req.request_id)
        while not self._pass():
            await asyncio.sleep(0.01)
        async for events in super().generate(req):
            yield events


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_dir(tokenizer_dir())


def _serve(codec: TextCodec, *overrides: str):
    cfg = load_config(None, ["model.max_seq_len=128", "engine.max_new_tokens=32", "engine.max_slots=2",
                             "serving.max_queue=1", *overrides])
    backend = GatedBackend(codec.encode(SCRIPT) + list(codec.eos_token_ids), codec.eos_token_ids[0])
    core = ServingCore(backend, codec, Limits.from_config(cfg, "m"))
    app = create_app(core, api_keys=ApiKeyCheck((KEY,)), front_door=FrontDoorLimits.from_config(cfg))
    return backend, core, ThreadedServer(app)


def _wait_for(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _body(i: int, stream: bool = False) -> dict[str, Any]:
    return {"prompt": f"Hi {i}", "max_tokens": 4, "stream": stream, "user": f"u{i}"}


def test_http_requests_over_capacity_wait_and_all_complete_in_order(codec):
    """Capacity 3 (2 slots + 1 queued); 9 requests, sent one after another while the gang holds every slot: 6
    wait. The gang then finishes one request at a time: each frees room for exactly one waiter, and the waiters
    reach the gang in the order they arrived; all 9 answer 200."""
    backend, core, server = _serve(codec, "serving.max_waiting=8", "serving.queue_wait_s=60")
    with server:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60, headers=AUTH) as c:
                tasks = []
                for i in range(9):
                    tasks.append(asyncio.create_task(c.post("/v1/completions", json=_body(i, stream=i % 2 == 1))))
                    admitted_or_waiting = i + 1
                    await asyncio.to_thread(_wait_for, lambda n=admitted_or_waiting: core.in_flight + core.waiting
                                            == n, f"request {i} admitted or waiting")
                assert core.in_flight == 3 and core.waiting == 6
                assert len(backend.entered) == 3  # the waiting ones have not reached the gang
                for k in range(6):  # one done -> one waiter admitted (and at the gang) before the next is let go
                    backend.let_one()
                    await asyncio.to_thread(_wait_for, lambda k=k: len(backend.entered) == 4 + k,
                                            f"waiter {k} at the gang")
                    assert core.waiting == 5 - k
                backend.gate.set()
                return list(await asyncio.gather(*tasks))

        answers = asyncio.run(burst())
        assert [r.status_code for r in answers] == [200] * 9, [r.text for r in answers if r.status_code != 200]
        prompt_of = {r.request_id: tuple(r.prompt_token_ids) for r in backend.requests}
        expected = [tuple(codec.encode(f"Hi {i}")) for i in range(9)]
        # the gang saw the held three first, then the waiters in their order of arrival
        assert [expected.index(prompt_of[rid]) for rid in backend.entered] == list(range(9))
        _wait_for(lambda: core.in_flight == 0, "the ingress to go idle")
        assert core.queue.waited == 6 and not core.queue.refused


def test_http_wait_bounded_in_time_then_503_with_retry_after(codec):
    backend, core, server = _serve(codec, "serving.max_waiting=8", "serving.queue_wait_s=0.5")
    with server:
        async def main() -> httpx.Response:
            async with httpx.AsyncClient(base_url=server.url, timeout=60, headers=AUTH) as c:
                held = [asyncio.create_task(c.post("/v1/completions", json=_body(i))) for i in range(3)]
                await asyncio.to_thread(_wait_for, lambda: core.in_flight == 3, "capacity taken")
                started = time.monotonic()
                late = await c.post("/v1/completions", json=_body(9))
                waited = time.monotonic() - started
                assert 0.5 <= waited < 10, waited
                backend.gate.set()
                assert [r.status_code for r in await asyncio.gather(*held)] == [200] * 3
                return late

        late = asyncio.run(main())
        assert late.status_code == 503 and late.headers["Retry-After"] == str(int(WAITED_RETRY_AFTER_S))
        err = late.json()["error"]
        assert err["code"] == "overloaded" and "serving.queue_wait_s" in err["message"], err
        assert core.queue.refused == {"wait_timeout": 1} and core.waiting == 0


def test_http_wait_bounded_in_count_then_503_at_once(codec):
    backend, core, server = _serve(codec, "serving.max_waiting=2", "serving.queue_wait_s=60")
    with server:
        async def main() -> httpx.Response:
            async with httpx.AsyncClient(base_url=server.url, timeout=60, headers=AUTH) as c:
                first = [asyncio.create_task(c.post("/v1/completions", json=_body(i))) for i in range(5)]
                await asyncio.to_thread(_wait_for, lambda: core.in_flight == 3 and core.waiting == 2, "line full")
                started = time.monotonic()
                refused = await c.post("/v1/completions", json=_body(9))
                assert time.monotonic() - started < 5
                backend.gate.set()
                assert [r.status_code for r in await asyncio.gather(*first)] == [200] * 5
                return refused

        refused = asyncio.run(main())
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert "serving.max_waiting = 2" in refused.json()["error"]["message"]
        assert core.queue.refused == {"line_full": 1}


def test_http_a_client_that_disconnects_while_waiting_frees_its_place(codec):
    """Two raw connections wait; the first closes its socket: it leaves the line at once (the second is then
    first), and when room frees the second is served."""
    backend, core, server = _serve(codec, "serving.max_waiting=8", "serving.queue_wait_s=60")
    with server:
        async def main() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=60, headers=AUTH) as c:
                held = [asyncio.create_task(c.post("/v1/completions", json=_body(i))) for i in range(3)]
                await asyncio.to_thread(_wait_for, lambda: core.in_flight == 3, "capacity taken")
                body = json.dumps(_body(7)).encode()
                r, w = await asyncio.open_connection("127.0.0.1", server.port)
                w.write((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
                await w.drain()
                await asyncio.to_thread(_wait_for, lambda: core.waiting == 1, "the raw request waiting")
                staying = asyncio.create_task(c.post("/v1/completions", json=_body(8)))
                await asyncio.to_thread(_wait_for, lambda: core.waiting == 2, "two waiting")
                w.close()
                await w.wait_closed()
                started = time.monotonic()
                await asyncio.to_thread(_wait_for, lambda: core.waiting == 1, "the gone client out of the line", 5)
                assert time.monotonic() - started < 2
                assert core.queue.refused == {"client_gone": 1} and core.in_flight == 3
                backend.gate.set()
                assert [x.status_code for x in await asyncio.gather(*held, staying)] == [200] * 4
                assert len(backend.requests) == 4  # the gone client's request never reached the gang

        asyncio.run(main())
        _wait_for(lambda: core.in_flight == 0, "the ingress to go idle")


def test_a_request_that_could_never_fit_is_still_a_400(codec):
    backend, core, server = _serve(codec, "serving.max_waiting=8")
    with server:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "n": 4, "max_tokens": 2}, headers=AUTH,
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert "at most 3 at once" in r.json()["error"]["message"]
        assert core.waiting == 0 and core.in_flight == 0


# -- the bounds above the line let a thousand prompts in ---------------------------------------------------------


def test_default_bounds_let_a_thousand_concurrent_requests_wait_not_be_refused():
    cfg = load_config(None, [])
    s = cfg.serving
    lim = Limits.from_config(cfg, "m")
    capacity = cfg.engine.max_slots * cfg.replicas.max + s.max_queue
    assert lim.max_waiting >= 1000 and lim.queue_wait_s == s.request_timeout_s
    # the front door holds the admitted, the waiting and INGRESS_HEADROOM more (bodies being read)
    assert ingress_bound(cfg) == capacity + s.max_waiting + INGRESS_HEADROOM >= 1000 + capacity
    # the gangs' router queue holds what one ingress admits beyond the slots: nothing admitted is refused there
    opts = gang_deployment_options(cfg)
    assert opts["max_ongoing_requests"] == cfg.engine.max_slots
    assert opts["max_queued_requests"] >= capacity
    explicit = load_config(None, ["serving.max_ingress_requests=300", "serving.queue_wait_s=7"])
    assert ingress_bound(explicit) == 300 and Limits.from_config(explicit, "m").queue_wait_s == 7.0


def test_the_errors_of_the_line_keep_their_status_across_pickling():
    for e in (WaitingFull(4), WaitedTooLong(2.5), ClientGone()):
        back = pickle.loads(pickle.dumps(e))
        assert isinstance(back, APIError) and type(back) is type(e)
        assert (back.status, back.message, back.headers()) == (e.status, e.message, e.headers())


# -- below the ingress: a full queue is tried again, not answered at once ---------------------------------------


class _Gen:
    def __init__(self, items: list[Any]) -> None:
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
    """A Serve handle whose successive calls give the scripted streams (an exception item is raised)."""

    def __init__(self, *scripts: list[Any]) -> None:
        self.scripts = list(scripts)
        self.calls = 0

    def options(self, **kw: Any) -> _Handle:
        return self

    @property
    def generate(self) -> _Handle:
        return self

    def remote(self, req: Any) -> _Gen:
        self.calls += 1
        return _Gen(self.scripts.pop(0))


class _Directory:
    async def state(self) -> dict[str, Any]:
        return {"state": "ready", "ready_gangs": 1}


def test_a_full_queue_below_the_ingress_is_tried_again_then_503(monkeypatch):
    """A gang's QueueFullError or Serve's BackPressureError before any token: the request is sent again (the
    room an admitted request counts on is there a moment later); only when every try meets a full queue is it a
    503."""
    monkeypatch.setattr(backend_mod, "FAILOVER_BACKOFF_S", (0.0,))
    req = GenerationRequest("r1", (1, 2), 3, ignore_eos=True)
    done = [TokenEvent("r1", 5, finish_reason="length")]

    async def run(handle: _Handle) -> list[TokenEvent]:
        b = ReplicaBackend(handle, _Directory())
        return [ev async for batch in b.generate(req) for ev in batch]

    handle = _Handle([QueueFullError(4, 4)], [BackPressureError(num_queued_requests=8, max_queued_requests=8)],
                     [done])
    assert asyncio.run(run(handle)) == done and handle.calls == 3
    always_full = _Handle(*[[QueueFullError(4, 4)] for _ in range(FAILOVER_ATTEMPTS)])
    with pytest.raises(Overloaded, match="queue is full"):
        asyncio.run(run(always_full))
    assert always_full.calls == FAILOVER_ATTEMPTS
