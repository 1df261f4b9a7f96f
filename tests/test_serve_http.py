"""The HTTP layer over an in-process fake gang: protocol, errors, limits, auth, streaming, legacy endpoints.

Real HTTP (uvicorn on loopback) and the real SmolLM2 tokenizer; only the gang is a stand-in. The same
behaviour against the real gang through Ray Serve is in test_serve_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from serve_fakes import FakeBackend, ThreadedServer, tokenizer_dir

from raydeploy.config import load_config
from raydeploy.serve.app import ServerInfo, create_app
from raydeploy.serve.auth import ApiKeyCheck
from raydeploy.serve.generation import Limits, ServingCore
from raydeploy.serve.text import StopMatcher, TextCodec

KEY = "sk-test-0123456789"
SCRIPT = " Hello! I am a small model, and this is my answer."


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_dir(tokenizer_dir())


@pytest.fixture(scope="module")
def cfg():
    return load_config(None, ["model.max_seq_len=128",
                              "engine.max_new_tokens=64", "engine.max_slots=4", "serving.max_queue=2",
                              "serving.max_waiting=0",  # refused at once beyond capacity (waiting: test_serve_waiting)
                              "serving.max_body_bytes=4096"])


@pytest.fixture()
def served(codec, cfg):
    backend = FakeBackend(codec.encode(SCRIPT) + list(codec.eos_token_ids), codec.eos_token_ids[0])
    core = ServingCore(backend, codec, Limits.from_config(cfg, "smollm2-135m-instruct"))
    app = create_app(core, api_keys=ApiKeyCheck((KEY,)), max_body_bytes=cfg.serving.max_body_bytes,
                     info=ServerInfo(config={"model": {"max_seq_len": 128}}, devices=4, process_count=2,
                                     mesh={"dp": 2, "tp": 2}))
    with ThreadedServer(app) as server:
        yield server, backend, core


def _post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30, **kw)


def _err(resp, status, param=None, contains=""):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert contains.lower() in err["message"].lower(), err
    assert "Traceback" not in resp.text and "/work" not in resp.text and KEY not in resp.text
    return err


# -- units without HTTP --------------------------------------------------------------------------------


def test_stop_matcher_holds_back_partial_stop_strings():
    m = StopMatcher(["END"])
    out = m.feed("abc E") + m.feed("N")
    assert out == "abc " and not m.stopped
    assert m.feed("D more") == "" and m.stopped
    m2 = StopMatcher(["END"])
    assert m2.feed("abcEN") + m2.finish() == "abcEN"


def test_stop_matcher_looks_for_stop_strings_only_once_armed():
    """min_tokens: a stop string within the text before the request's min_tokens does not end it; one that ends
    once they are generated does, even when it began before."""
    m = StopMatcher(["END"])
    assert m.feed("an END here ", armed=False) == "an END her"  # the last 2 characters held back
    assert not m.stopped
    assert m.feed("and EN", armed=False) == "e and "
    assert m.feed("D after") == "" and m.stopped  # completed by the text fed once armed
    m2 = StopMatcher(["END"])
    assert m2.feed("xEN", armed=False) + m2.feed("D") == "x" and m2.stopped
    m3 = StopMatcher(["END"])  # the same text armed from the start stops at once
    assert m3.feed("an END here ") == "an " and m3.stopped


def test_incremental_detokenizer_matches_full_decode(codec):
    ids = codec.encode("Grüße aus Köln — 東京 🚀 done.")
    d = codec.detokenizer()
    assert "".join(d.add(t) for t in ids) + d.flush() == codec.decode(ids)


# -- OpenAI endpoints ------------------------------------------------------------------------------------


def test_openai_client_completion_and_chat(served, codec):
    from openai import OpenAI

    server, backend, _ = served
    client = OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model="smollm2-135m-instruct", prompt="Say hi", max_tokens=5, temperature=0)
    script = codec.encode(SCRIPT)
    assert out.choices[0].text == codec.decode(script[:5])
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(codec.encode("Say hi")) and out.usage.completion_tokens == 5
    chat = client.chat.completions.create(model="smollm2-135m-instruct",
                                          messages=[{"role": "user", "content": "hi"}], max_tokens=64)
    assert chat.choices[0].message.content == codec.decode(script)
    assert chat.choices[0].finish_reason == "stop"  # the script ends in eos
    sent = backend.requests[-1]
    expected = codec.encode_chat(codec.chat_prompt([{"role": "user", "content": "hi"}]))
    assert list(sent.prompt_token_ids) == expected
    stream = client.chat.completions.create(model="smollm2-135m-instruct", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=64, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == codec.decode(script)
    assert chunks[-1].usage.completion_tokens == len(script) + 1
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]


def test_a_stream_writes_each_batch_of_tokens_in_one_message(codec, cfg):
    """Tokens the gang sends together (a plan of several decode passes) leave in one HTTP body message, one SSE
    event per token inside it: the proxy and the connection handle a message per plan, not per token. The app is
    driven through its ASGI interface, so every message it sends is seen as sent."""
    backend = FakeBackend(codec.encode(SCRIPT) + list(codec.eos_token_ids), codec.eos_token_ids[0], batch=4)
    app = create_app(ServingCore(backend, codec, Limits.from_config(cfg, "smollm2-135m-instruct")),
                     api_keys=ApiKeyCheck((KEY,)))
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()

    async def call() -> list[dict]:
        sent, got_body = [], False

        async def receive() -> dict:
            nonlocal got_body
            if not got_body:
                got_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)  # no disconnect
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
                 "root_path": "", "server": ("test", 80), "client": ("test", 1),
                 "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {KEY}".encode())]}
        await asyncio.wait_for(app(scope, receive, send), 60)
        return sent

    sent = asyncio.run(call())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = [m["body"].decode() for m in sent[1:] if m["type"] == "http.response.body" and m.get("body")]
    events = [[json.loads(line[6:]) for line in b.split("\n\n") if line.startswith("data: {")] for b in bodies]
    with_tokens = [[e for e in evs if e["choices"]] for evs in events]
    assert [len(evs) for evs in with_tokens if evs] == [4, 4, 2], bodies
    text = "".join(e["choices"][0]["delta"].get("content") or "" for evs in with_tokens for e in evs)
    assert text == codec.decode(codec.encode(SCRIPT)[:10])
    assert [e["usage"]["completion_tokens"] for evs in events for e in evs if e.get("usage")] == [10]
    assert bodies[-1] == "data: [DONE]\n\n"


def test_stream_sse_format_stop_strings_logprobs_and_n(served, codec):
    server, backend, _ = served
    body = {"prompt": "Say hi", "max_tokens": 40, "stream": True, "stop": ["small"], "n": 2, "logprobs": 0,
            "seed": 7}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    by_index: dict[int, str] = {}
    for c in chunks:
        ch = c["choices"][0]
        by_index[ch["index"]] = by_index.get(ch["index"], "") + ch["text"]
        if ch["logprobs"]:
            assert ch["logprobs"]["token_logprobs"] == [-0.5]
    assert by_index == {0: " Hello! I am a ", 1: " Hello! I am a "}
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert finals == ["stop", "stop"]
    seeds = sorted(r.sampling.seed for r in backend.requests[-2:])
    assert seeds == [7, 8]
    # the stop string ended the requests early: the gang was told to free their slots
    deadline = time.monotonic() + 10
    while not set(r.request_id for r in backend.requests[-2:]) <= set(backend.aborted):
        assert time.monotonic() < deadline, backend.aborted
        time.sleep(0.01)


def test_sampling_defaults_and_parameters_reach_the_gang(served, cfg):
    server, backend, _ = served
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                "temperature": 0.3, "top_p": 0.5, "top_k": 20, "seed": 11,
                                                "repetition_penalty": 1.2, "stop_token_ids": [5]})
    assert r.status_code == 200, r.text
    sp = backend.requests[-1].sampling
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty, sp.seed) == (0.3, 0.5, 20, 1.2, 11)
    assert backend.requests[-1].stop_token_ids == (5,) and backend.requests[-1].max_tokens == 3
    _post(server, "/v1/completions", {"prompt": "hi"})
    d = cfg.engine.sampling
    sp = backend.requests[-1].sampling
    assert (sp.temperature, sp.top_p, sp.top_k) == (d.temperature, d.top_p, d.top_k)
    assert backend.requests[-1].max_tokens == 16  # OpenAI's completions default


# -- legacy EasyDeL endpoints ----------------------------------------------------------------------------


def test_legacy_chat_and_instruct(served, codec):
    server, backend, _ = served
    r = _post(server, "/chat", {"prompt": "and now?", "history": [["hi", "hello"]], "greedy": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"input", "response", "tokens_used"}
    assert out["response"] == codec.decode(codec.encode(SCRIPT))
    assert out["tokens_used"] == len(codec.encode(SCRIPT)) + 1
    assert "<|im_start|>user\nhi<|im_end|>" in out["input"] and out["input"].endswith("<|im_start|>assistant\n")
    assert backend.requests[-1].sampling.temperature == 0.0
    r = _post(server, "/instruct", {"instruction": "List 3 colors", "system": "Be brief.", "greedy": False})
    assert r.status_code == 200, r.text
    assert r.json()["input"].startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert backend.requests[-1].sampling.temperature > 0
    _err(_post(server, "/chat", {"prompt": ""}), 400, "prompt", "must not be empty")
    _err(_post(server, "/instruct", {"system": "x"}), 400, "instruction", "field required")
    _err(_post(server, "/chat", {"prompt": "x", "history": [["only one"]]}), 400, "history.0", "")


# -- input errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, param, contains", [
    ({"prompt": "x", "temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "valid number"),
    ({"prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"prompt": "x", "top_k": -2}, "top_k", "greater than or equal to -1"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "only 'echo': true allows"),
    ({"prompt": "x", "max_tokens": 65}, "max_tokens", "at most 64 tokens"),
    ({"prompt": "x", "seed": 2**64 + 5}, None, "outside the 64-bit range"),
    ({"prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
    ({"prompt": "x", "n": 9}, "n", "at most 6"),
    ({"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, "stop", "at most 64 stop strings"),
    ({"prompt": "x", "stop": [""]}, "stop", "must not be empty"),
    ({"prompt": "x", "stream": "yes"}, "stream", "valid boolean"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"prompt": "x", "suffix": "end"}, "suffix", "not supported"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"prompt": "x", "logit_bias": {"5": 101.0}}, "logit_bias.5", "less than or equal to 100"),
    ({"prompt": "x", "logit_bias": {"999999": 1.0}}, "logit_bias", "999999"),
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": []}, "prompt", "must not be empty"),
    ({"prompt": [[]]}, "prompt", "must not be empty"),
    ({"prompt": [1, 2, 999999]}, "prompt", "outside the vocabulary"),
    ({"prompt": None}, "prompt", ""),
    ({}, "prompt", "field required"),
    ({"prompt": "word " * 200}, "prompt", "context is 128 tokens"),
    ({"prompt": "word " * 100, "max_tokens": 60}, "max_tokens", "over this model's context of 128"),
])
def test_completion_bad_values_name_the_field(served, body, param, contains):
    server, _, _ = served
    _err(_post(server, "/v1/completions", body), 400, param, contains)


@pytest.mark.parametrize("body, param, contains", [
    ({"messages": []}, "messages", "at least one message"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages", "no text"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "system"),
    ({"messages": [{"role": "user"}]}, "messages.0.content", "field required"),
    ({"messages": "hi"}, "messages", "valid list"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs", "'logprobs' is not true"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "less than or equal to 20"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 65}, "max_completion_tokens",
     "at most 64"),
    ({"messages": [{"role": "user", "content": "hi " * 150}]}, "messages", "context is 128 tokens"),
])
def test_chat_bad_values_name_the_field(served, body, param, contains):
    server, _, _ = served
    _err(_post(server, "/v1/chat/completions", body), 400, param, contains)


def test_unknown_model_malformed_json_content_type_and_body_size(served):
    server, _, _ = served
    err = _err(_post(server, "/v1/completions", {"model": "gpt-5", "prompt": "x"}), 404, "model", "does not exist")
    assert err["code"] == "model_not_found"
    _err(httpx.get(server.url + "/v1/models/gpt-5", headers={"Authorization": f"Bearer {KEY}"}), 404, "model")
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x",', timeout=10,
                   headers=auth | {"Content-Type": "application/json"})
    assert _err(r, 400, None, "not valid JSON")["code"] == "invalid_json"
    r = httpx.post(server.url + "/v1/completions", content=b'["x"]', timeout=10,
                   headers=auth | {"Content-Type": "application/json"})
    _err(r, 400, None, "must be a JSON object")
    r = httpx.post(server.url + "/v1/completions", content=b'prompt=x', timeout=10,
                   headers=auth | {"Content-Type": "application/x-www-form-urlencoded"})
    _err(r, 415, None, "application/json")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x" * 5000}, headers=auth, timeout=10)
    _err(r, 413, None, "4096 bytes")

    def chunked():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'
    r = httpx.post(server.url + "/v1/completions", content=chunked(), timeout=10,
                   headers=auth | {"Content-Type": "application/json"})
    _err(r, 413, None, "serving.max_body_bytes")
    _err(httpx.get(server.url + "/v2/nothing"), 404, None, "no such route")


def test_api_keys_guard_api_but_not_probes(served):
    server, _, _ = served
    for path, body in [("/v1/completions", {"prompt": "x"}), ("/chat", {"prompt": "x"}),
                       ("/instruct", {"instruction": "x"})]:
        err = _err(_post(server, path, body, key=None), 401, None, "API key")
        assert err["type"] == "authentication_error"
        _err(_post(server, path, body, key="sk-wrong"), 401, None, "API key")
    _err(httpx.get(server.url + "/v1/models"), 401, None, "API key")
    r = httpx.get(server.url + "/v1/models", headers={"X-API-Key": KEY})
    assert r.status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ready").status_code == 200
    status = httpx.get(server.url + "/status", headers={"Authorization": f"Bearer {KEY}"})
    assert status.status_code == 200 and KEY not in status.text


# -- limits and gang states ----------------------------------------------------------------------------------


def test_queue_limit_answers_503_with_retry_after(served):
    server, backend, core = served
    backend.step_s = 0.05

    async def burst():
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
            body = {"prompt": "x", "max_tokens": 20}
            return await asyncio.gather(*[c.post(server.url + "/v1/completions", json=body) for _ in range(10)])

    results = asyncio.run(burst())
    codes = sorted(r.status_code for r in results)
    assert codes.count(200) == 6 and codes.count(503) == 4, codes  # 4 slots + 2 queued
    rejected = next(r for r in results if r.status_code == 503)
    assert rejected.headers["Retry-After"] == "1"
    assert _err(rejected, 503, None, "at capacity")["code"] == "overloaded"
    assert core.in_flight == 0


def test_a_full_queue_below_the_ingress_answers_503_at_once(served):
    server, backend, _ = served
    backend.queue_full = True
    before = backend.submits
    r = _post(server, "/v1/completions", {"prompt": "x"})
    assert _err(r, 503, None, "queue is full")["code"] == "overloaded" and r.headers["Retry-After"] == "1"
    assert backend.submits == before + 1  # refused once, not submitted again and again
    backend.queue_full = False
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_request_timeout_gives_504_and_frees_the_slot(served):
    server, backend, _ = served
    backend.step_s = 0.2
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 50, "timeout_s": 0.5})
    assert _err(r, 504, None, "within 0.5 s")["code"] == "timeout"
    rid = backend.requests[-1].request_id
    deadline = time.monotonic() + 10
    while rid not in backend.aborted:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # streaming: the status line is already sent, so the timeout comes as an error event
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"prompt": "x", "max_tokens": 50, "timeout_s": 0.7, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "timeout"


def test_client_disconnect_aborts_the_request(served):
    server, backend, _ = served
    backend.step_s = 0.05
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"prompt": "x", "max_tokens": 60, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break
    rid = backend.requests[-1].request_id
    deadline = time.monotonic() + 10
    while rid not in backend.aborted or backend.active:
        assert time.monotonic() < deadline, (backend.aborted, backend.active)
        time.sleep(0.01)


def test_gang_restart_gives_retriable_503_and_ready_flips(served):
    server, backend, _ = served
    backend.fail_after_tokens = 2
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 10})
    err = _err(r, 503, None, "restarting")
    assert err["code"] == "service_unavailable" and r.headers["Retry-After"] == "5"
    backend.fail_after_tokens = None
    backend.gang_state = "restarting"
    ready = httpx.get(server.url + "/ready")
    assert ready.status_code == 503 and ready.json()["state"] == "restarting" and "Retry-After" in ready.headers
    _err(_post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}), 503, None,
         "restarting")
    metrics = httpx.get(server.url + "/metrics").text
    assert "raydeploy_gang_ready 0" in metrics
    backend.gang_state = "ready"
    assert httpx.get(server.url + "/ready").status_code == 200
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_status_metrics_and_page(served):
    server, _, _ = served
    _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4})
    st = httpx.get(server.url + "/status", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert st["status"] == "Ready" and st["devices"] == 4 and st["process_count"] == 2
    assert st["mesh"] == {"dp": 2, "tp": 2} and st["requests_served"] >= 1
    assert st["number_of_served_request_until_last_up_time"] >= 1 and len(st["gang"]["gangs"][0]["hosts"]) == 2
    assert st["ready_gangs"] == 1 and st["total_gangs"] == 1
    text = httpx.get(server.url + "/metrics").text
    for name in ("raydeploy_time_to_first_token_seconds_count", "raydeploy_time_per_output_token_seconds_bucket",
                 "raydeploy_tokens_generated_total", "raydeploy_engine_slots_in_use",
                 "raydeploy_engine_queue_depth", 'raydeploy_http_requests_total{endpoint="/v1/completions",status="200"}'):
        assert name in text, name
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "/v1/chat/completions" in page.text


def test_chat_page_streams_an_answer_in_headless_chromium(served, codec):
    from headless_chromium import chat_in_page, chromium_path

    if chromium_path() is None:
        pytest.skip("chromium is not installed (make browser)")
    server, backend, _ = served
    backend.step_s = 0.01
    shown = chat_in_page(server.url, KEY, "Hello there", timeout_s=60)
    assert not shown["error"], shown
    assert shown["user"] == "Hello there" and shown["model"] == "model: smollm2-135m-instruct"
    assert shown["answer"] == codec.decode(codec.encode(SCRIPT))
    pieces = int(shown["stats"].split(" pieces")[0].rsplit(" ", 1)[1])
    assert pieces > 5, shown["stats"]  # it arrived piece by piece, not in one block


def test_api_key_sources_fail_clearly(tmp_path, cfg):
    import dataclasses

    from raydeploy.config import ConfigError
    from raydeploy.serve.auth import load_api_keys

    s = dataclasses.replace(cfg.serving, api_keys_env="RD_TEST_KEYS")
    assert load_api_keys(s, {"RD_TEST_KEYS": " a , b ,"}) == ("a", "b")
    with pytest.raises(ConfigError, match="serving.api_keys_env.*RD_TEST_KEYS is not set"):
        load_api_keys(s, {})
    with pytest.raises(ConfigError, match="holds no API key"):
        load_api_keys(s, {"RD_TEST_KEYS": " , "})
    f = tmp_path / "keys.txt"
    f.write_text("# comment\nk1\n\nk2\n")
    assert load_api_keys(dataclasses.replace(cfg.serving, api_keys_file=str(f)), {}) == ("k1", "k2")
    with pytest.raises(ConfigError, match="serving.api_keys_file.*cannot read"):
        load_api_keys(dataclasses.replace(cfg.serving, api_keys_file=str(tmp_path / "missing")), {})
    assert load_api_keys(cfg.serving, {}) == ()


def test_gang_errors_map_to_retriable_503s():
    import ray.exceptions as rex
    from ray.serve.exceptions import BackPressureError

    from raydeploy.engine.scheduler import QueueFullError
    from raydeploy.gang.bringup import GangError
    from raydeploy.gang.coordinator import GangUnavailableError
    from raydeploy.gang.placement import PlacementError
    from raydeploy.serve.backend import is_gang_failure as _is_gang_failure
    from raydeploy.serve.backend import is_queue_full as _is_queue_full

    full = rex.RayTaskError("generate", "tb", QueueFullError(8, 8)).as_instanceof_cause()
    assert _is_queue_full(full) and not _is_gang_failure(full)
    gone = rex.RayTaskError("generate", "tb", GangUnavailableError("restarting")).as_instanceof_cause()
    assert _is_gang_failure(gone) and not _is_queue_full(gone)
    assert _is_gang_failure(GangError("bring-up failed", phase="init"))
    assert _is_gang_failure(rex.RayTaskError("get_coordinator", "tb", PlacementError("no room")))
    assert _is_gang_failure(rex.ActorDiedError())
    assert _is_queue_full(BackPressureError(num_queued_requests=8, max_queued_requests=8))
    assert not _is_gang_failure(rex.RayTaskError("generate", "tb", ValueError("bad")).as_instanceof_cause())

    # matched by type, not by name: a class that only shares the name is someone else's error
    class GangUnavailableError(RuntimeError):  # noqa: F811 - the look-alike is the point
        pass

    class QueueFullError(RuntimeError):  # noqa: F811
        pass

    for lookalike in (GangUnavailableError("x"), QueueFullError("x")):
        wrapped = rex.RayTaskError("generate", "tb", lookalike).as_instanceof_cause()
        assert not _is_gang_failure(wrapped) and not _is_queue_full(wrapped)


def test_the_ingress_imports_no_jax():
    import subprocess
    import sys

    code = ("import sys; import raydeploy.serve.deployment, raydeploy.serve.app, raydeploy.serve.backend; "
            "print(sorted(m for m in ('jax', 'jaxlib', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_requests_served_counts_generations_not_polls(served):
    server, _, _ = served
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/health", "/ready", "/status", "/metrics", "/v1/models", "/status", "/"):
        assert httpx.get(server.url + path, headers=auth).status_code == 200, path
    st = httpx.get(server.url + "/status", headers=auth).json()
    assert st["requests_served"] == 0 and st["serving"]["requests_served"] == 0, st
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 3}).status_code == 200
    assert _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                                  "stream": True}).status_code == 200
    assert _post(server, "/instruct", {"instruction": "x", "max_new_tokens": 2}).status_code == 200
    _err(_post(server, "/v1/completions", {"prompt": ""}), 400, "prompt")  # a refused request is not served
    st = httpx.get(server.url + "/status", headers=auth).json()
    assert st["requests_served"] == 3 and st["number_of_served_request_until_last_up_time"] == 3, st
    assert st["serving"]["tokens_generated"] == 7, st["serving"]
    text = httpx.get(server.url + "/metrics").text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples["raydeploy_requests_served_total"] == 3
    assert samples["raydeploy_tokens_generated_total"] == 7
    assert samples['raydeploy_http_requests_total{endpoint="/health",status="200"}'] == 1
    assert samples['raydeploy_http_requests_total{endpoint="/status",status="200"}'] == 4
    assert samples['raydeploy_http_requests_total{endpoint="/v1/completions",status="400"}'] == 1
    assert samples["raydeploy_time_to_first_token_seconds_count"] == 3
    assert samples['raydeploy_time_to_first_token_seconds_bucket{le="+Inf"}'] == 3
    assert samples["raydeploy_request_duration_seconds_count"] == 3
    assert samples["raydeploy_requests_in_flight"] == 0 and samples["raydeploy_requests_waiting_first_token"] == 0
    assert samples["raydeploy_gang_ready"] == 1 and samples['raydeploy_gang_state{state="ready"}'] == 1
    assert samples["raydeploy_gang_restarts_total"] == 0
    assert samples["raydeploy_gangs_ready"] == 1 and samples["raydeploy_gangs"] == 1
    assert samples['raydeploy_gang_up{gang="fake_gang"}'] == 1
    assert samples['raydeploy_gang_slots_in_use{gang="fake_gang"}'] == 0
    assert samples["raydeploy_engine_slots_in_use"] == 0 and samples["raydeploy_engine_queue_depth"] == 0
    for name in ("raydeploy_time_per_output_token_seconds", "raydeploy_request_duration_seconds",
                 "raydeploy_prompt_tokens_total", "raydeploy_http_requests_total"):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
