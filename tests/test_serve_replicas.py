"""Two gangs behind one endpoint: a real local Ray cluster, real Ray Serve HTTP, two gang replicas of one host
each (real jax.distributed per gang) with the stand-in engine, whose tokens a test can predict: here the point
is routing and failure, not the model.

Shown: /status lists both gangs; 16 concurrent streams are spread over both and are all correct; a request
that the engine fails on its own (every gang's engine is wrapped by the `raise_on_token` fault) fails once,
with a 500 naming it, while the streams in its steps go on to their right ends, no gang restarts and it is
not sent to the other gang; a host of one gang is killed while a client keeps sending: every request submitted
after the kill succeeds, the streams in flight on the killed gang end with a retriable error, and the count of
ready gangs returns to 2.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import threading
import time

import httpx
import pytest

from raydeploy.config import load_config
from raydeploy.testing.faults import FaultyEngine

pytestmark = [pytest.mark.ray, pytest.mark.e2e, pytest.mark.slow]

PROMPT = [5, 6, 7]
READY_TIMEOUT_S = 600
POISON = 201
"""A token id whose step fails in every gang's first engine (the `raise_on_token` fault); no other test sends it."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_cfg(port: int, *extra: str):
    """One-host gangs with a small slot count; failures noticed within seconds (a killed host by its actor's
    death; JAX's own heartbeat stays at its default 10 s: at 4 s a host process starved of CPU on a busy
    2-core machine was once declared dead by its own coordination service, and the gang restarted unasked)."""
    return load_config(None, [
        "cluster.num_hosts=1", "cluster.devices_per_host=1", "mesh.axes={dp: 1}", "engine.max_slots=4",
        "serving.max_queue=32", f"serving.port={port}", "serving.request_timeout_s=600",
        "cluster.heartbeat_timeout_s=10", "cluster.init_timeout_s=60", "cluster.restart_backoff_s=0.5",
        "cluster.max_restarts=3", "replicas.routing_stats_period_s=0.5", "replicas.health_check_period_s=2",
        # the stand-in engine holds no KV cache: a long context costs nothing and lets a stream run for minutes
        "model.max_seq_len=1000000", "engine.max_new_tokens=999000", *extra])


def expected_text(codec, n: int) -> str:
    """What the stand-in gang answers to PROMPT with `n` tokens and ignore_eos, as the ingress detokenizes it."""
    from raydeploy.testing.toy import toy_expected_tokens

    detok = codec.detokenizer()
    text = "".join(detok.add(t) for t in toy_expected_tokens(PROMPT, n, eos_token_ids=()))
    return text + detok.flush()


def wait_http_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/ready", timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the HTTP ingress did not become ready"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def codec(demo_checkpoint):
    from raydeploy.serve.text import TextCodec

    return TextCodec.from_dir(demo_checkpoint)


@pytest.fixture(scope="module")
def two_gangs(demo_checkpoint):
    import ray

    from raydeploy.serve.run import connect_ray, start_serving

    assert connect_ray(None, temp_dir=f"/tmp/rdrep-{os.getpid()}", num_cpus=2)
    serving = None
    t0 = time.monotonic()
    try:
        cfg = replica_cfg(_free_port(), "replicas.min=2", "replicas.max=2")
        serving = start_serving(cfg, checkpoint_path=str(demo_checkpoint),
                                engine=FaultyEngine("toy", faults={0: {"raise_on_token": POISON}}))
        serving.wait_ready(READY_TIMEOUT_S, count=2)
        wait_http_ready(serving.url, READY_TIMEOUT_S)
        print(f"two gangs ready after {time.monotonic() - t0:.1f}s")
        yield serving
    finally:
        if serving is not None:
            serving.shutdown()
        ray.shutdown()


def _gang_stats(url: str) -> dict[str, dict]:
    return httpx.get(url + "/status", timeout=60).json()["engine"].get("gangs", {})


def test_status_shows_both_gangs_and_16_streams_spread_over_them(two_gangs, codec):
    url = two_gangs.url
    st = httpx.get(url + "/status", timeout=60).json()
    assert st["state"] == "ready" and st["ready_gangs"] == 2 and st["total_gangs"] == 2, st
    gangs = st["gang"]["gangs"]
    assert len(gangs) == 2 and all(g["state"] == "ready" and len(g["host_status"]) == 1 for g in gangs), gangs
    assert len({g["host_status"][0]["pid"] for g in gangs}) == 2  # two gangs, two host processes
    ready = httpx.get(url + "/ready", timeout=30).json()
    assert ready["ready"] and ready["ready_gangs"] == 2
    before = _gang_stats(url)

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str, str | None]:
        n = 40 + i
        body = {"prompt": PROMPT, "max_tokens": n, "ignore_eos": True, "stream": True, "temperature": 0}
        text, finish = "", None
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice.get("finish_reason") or finish
        return n, text, finish

    async def main() -> list[tuple[int, str, str | None]]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*[one(client, i) for i in range(16)])

    for n, text, finish in asyncio.run(main()):
        assert finish == "length" and text == expected_text(codec, n), (n, text, finish)
    after = _gang_stats(url)
    done = {name: after[name]["requests_done"] - before.get(name, {}).get("requests_done", 0) for name in after}
    assert len(done) == 2 and sum(done.values()) == 16 and min(done.values()) >= 1, done
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert "raydeploy_gangs_ready 2.0" in metrics and metrics.count("raydeploy_gang_up{") == 2, metrics


def test_a_request_the_engine_fails_fails_alone_once_and_no_gang_restarts(two_gangs, codec):
    """Runs before the kill test: the fault is in each gang's first engine only (a rebuilt gang has none)."""
    url = two_gangs.url

    def fresh_stats() -> dict[str, dict]:  # from the supervisors, not the ingress's cached figures
        return {g["gang"]: g["stats"] for g in two_gangs.gangs.status()["gangs"]}

    before = fresh_stats()
    normals = 6

    async def stream(client: httpx.AsyncClient, n: int, going) -> tuple[int, str, str | None, float]:
        body = {"prompt": PROMPT, "max_tokens": n, "ignore_eos": True, "stream": True, "temperature": 0}
        text, finish, events = "", None, 0
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice.get("finish_reason") or finish
                    events += 1
                    if events == 3:
                        going.release()
        return n, text, finish, time.monotonic()

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            going = asyncio.Semaphore(0)
            tasks = [asyncio.create_task(stream(client, 1000 + 20 * i, going)) for i in range(normals)]
            for _ in range(normals):  # every stream is decoding: each is a row of every step of its gang
                await asyncio.wait_for(going.acquire(), 300)
            poison = await client.post(url + "/v1/completions", json={
                "prompt": [5, POISON, 7], "max_tokens": 8, "ignore_eos": True, "temperature": 0})
            answered = time.monotonic()
            return poison, answered, await asyncio.gather(*tasks)

    poison, answered, results = asyncio.run(main())
    assert poison.status_code == 500, poison.text
    err = poison.json()["error"]
    assert err["code"] == "request_failed" and err["type"] == "server_error", err
    assert re.fullmatch(r"request cmpl-[0-9a-f]{24}-0 failed in the model engine and was not retried; the details "
                        r"are in the server log", err["message"]), err
    for n, text, finish, ended in results:  # the streams beside it went on, to the tokens they would have had alone
        assert finish == "length" and text == expected_text(codec, n), (n, text[-40:], finish)
        assert ended > answered, "a stream ended before the poisoned request was answered: it ran beside nothing"
    after = fresh_stats()
    delta = {k: {f: after[k][f] - before.get(k, {}).get(f, 0) for f in ("requests_submitted", "steps_failed",
                                                                         "requests_done")} for k in after}
    assert sum(d["requests_submitted"] for d in delta.values()) == normals + 1, delta  # the poison: once in all
    assert sorted(d["steps_failed"] for d in delta.values()) == [0, 1], delta
    hit = next(d for d in delta.values() if d["steps_failed"] == 1)
    assert hit["requests_done"] >= 2, delta  # streams ran on the gang that failed the request, beside it
    st = two_gangs.gangs.state()
    assert st["ready_gangs"] == 2 and [g["restarts"] for g in st["gangs"]] == [0, 0], st


def test_a_host_killed_while_a_client_sends(two_gangs, codec):
    url = two_gangs.url
    gangs = two_gangs.gangs
    # long streams (longer than the test) on the gangs; the victim is a gang that holds some of them
    streams: list[dict] = [{} for _ in range(4)]
    started = threading.Barrier(len(streams) + 1, timeout=300)
    stop = threading.Event()

    def long_stream(out: dict) -> None:
        body = {"prompt": PROMPT, "max_tokens": 900_000, "ignore_eos": True, "stream": True}
        events: list[str] = []
        out["events"] = events
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
            out["status"] = resp.status_code
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        started.wait()
                if stop.is_set():
                    return  # still streaming when the test ends: the client goes away

    threads = [threading.Thread(target=long_stream, args=(o,)) for o in streams]
    for t in threads:
        t.start()
    started.wait()
    stats = _gang_stats(url)
    victim = max(stats, key=lambda name: stats[name]["slots_in_use"])
    in_flight_on_victim = stats[victim]["slots_in_use"]
    assert in_flight_on_victim >= 1, stats
    pid = gangs.gang(victim).status()["host_status"][0]["pid"]

    # a client that keeps sending short requests, two at a time
    sent: list[tuple[float, int, str]] = []

    def client() -> None:
        with httpx.Client(timeout=300) as c:
            while not stop.is_set():
                at = time.monotonic()
                r = c.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True,
                                                           "temperature": 0})
                sent.append((at, r.status_code, r.text))

    clients = [threading.Thread(target=client) for _ in range(2)]
    for t in clients:
        t.start()
    deadline = time.monotonic() + 120
    while len(sent) < 4:  # the client is running before the kill
        assert time.monotonic() < deadline, "the client got no answers"
        time.sleep(0.05)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    try:
        # the killed gang leaves the ready set, then comes back; the client keeps going all along
        deadline = time.monotonic() + 120
        while gangs.state()["ready_gangs"] == 2:
            assert time.monotonic() < deadline, "the killed gang was never seen not ready"
            time.sleep(0.1)
        rebuilt = gangs.wait_ready(READY_TIMEOUT_S, count=2)
        rebuilt_at = time.monotonic()
        while len([s for s in sent if s[0] > rebuilt_at]) < 4:  # and it goes on after the rebuild
            assert time.monotonic() < rebuilt_at + 120, "no requests after the rebuild"
            time.sleep(0.05)
    finally:
        stop.set()
        for t in clients:
            t.join(300)
        for t in threads:
            t.join(600)

    want = expected_text(codec, 8)
    after_kill = [s for s in sent if s[0] > killed_at]
    assert len(after_kill) >= 8, len(after_kill)
    bad = [(status, text[:300]) for _, status, text in after_kill
           if status != 200 or json.loads(text)["choices"][0]["text"] != want]
    assert not bad, bad  # every request submitted after the kill succeeded, correctly
    for _, status, text in sent:  # and those before it: answered, or refused retriably
        assert status == 200 or (status == 503 and json.loads(text)["error"]["code"] == "service_unavailable"), text

    assert all(o["status"] == 200 for o in streams), streams
    errored = [o for o in streams if o["events"][-1] == "[DONE]"]
    assert len(errored) == in_flight_on_victim, [o["events"][-2:] for o in streams]
    for o in errored:  # the victim's streams ended with a retriable error
        err = json.loads(o["events"][-2])["error"]
        assert err["code"] == "service_unavailable" and "retry" in err["message"], err
    for o in streams:
        if o not in errored:  # the other gang's streams were still going, without an error
            assert all('"error"' not in e for e in o["events"]) and len(o["events"]) > 2
    assert rebuilt["ready_gangs"] == 2
    by_name = {g["gang"]: g for g in rebuilt["gangs"]}
    assert by_name[victim]["restarts"] == 1 and "host 0" in (by_name[victim]["last_error"] or ""), by_name[victim]
    assert sum(g["restarts"] for g in rebuilt["gangs"]) == 1
    print(f"kill: {len(after_kill)} requests after the kill, all 200; gang rebuilt in {rebuilt_at - killed_at:.1f}s")
