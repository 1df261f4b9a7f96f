"""The whole stack end to end: a real local Ray cluster, the embedded default gang shape (2 host processes
with a virtual CPU device each, dp=2, real jax.distributed), the real SmolLM2 demo model, Ray Serve HTTP, and the
official `openai` client, the chat page in headless Chromium, and a host killed mid-service.

One deployment (small max_seq_len and buckets) is shared by every test in this module; the host-kill test
runs last because it restarts the gang.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from live_http import free_port, live_serving, wait_http_ready

from raydeploy.config import load_config
from raydeploy.engine.request import GenerationRequest
from raydeploy.engine.step import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

KEY = "sk-e2e-5b0c9d"
KEYS_ENV = "RAYDEPLOY_E2E_API_KEYS"
MODEL = "smollm2-135m-instruct"
AUTH = {"Authorization": f"Bearer {KEY}"}
READY_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def live(demo_checkpoint):
    os.environ[KEYS_ENV] = f"sk-other,{KEY}"  # before Ray starts: the ingress replica reads it
    cfg = load_config(None, [
        "model.max_seq_len=256", "engine.max_new_tokens=128",
        "engine.max_slots=8", "serving.max_queue=8", "serving.max_waiting=0", f"serving.port={free_port()}",
        f"serving.api_keys_env={KEYS_ENV}", "serving.request_timeout_s=600", "serving.max_body_bytes=65536",
        "cluster.heartbeat_timeout_s=5", "cluster.restart_backoff_s=0.5", "cluster.max_restarts=2"])
    with live_serving(cfg, str(demo_checkpoint), "rds", READY_TIMEOUT_S) as serving:
        yield serving


def _stats(live) -> dict:
    return live.gangs.ready_gang().status()["stats"] or {}


def _slots_in_use(stats: dict) -> int:
    for key in ("slots_in_use", "active_slots", "active"):
        if key in stats:
            return int(stats[key])
    raise AssertionError(f"no slot occupancy in the coordinator's stats: {sorted(stats)}")


def _wait_idle(live, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while _slots_in_use(_stats(live)) != 0:
        assert time.monotonic() < deadline, f"slots still busy: {_stats(live)}"
        time.sleep(0.1)


def _err(resp, status, param=None, contains=""):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and contains.lower() in err["message"].lower(), err
    assert "Traceback" not in resp.text and "/work" not in resp.text and KEY not in resp.text
    return err


def _post(live, path, body, **kw):
    return httpx.post(live.url + path, json=body, headers=AUTH, timeout=120, **kw)


# -- the API with the official client -------------------------------------------------------------------------


def test_openai_client_greedy_matches_the_engine(live):
    from openai import OpenAI

    from raydeploy.serve.text import TextCodec

    client = OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    codec = TextCodec.from_dir(_ckpt(live))
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    text = chat.choices[0].message.content
    ids = codec.encode_chat(codec.chat_prompt(messages))
    events = live.gangs.ready_gang().generate(GenerationRequest("e2e-ref-chat", tuple(ids), 24, SamplingParams(0.0)),
                                              120)
    want = codec.decode([e.token_id for e in events if e.token_id is not None])
    assert text == want and "Paris" in text, (text, want)
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.usage.completion_tokens == sum(e.token_id is not None for e in events)

    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    prompt = "The three primary colors are"
    comp = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16, logprobs=0)
    events = live.gangs.ready_gang().generate(GenerationRequest("e2e-ref-comp", tuple(codec.encode(prompt)), 16,
                                                                SamplingParams(0.0)), 120)
    assert comp.choices[0].text == codec.decode([e.token_id for e in events if e.token_id is not None])
    lps = comp.choices[0].logprobs.token_logprobs
    assert len(lps) == comp.usage.completion_tokens and all(lp <= 0 for lp in lps)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=16, stream=True))
    assert streamed == comp.choices[0].text
    assert [m.id for m in client.models.list().data] == [MODEL]


def _ckpt(live) -> str:
    from raydeploy.gang.gang import resolve_checkpoint_path

    return resolve_checkpoint_path(live.cfg)


def test_sixteen_concurrent_streams_are_batched(live):
    from openai import AsyncOpenAI

    _wait_idle(live)
    topics = ["the sea", "a cat", "rain", "the moon", "bread", "trains", "winter", "a garden", "music",
              "mountains", "coffee", "a library", "the wind", "bicycles", "fire", "a river"]
    settings = [{"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.9, "seed": 1},
                {"temperature": 1.0, "extra_body": {"top_k": 20}, "seed": 2}, {"temperature": 0.5, "top_p": 0.5}]
    before = _stats(live)
    peak = {"slots": 0}

    async def one(client, i):
        kw = dict(settings[i % len(settings)])
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Write two sentences about {topics[i]}."}],
            max_tokens=12 + i, stream=True, stream_options={"include_usage": True}, **kw)
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        return text, finish, usage

    async def watch(stop):
        while not stop.is_set():
            st = await asyncio.to_thread(_stats, live)
            peak["slots"] = max(peak["slots"], _slots_in_use(st))
            await asyncio.sleep(0.2)

    async def main():
        client = AsyncOpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=900)
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        try:
            return await asyncio.gather(*[one(client, i) for i in range(16)])
        finally:
            stop.set()
            await watcher

    results = asyncio.run(main())
    after = _stats(live)
    for i, (text, finish, usage) in enumerate(results):
        assert finish in ("stop", "length") and text.strip(), (i, text, finish)
        assert 1 <= usage.completion_tokens <= 12 + i
        if finish == "length":
            assert usage.completion_tokens == 12 + i
    tokens = sum(u.completion_tokens for _, _, u in results)
    steps = after["steps_done"] - before["steps_done"]
    assert steps > 0 and tokens / steps >= 3, (tokens, steps)  # several requests decoded per step
    assert peak["slots"] >= 6, peak


def test_legacy_chat_and_instruct(live):
    r = _post(live, "/chat", {"prompt": "And what is 2 + 3?", "history": [["What is 1 + 1?", "1 + 1 = 2."]],
                              "greedy": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"input", "response", "tokens_used"} and "5" in out["response"]
    assert "What is 1 + 1?" in out["input"] and out["tokens_used"] >= 1
    r = _post(live, "/instruct", {"instruction": "Name a color of the sky.", "system": "Answer in one word.",
                                  "greedy": True})
    assert r.status_code == 200, r.text
    assert r.json()["response"].strip() and r.json()["input"].startswith("<|im_start|>system\nAnswer in one word.")


def test_input_limits_and_security(live):
    long_prompt = "word " * 300
    _err(_post(live, "/v1/completions", {"prompt": long_prompt}), 400, "prompt", "context is 256 tokens")
    _err(_post(live, "/v1/completions", {"prompt": "word " * 200, "max_tokens": 100}), 400, "max_tokens",
         "over this model's context of 256")
    _err(_post(live, "/v1/completions", {"prompt": "x", "max_tokens": 129}), 400, "max_tokens", "at most 128")
    _err(_post(live, "/v1/completions", {"prompt": "x", "temperature": 3}), 400, "temperature", "less than or equal")
    _err(_post(live, "/v1/completions", {"prompt": "x", "top_p": -1}), 400, "top_p", "greater than 0")
    _err(_post(live, "/v1/completions", {"prompt": "x", "n": 99}), 400, "n", "holds at most 16 at once")
    _err(_post(live, "/v1/completions", {"prompt": ""}), 400, "prompt", "must not be empty")
    _err(_post(live, "/v1/chat/completions", {"messages": []}), 400, "messages", "at least one")
    assert _err(_post(live, "/v1/completions", {"model": "gpt-4o", "prompt": "x"}), 404, "model",
                "does not exist")["code"] == "model_not_found"
    r = httpx.post(live.url + "/v1/completions", content=b'{"prompt": ', timeout=30,
                   headers=AUTH | {"Content-Type": "application/json"})
    _err(r, 400, None, "not valid JSON")
    r = httpx.post(live.url + "/v1/completions", content=b"prompt=x", timeout=30,
                   headers=AUTH | {"Content-Type": "text/plain"})
    _err(r, 415, None, "application/json")
    _err(_post(live, "/v1/completions", {"prompt": "x" * 70000}), 413, None, "65536 bytes")
    r = httpx.post(live.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert _err(r, 401, None, "API key")["type"] == "authentication_error"
    r = httpx.post(live.url + "/chat", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}, timeout=30)
    _err(r, 401, None, "API key")
    assert httpx.get(live.url + "/health", timeout=30).status_code == 200
    assert httpx.get(live.url + "/ready", timeout=30).status_code == 200
    st = httpx.get(live.url + "/status", headers=AUTH, timeout=60)
    assert st.status_code == 200 and KEY not in st.text and "sk-other" not in st.text
    body = st.json()
    assert body["devices"] == 2 and body["process_count"] == 2 and body["mesh"] == {"dp": 2}
    (gang,) = body["gang"]["gangs"]
    assert len(gang["host_status"]) == 2 and body["requests_served"] >= 1 and body["ready_gangs"] == 1
    assert all(h.get("rss_bytes") for h in gang["host_status"])
    from raydeploy.model import native

    # dp only, float32: both hosts multiply few rows in the native CPU kernel (built on first use), reading the
    # demo's Q4_1 projections and Q8_0 table packed (both builds of the kernel)
    want = "native" if native._cpu_problem() is None else f"xla ({native.unavailable()})"
    if native._cpu_problem() is None and native.packs_weights() is None:
        want = "native (8 weights packed)"
    assert [h["matmul"] for h in gang["host_status"]] == [want, want], gang["host_status"]
    # the embedded default holds its KV cache in float16 (`engine.kv_dtype`)
    assert [h["kv_dtype"] for h in gang["host_status"]] == ["float16", "float16"], gang["host_status"]



def test_hostile_bodies_cost_little_through_the_real_ingress(live):
    # the old depth pre-scan's worst case at the deployment's body limit (quadratic: ~8 s per 64 KiB before)
    head = b'{"prompt": ' + b"[" * 40 + b'"'
    raw = head + b'\\"' * ((65536 - len(head)) // 2)
    r = httpx.post(live.url + "/v1/completions", content=raw, timeout=60,
                   headers=AUTH | {"Content-Type": "application/json"})
    _err(r, 400, None, "41 levels deep")
    _err(_post(live, "/v1/completions", {"prompt": "x", "stop_token_ids": list(range(1025))}), 400,
         "stop_token_ids", "at most 1024")
    _err(_post(live, "/v1/completions", {"prompt": [12, 49152], "max_tokens": 1}), 400, "prompt",
         "vocabulary of this model (49152 ids")  # the demo model's embedding: config.json's vocab_size
    assert httpx.get(live.url + "/health", timeout=30).status_code == 200
    r = _post(live, "/v1/completions", {"prompt": [12, 49151], "max_tokens": 1})
    assert r.status_code == 200, r.text

def test_timeout_and_disconnect_free_the_slot(live):
    _wait_idle(live)
    r = _post(live, "/v1/completions", {"prompt": "Count: 1, 2, 3,", "max_tokens": 128, "ignore_eos": True,
                                        "timeout_s": 1.0})
    assert _err(r, 504, None, "within 1 s")["code"] == "timeout"
    _wait_idle(live)
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 128, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as resp:
        assert resp.status_code == 200
        seen = []
        lines = resp.iter_lines()  # held: dropping a half-read iterator makes httpx close the connection
        while len(seen) < 3:
            line = next(lines)
            if line.startswith("data: "):
                seen.append(line)
        deadline = time.monotonic() + 30  # stats are read between steps: poll, bounded
        while _slots_in_use(stats := _stats(live)) != 1:
            assert time.monotonic() < deadline, (seen, stats)
            time.sleep(0.1)
    _wait_idle(live, timeout_s=30)  # the client went away mid-stream: its slot is free again


def test_queue_limit_answers_503_with_retry_after(live):
    _wait_idle(live)

    async def burst():
        async with httpx.AsyncClient(timeout=900, headers=AUTH) as c:
            body = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True}
            return await asyncio.gather(*[c.post(live.url + "/v1/completions", json=body) for _ in range(24)])

    results = asyncio.run(burst())
    codes = [r.status_code for r in results]
    # 8 slots + 8 queued are admitted (the queued ones wait in Serve's router); the rest are turned away at once
    assert set(codes) <= {200, 503} and codes.count(503) >= 8 and codes.count(200) >= 8, codes
    rejected = next(r for r in results if r.status_code == 503)
    assert int(rejected.headers["Retry-After"]) >= 1
    assert _err(rejected, 503, None, "capacity")["code"] == "overloaded"
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in results if r.status_code == 200)


def _raw_post(live, body: bytes, length: int | None = None) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body) if length is None else length}\r\n\r\n"
            ).encode() + body


def test_slow_bodies_through_the_serve_proxy_get_408(live):
    """Serve's proxy does not buffer a body: the ingress replica pulls it as the app reads, so the replica's
    deadline (serving.body_read_timeout_s, 10 s by default) holds there too, and a normal request is answered
    meanwhile."""
    from urllib.parse import urlsplit

    _wait_idle(live)
    where = urlsplit(live.url)

    async def go() -> tuple[httpx.Response, list[bool], list[bytes]]:
        slow = []
        for _ in range(20):
            r, w = await asyncio.open_connection(where.hostname, where.port)
            w.write(_raw_post(live, b'{"prompt": ', length=100))
            await w.drain()
            slow.append((r, w))
        answers = [asyncio.create_task(r.read()) for r, _ in slow]
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as c:
            normal = await c.post(live.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
        before = [t.done() for t in answers]
        got = await asyncio.wait_for(asyncio.gather(*answers), timeout=120)
        for _, w in slow:
            w.close()
        return normal, before, got

    normal, answered_before, got = asyncio.run(go())
    assert normal.status_code == 200, normal.text
    assert not any(answered_before)
    for raw in got:
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), raw[:300]
        assert json.loads(body)["error"]["message"] == (
            "the request body did not arrive within 10 s (serving.body_read_timeout_s)")


def test_chat_page_streams_an_answer_in_headless_chromium(live):
    from headless_chromium import chat_in_page, chromium_path

    if chromium_path() is None:
        pytest.skip("chromium is not installed (make browser)")
    # an answer of many decode groups: a short one can arrive whole in one read when steps are fast
    shown = chat_in_page(live.url, KEY, "Count from one to twenty in words.", timeout_s=120)
    assert not shown["error"], shown
    assert shown["answer"].strip() and shown["model"] == f"model: {MODEL}"
    pieces = int(shown["stats"].split(" pieces")[0].rsplit(" ", 1)[1])
    assert pieces > 1, shown["stats"]


FUZZ_EXAMPLES_PER_BODY_ROUTE = 8
"""Per mode per POST route over the real gang: 4 x 2 x 8 = 64 bodies (the full run is test_fuzz_http.py)."""
CONFIG_DEPENDENT = {"large max_tokens", "n times prompts above the server's capacity"}


def _small_generation(case):
    """Keep real generations short (a sample of bodies, not a load test) and deadlines long enough to meet."""
    body = case.body
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_new_tokens"):
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > 4:
                body[key] = 4
        if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
            body["n"] = 2
            body.pop("best_of", None)
        if isinstance(body.get("timeout_s"), int | float) and not isinstance(body.get("timeout_s"), bool) \
                and body["timeout_s"] > 0:
            body["timeout_s"] = max(body["timeout_s"], 300.0)
    return case


def test_fuzz_sample_and_hostile_bodies_through_ray_serve(live):
    """A sample of the schema fuzz and every hand-written hostile body, through the Serve proxy to the real gang."""
    import collections

    import requests
    import schemathesis
    from schemathesis import GenerationMode
    from test_fuzz_http import HOSTILE, check_answer, fuzz_route

    _wait_idle(live)
    schema = schemathesis.openapi.from_dict(httpx.get(live.url + "/openapi.json", timeout=30).json())
    sent: collections.Counter[str] = collections.Counter()
    statuses: collections.Counter[int] = collections.Counter()
    session = requests.Session()
    for op in (r.ok() for r in schema.get_all_operations()):
        if op.body is None or not len(op.body):
            continue
        for mode in GenerationMode:
            fuzz_route(op, mode, FUZZ_EXAMPLES_PER_BODY_ROUTE, live.url, session, sent, statuses, headers=AUTH,
                       secret=KEY, adjust=_small_generation)
    print(f"fuzz over Ray Serve: {sum(sent.values())} requests; by status {dict(sorted(statuses.items()))}")
    assert not any(s >= 500 for s in statuses) and statuses[200] > 0, statuses
    for name, route, raw, status, param, words in HOSTILE:
        if name in CONFIG_DEPENDENT:
            continue
        r = httpx.post(live.url + route, content=raw, headers=AUTH | {"Content-Type": "application/json"}, timeout=60)
        check_answer(r.status_code, r.headers.get("content-type", ""), r.text, name, KEY)
        assert r.status_code == status and r.json()["error"]["param"] == param, (name, r.text)
        assert words.lower() in r.json()["error"]["message"].lower(), (name, r.text)
    _wait_idle(live)
    r = _post(live, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].strip(), r.text


def test_host_kill_flips_readiness_and_service_resumes(live):
    """Runs last: kills host 1's process; /ready goes 503, requests get a retriable 503, then it all recovers."""
    pid = next(h["pid"] for h in live.gangs.ready_gang().status()["host_status"] if h["rank"] == 1)
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 128, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as resp:
        lines = resp.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        os.kill(pid, signal.SIGKILL)
        rest = [ln for ln in lines if ln.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    err = json.loads(rest[-2][6:])["error"]
    assert err["code"] == "service_unavailable" and "retry" in err["message"]

    deadline = time.monotonic() + 60
    while (ready := httpx.get(live.url + "/ready", timeout=30)).status_code == 200:
        assert time.monotonic() < deadline, "readiness never flipped after a host died"
        time.sleep(0.1)
    assert ready.status_code == 503 and ready.json()["state"] != "ready" and "Retry-After" in ready.headers
    r = _post(live, "/v1/completions", {"prompt": "x", "max_tokens": 4})
    if r.status_code != 200:  # the gang may already be back; while it is not, the answer is a retriable 503
        assert _err(r, 503, None, "retry")["code"] == "service_unavailable" and "Retry-After" in r.headers

    wait_http_ready(live.url, READY_TIMEOUT_S)
    r = _post(live, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].strip(), r.text
    assert live.gangs.state()["restarts"] >= 1
    metrics = httpx.get(live.url + "/metrics", timeout=30).text
    assert "raydeploy_gang_restarts_total 1" in metrics and "raydeploy_gang_ready 1" in metrics
