"""The ingress's front door over an in-process fake gang, with real HTTP clients on loopback: the body-read
deadline (408), the bound on requests held (503 + Retry-After, probes never refused), the per-key limit (429),
admission released on every path (streams dropped before their first token), and /metrics from cached figures.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import pytest
from serve_fakes import FakeBackend, ThreadedServer, tokenizer_dir

from raydeploy.config import ConfigError, load_config
from raydeploy.serve.app import create_app
from raydeploy.serve.auth import ApiKeyCheck
from raydeploy.serve.generation import Limits, ServingCore
from raydeploy.serve.limits import FrontDoorLimits, ingress_bound
from raydeploy.serve.metrics import GangFigures
from raydeploy.serve.text import TextCodec

KEY, KEY2 = "sk-limits-0123456789", "sk-limits-other-9876"
SCRIPT = " Hello! I am a small model."


class HoldingBackend(FakeBackend):
    """The fake gang, but no request gets its first token until `gate` is set (every slot busy), and gang
    figures are counted."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self.gate.set()
        self.stats_calls = 0
        self.entered: list[str] = []
        """Requests that reached the gang (held at the gate or not)."""

    async def generate(self, req):  # type: ignore[no-untyped-def]
        self.entered.append(req.request_id)
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        async for events in super().generate(req):
            yield events

    async def stats(self) -> dict[str, Any]:
        self.stats_calls += 1
        return await super().stats()


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_dir(tokenizer_dir())


@pytest.fixture(scope="module")
def cfg():
    return load_config(None, ["model.max_seq_len=128", "engine.max_new_tokens=32",
                              "engine.max_slots=4", "serving.max_queue=64"])


def _serve(codec, cfg, *, keys=(KEY, KEY2), **app_kw):
    backend = HoldingBackend(codec.encode(SCRIPT) + list(codec.eos_token_ids), codec.eos_token_ids[0])
    core = ServingCore(backend, codec, Limits.from_config(cfg, "m"))
    app = create_app(core, api_keys=ApiKeyCheck(tuple(keys)), **app_kw)
    return backend, core, ThreadedServer(app)


def _wait_for(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _body(stream: bool = False, max_tokens: int = 4) -> bytes:
    return json.dumps({"prompt": "Hi", "max_tokens": max_tokens, "stream": stream}).encode()


def _request_head(length: int, key: str = KEY) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nContent-Length: {length}\r\n\r\n").encode()


def _held(server) -> int:
    """Requests inside the server's front door now."""
    return server.server.config.app.state.front_door.held


def _status(server) -> dict[str, Any]:
    return httpx.get(server.url + "/status", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()


# -- capacity released on every path ---------------------------------------------------------------------


def test_streams_dropped_before_their_first_token_release_their_admission(codec, cfg):
    """60 streams dropped while every slot is busy (no first token yet): once idle, nothing stays admitted
    and 32 new requests (more than the 8 that would fit if the 60 had leaked) all succeed."""
    backend, core, server = _serve(codec, cfg)
    capacity = cfg.engine.max_slots + cfg.serving.max_queue
    assert 60 + 32 > capacity >= 60
    with server:
        backend.gate.clear()

        async def drop_60() -> None:
            conns = []
            for _ in range(60):
                r, w = await asyncio.open_connection("127.0.0.1", server.port)
                body = _body(stream=True, max_tokens=16)
                w.write(_request_head(len(body)) + body)
                await w.drain()
                conns.append((r, w))
            await asyncio.to_thread(_wait_for, lambda: len(backend.entered) == 60, "60 requests at the gang")
            assert core.in_flight == 60
            metrics = await asyncio.to_thread(httpx.get, server.url + "/metrics", timeout=30)
            assert "raydeploy_sequences_admitted 60.0" in metrics.text
            for _, w in conns:
                w.close()
            for _, w in conns:
                await w.wait_closed()

        asyncio.run(drop_60())
        backend.gate.set()  # the slots free up: the dropped streams get their first token with nobody to read it
        _wait_for(lambda: core.in_flight == 0 and not backend.active, "the ingress to go idle")
        assert core.in_flight == 0

        async def new_32() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                         headers={"Authorization": f"Bearer {KEY}"}) as c:
                return list(await asyncio.gather(*(
                    c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "stream": i % 2 == 0})
                    for i in range(32))))

        answers = asyncio.run(new_32())
        assert [r.status_code for r in answers] == [200] * 32, [r.text for r in answers if r.status_code != 200][:2]
        assert core.in_flight == 0
        assert _status(server)["serving"]["admitted"] == 0
        assert "raydeploy_sequences_admitted 0.0" in httpx.get(server.url + "/metrics", timeout=30).text


def test_a_stream_cancelled_before_its_body_starts_releases_its_admission(codec, cfg):
    """Behind Serve, a client gone cancels the replica's task, which may land while the response's first
    message is being sent, before the stream's body generator ever started: 60 of those leave nothing admitted.
    (Driven at the ASGI level: the cancellation arrives from `send`, as Serve's would.)"""
    backend, core, _ = _serve(codec, cfg)
    app = create_app(core, api_keys=ApiKeyCheck((KEY,)))
    body = _body(stream=True, max_tokens=16)
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {KEY}".encode()),
                         (b"content-length", str(len(body)).encode())]}

    async def one() -> None:
        sent = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if sent:
                return sent.pop()
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                raise asyncio.CancelledError()

        with pytest.raises(asyncio.CancelledError):
            await app(dict(scope), receive, send)

    async def go() -> None:
        for _ in range(60):
            await one()
        await asyncio.sleep(0.1)  # the abandoned streams' generators are closed by the loop
        assert core.in_flight == 0
        assert len(backend.entered) == 60

    asyncio.run(go())


def test_an_admission_ticket_counts_once_however_often_it_is_released(codec, cfg):
    backend = FakeBackend([1], 2)
    core = ServingCore(backend, codec, Limits.from_config(cfg, "m"))

    async def go() -> None:
        t = await core.admit(3)
        assert core.in_flight == 3
        t.release()
        t.release()
        core.release(t)
        assert core.in_flight == 0 and t.released
        await core.admit(2)  # dropped without a release: garbage collection gives it back
        assert core.in_flight == 0

    asyncio.run(go())


# -- the body-read deadline ------------------------------------------------------------------------------


def test_300_slow_bodies_do_not_hold_the_ingress_and_get_408(codec, cfg):
    timeout_s = 6.0
    backend, core, server = _serve(codec, cfg, front_door=FrontDoorLimits(body_read_timeout_s=timeout_s,
                                                                          max_ingress_requests=400))
    with server:

        async def go() -> tuple[httpx.Response, float, list[bool], list[bytes]]:
            slow = []
            for _ in range(300):
                r, w = await asyncio.open_connection("127.0.0.1", server.port)
                w.write(_request_head(100) + b'{"prompt": ')  # 11 of the 100 bytes, and nothing more
                await w.drain()
                slow.append((r, w))
            await asyncio.to_thread(_wait_for, lambda: _held(server) == 300,
                                    "300 slow requests inside the ingress")
            answers = [asyncio.create_task(r.read()) for r, _ in slow]  # read to EOF: the server closes them
            t0 = time.perf_counter()
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                normal = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4},
                                      headers={"Authorization": f"Bearer {KEY}"})
            normal_s = time.perf_counter() - t0
            answered_before = [t.done() for t in answers]
            got = await asyncio.wait_for(asyncio.gather(*answers), timeout=120)
            for _, w in slow:
                w.close()
            return normal, normal_s, answered_before, got

        normal, normal_s, answered_before, got = asyncio.run(go())
        print(f"normal request while 300 slow bodies were held: {normal_s * 1000:.0f} ms")
        assert normal.status_code == 200, normal.text
        assert normal.json()["choices"][0]["text"]
        assert not any(answered_before), "a slow body was answered before the normal request finished"
        for raw in got:
            head, _, body = raw.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), raw[:200]
            assert b"connection: close" in head.lower()
            err = json.loads(body)["error"]
            assert err["message"] == ("the request body did not arrive within 6 s (serving.body_read_timeout_s)")
            assert err["code"] == "body_timeout" and err["type"] == "invalid_request_error"
        st = _status(server)
        assert st["front_door"]["held"] == 1 and st["front_door"]["refused"]["body_timeout"] == 300  # this poll
        assert len(backend.entered) == 1, "a slow body reached the gang"


# -- the bound on requests held --------------------------------------------------------------------------


def test_past_the_ingress_bound_a_quick_503_and_probes_still_answer(codec, cfg):
    backend, core, server = _serve(codec, cfg, front_door=FrontDoorLimits(body_read_timeout_s=60,
                                                                          max_ingress_requests=3))
    with server:

        async def go() -> None:
            held = []
            for _ in range(3):
                r, w = await asyncio.open_connection("127.0.0.1", server.port)
                w.write(_request_head(100) + b"{")
                await w.drain()
                held.append(w)
            async with httpx.AsyncClient(base_url=server.url, timeout=30,
                                         headers={"Authorization": f"Bearer {KEY}"}) as c:
                await asyncio.to_thread(_wait_for, lambda: _held(server) == 3, "3 held")
                refused = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                assert refused.status_code == 503, refused.text
                assert refused.headers["retry-after"] == "1"
                err = refused.json()["error"]
                assert err == {"message": "the server is holding its limit of 3 requests "
                                          "(serving.max_ingress_requests); retry shortly",
                               "type": "server_error", "param": None, "code": "overloaded"}
                for probe in ("/health", "/ready", "/metrics"):
                    assert (await c.get(probe)).status_code == 200, probe
                for w in held:
                    w.close()
                await asyncio.to_thread(_wait_for, lambda: _held(server) == 0, "release")
                ok = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                assert ok.status_code == 200, ok.text

        asyncio.run(go())
        assert len(backend.entered) == 1


def test_the_default_ingress_bound_follows_the_config(cfg):
    assert ingress_bound(cfg) == 4 * 1 + 64 + cfg.serving.max_waiting + 256  # the admitted, the line, bodies
    big = load_config(None, ["engine.max_slots=64", "replicas.max=4", "serving.max_queue=128",
                             "serving.max_waiting=1000"])
    assert ingress_bound(big) == 64 * 4 + 128 + 1000 + 256
    assert ingress_bound(load_config(None, ["serving.max_ingress_requests=7"])) == 7
    with pytest.raises(ConfigError, match="serving.max_ingress_requests"):
        load_config(None, ["serving.max_ingress_requests=0"])
    with pytest.raises(ConfigError, match="serving.max_concurrent_per_key"):
        load_config(None, ["serving.max_concurrent_per_key=-1"])
    with pytest.raises(ConfigError, match="serving.body_read_timeout_s"):
        load_config(None, ["serving.body_read_timeout_s=0"])


# -- the per-key limit -----------------------------------------------------------------------------------


def test_per_key_limit_answers_429_naming_the_limit_not_the_key(codec, cfg):
    backend, core, server = _serve(codec, cfg, front_door=FrontDoorLimits(max_concurrent_per_key=1))
    with server:
        backend.gate.clear()

        async def go() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                def post(key: str) -> Any:
                    return c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                                  headers={"Authorization": f"Bearer {key}"})

                first = asyncio.create_task(post(KEY))
                await asyncio.to_thread(_wait_for, lambda: len(backend.entered) == 1, "the first request")
                refused = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                                       headers={"X-API-Key": KEY})  # the same key by the other header
                assert refused.status_code == 429, refused.text
                assert refused.headers["retry-after"] == "1"
                err = refused.json()["error"]
                assert err["message"] == ("this API key already has 1 requests in progress, its limit "
                                          "(serving.max_concurrent_per_key = 1); retry when one finishes")
                assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
                assert KEY not in refused.text
                other = asyncio.create_task(post(KEY2))  # another key is not held back
                await asyncio.to_thread(_wait_for, lambda: len(backend.entered) == 2, "the other key's request")
                assert (await c.post("/v1/completions", json={"prompt": "Hi"},
                                     headers={"Authorization": "Bearer wrong"})).status_code == 401
                backend.gate.set()
                assert (await first).status_code == 200 and (await other).status_code == 200
                assert (await post(KEY)).status_code == 200  # its slot came back

        asyncio.run(go())


def test_a_per_key_limit_without_keys_is_a_config_error(cfg):
    from dataclasses import replace

    from raydeploy.serve.deployment import build_serve_app

    bad = replace(cfg, serving=replace(cfg.serving, max_concurrent_per_key=2))
    with pytest.raises(ConfigError, match="serving.max_concurrent_per_key.*needs API keys"):
        build_serve_app(bad, "/nonexistent")


# -- /metrics from cached figures ------------------------------------------------------------------------


def test_metrics_scrapes_read_cached_gang_figures(codec, cfg):
    backend, core, server = _serve(codec, cfg, metrics_refresh_s=3600)
    with server:
        texts = [httpx.get(server.url + "/metrics", timeout=30).text for _ in range(20)]
        assert backend.stats_calls == 1
        _status(server)  # /status reads anew
        assert backend.stats_calls == 2
    assert "raydeploy_gang_figures_age_seconds" in texts[-1]
    assert 'raydeploy_gang_slots_in_use{gang="fake_gang"}' in texts[-1]


def test_gang_figures_refresh_in_the_background_at_most_once_per_period():
    class Source:
        def __init__(self) -> None:
            self.calls, self.hang, self.fail = 0, False, False

        async def state(self) -> dict[str, Any]:
            self.calls += 1
            if self.hang:
                await asyncio.sleep(3600)
            if self.fail:
                raise ConnectionError("gang gone")
            return {"state": "ready", "n": self.calls}

        async def stats(self) -> dict[str, Any]:
            return {"slots_in_use": self.calls}

    now = [100.0]
    src = Source()
    figures = GangFigures(src, refresh_s=5.0, timeout_s=1.0, wait_s=0.1, clock=lambda: now[0])

    async def go() -> None:
        state, stats, age = await figures.get()  # a refresh, waited for (bounded)
        assert state["n"] == 1 and stats == {"slots_in_use": 1} and age == 0.0
        now[0] += 4.0
        assert (await figures.get())[2] == 4.0 and src.calls == 1  # fresh enough: the gangs are not asked
        now[0] += 2.0
        src.hang = True
        state, _, age = await figures.get()  # stale, and the gangs hang: the old figures after wait_s
        assert state["n"] == 1 and age == 6.0 and figures.refreshes == 2
        await figures.get()
        assert figures.refreshes == 2 and src.calls == 2  # never two refreshes at once
        await asyncio.sleep(1.0)  # the hung refresh hits its timeout; the old figures stay
        src.hang, src.fail = False, True
        now[0] += 1.0
        state, _, age = await figures.get()
        assert state["n"] == 1 and age == 7.0  # a failed refresh keeps the old figures, and their age says so
        src.fail = False
        state, _, age = await figures.get()
        assert state["n"] == 4 and age == 0.0

    asyncio.run(go())
