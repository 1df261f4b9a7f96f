"""Fuzzing the HTTP API: every route from its OpenAPI schema (schemathesis + hypothesis), and hand-written
hostile bodies. No answer may be a 5xx; every 4xx carries an OpenAI-shaped error; the server still answers a
normal request correctly afterwards.

The app is the real FastAPI app (`create_app`) behind real HTTP (uvicorn on loopback) with the real SmolLM2
tokenizer; only the gang is the in-process stand-in of tests/serve_fakes.py. The schema is the one the
server publishes at GET /openapi.json.
"""

from __future__ import annotations

import collections
import json

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from serve_fakes import FakeBackend, ThreadedServer, tokenizer_dir

from raydeploy.config import load_config
from raydeploy.serve.app import create_app
from raydeploy.serve.auth import ApiKeyCheck
from raydeploy.serve.body import MAX_DEPTH
from raydeploy.serve.generation import Limits, ServingCore
from raydeploy.serve.text import TextCodec

KEY = "sk-fuzz-4d2a7"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "smollm2-135m-instruct"
SCRIPT = " Fine, thanks. And you?"
MIN_GENERATED_REQUESTS = 1000
EXAMPLES_PER_BODY_ROUTE = 130
"""Per generation mode (schema-valid and schema-breaking) per POST route: 4 x 2 x 130 = 1040 bodies."""
EXAMPLES_PER_OTHER_ROUTE = 40
PLENTY_OF_TIME_S = 30.0


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_dir(tokenizer_dir())


@pytest.fixture(scope="module")
def served(codec):
    cfg = load_config(None, ["model.max_seq_len=128",
                             "engine.max_new_tokens=64", "engine.max_slots=4", "serving.max_queue=4",
                             "serving.max_body_bytes=65536"])
    backend = FakeBackend(codec.encode(SCRIPT) + list(codec.eos_token_ids), codec.eos_token_ids[0], step_s=0.0002)
    core = ServingCore(backend, codec, Limits.from_config(cfg, MODEL))
    app = create_app(core, api_keys=ApiKeyCheck((KEY,)), max_body_bytes=cfg.serving.max_body_bytes)
    with ThreadedServer(app) as server:
        yield server, backend, core


def check_answer(status: int, content_type: str, text: str, what: str, secret: str = KEY) -> None:
    """No 5xx; a 4xx is OpenAI-shaped JSON that leaks nothing."""
    assert status < 500, f"{what}: {status} {text[:300]}"
    if status >= 400:
        assert content_type.startswith("application/json"), (what, content_type)
        err = json.loads(text)["error"]
        assert set(err) == {"message", "type", "param", "code"}, (what, err)
        assert isinstance(err["message"], str) and err["message"], (what, err)
        assert err["param"] is None or isinstance(err["param"], str), (what, err)
        assert "Traceback" not in text and "/work" not in text and secret not in text, (what, text)


def _answers_correctly(server, codec) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "How are you?"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == codec.decode(codec.encode(SCRIPT))


def _no_short_deadline(case):
    """A deadline the client sets and the server then meets is a 504 by design (test_serve_http.py checks
    it); the fuzz is about what bodies do, so a generated `timeout_s` is made long enough to be met."""
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("timeout_s"), int | float) \
            and not isinstance(body.get("timeout_s"), bool) and body["timeout_s"] > 0:
        body["timeout_s"] = max(body["timeout_s"], PLENTY_OF_TIME_S)
    return case


def fuzz_route(op, mode: GenerationMode, examples: int, url: str, session: requests.Session,
               sent: collections.Counter[str], statuses: collections.Counter[int], *,
               headers: dict[str, str] = AUTH, secret: str = KEY, adjust=_no_short_deadline) -> None:
    """Send `examples` generated requests for one route and mode; hypothesis shrinks a failing one."""

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode).map(adjust))
    def send(case):
        resp = case.call(base_url=url, session=session, headers=headers, timeout=300)
        sent[op.label] += 1
        statuses[resp.status_code] += 1
        check_answer(resp.status_code, (resp.headers.get("content-type") or [""])[0], resp.text,
               f"{op.label} ({mode.value}) body={str(case.body)[:200]!r}", secret)

    send()


def test_every_route_fuzzed_from_its_openapi_schema_never_answers_5xx(served, codec):
    server, backend, core = served
    published = httpx.get(server.url + "/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(published)
    operations = [r.ok() for r in schema.get_all_operations()]
    routes = {op.label for op in operations}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /chat", "POST /instruct",
            "GET /v1/models", "GET /v1/models/{model_id}", "GET /health", "GET /ready", "GET /status",
            "GET /metrics", "GET /"} <= routes, routes
    sent: collections.Counter[str] = collections.Counter()
    statuses: collections.Counter[int] = collections.Counter()
    session = requests.Session()
    for op in operations:
        has_body = op.body is not None and len(op.body) > 0
        # routes without a body or with only a free-form path string have nothing to break in the schema
        modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if has_body else [GenerationMode.POSITIVE]
        for mode in modes:
            fuzz_route(op, mode, EXAMPLES_PER_BODY_ROUTE if has_body else EXAMPLES_PER_OTHER_ROUTE, server.url,
                       session, sent, statuses)
    total = sum(sent.values())
    print(f"fuzz: {total} requests; by route {dict(sent)}; by status {dict(sorted(statuses.items()))}")
    assert total >= MIN_GENERATED_REQUESTS, sent
    assert not any(s >= 500 for s in statuses), statuses
    assert statuses[200] > 0 and sum(n for s, n in statuses.items() if 400 <= s < 500) > 0, statuses
    assert core.in_flight == 0 and not backend.active
    _answers_correctly(server, codec)


# -- hand-written hostile bodies -------------------------------------------------------------------------


def _deep(n: int) -> bytes:
    return b'{"model": "m", "prompt": ' + b"[" * n + b"1" + b"]" * n + b"}"


CHAT = '{"messages": [{"role": "user", "content": %s}]}'
HOSTILE: list[tuple[str, str, bytes, int, str | None, str]] = [
    # (name, route, raw body, status, param, words in the message)
    ("lone surrogate in chat text", "/v1/chat/completions", (CHAT % '"hi \\ud800 there"').encode(), 400,
     "messages.0.content", "lone UTF-16 surrogate"),
    ("lone low surrogate in a text part", "/v1/chat/completions",
     (CHAT % '[{"type": "text", "text": "\\udfff"}]').encode(), 400, "messages.0.content.0.text", "surrogate"),
    ("lone surrogate in prompt", "/v1/completions", b'{"prompt": "\\ud83d"}', 400, "prompt", "surrogate"),
    ("lone surrogate in a key", "/v1/completions", b'{"prompt": "x", "\\ud800": 1}', 400, None, "surrogate"),
    ("lone surrogate in a nested key", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x", "\\udbff": 1}]}', 400, "messages.0", "a key in 'messages.0'"),
    ("lone surrogate in legacy chat history", "/chat", b'{"prompt": "x", "history": [["a", "\\ud800"]]}', 400,
     "history.0.1", "surrogate"),
    ("surrogate bytes (CESU-8) in the body", "/instruct", b'{"instruction": "\xed\xa0\x80"}', 400, None, "UTF-8"),
    ("escaped NUL in text", "/v1/completions", b'{"prompt": "a\\u0000b"}', 400, "prompt", "NUL"),
    ("escaped NUL in instruction", "/instruct", b'{"instruction": "\\u0000"}', 400, "instruction", "NUL"),
    ("raw NUL byte in a string", "/v1/completions", b'{"prompt": "a\x00b"}', 400, None, "not valid JSON"),
    ("raw NUL byte as the body", "/chat", b"\x00", 400, None, "not valid JSON"),
    ("10k-deep arrays", "/v1/completions", _deep(10_000), 400, None, "10001 levels deep"),
    ("10k-deep objects", "/v1/chat/completions", b'{"a":' * 10_000 + b"1" + b"}" * 10_000, 400, None,
     "levels deep"),
    ("just over the depth limit", "/v1/completions", _deep(MAX_DEPTH), 400, None, "levels deep"),
    ("unbalanced deep brackets", "/v1/completions", b"[" * 5000, 400, None, "levels deep"),
    ("huge integer max_tokens", "/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400,
     None, "64-bit range"),
    ("integer just past 64 bits", "/v1/completions", b'{"prompt": "x", "seed": 9223372036854775808}', 400, None,
     "64-bit range"),
    ("large max_tokens", "/v1/completions", b'{"prompt": "x", "max_tokens": 9223372036854775807}', 400,
     "max_tokens", "at most 64"),
    ("large top_k", "/v1/chat/completions", (CHAT % '"x"').encode()[:-1] + b', "top_k": 1099511627776}', 400,
     "top_k", "less than or equal"),
    ("huge token id", "/v1/completions", b'{"prompt": [4611686018427387904]}', 400, "prompt", "vocabulary"),
    ("NaN temperature", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None, "NaN"),
    ("Infinity timeout", "/v1/completions", b'{"prompt": "x", "timeout_s": Infinity}', 400, None, "Infinity"),
    ("-Infinity top_p", "/chat", b'{"prompt": "x", "top_p": -Infinity}', 400, None, "-Infinity"),
    ("float overflow", "/instruct", b'{"instruction": "x", "temperature": 1e400}', 400, None, "too large"),
    ("duplicate keys", "/v1/completions", b'{"prompt": "x", "max_tokens": 1, "max_tokens": 100000}', 400, None,
     "appears twice"),
    ("duplicate keys nested", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "role": "system", "content": "x"}]}', 400, None, "'role' appears twice"),
    ("not UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, "not UTF-8"),
    ("UTF-8 byte order mark", "/v1/completions", b'\xef\xbb\xbf{"prompt": "x"}', 400, None, "not valid JSON"),
    ("empty body", "/v1/completions", b"", 400, None, "not valid JSON"),
    ("null body", "/v1/chat/completions", b"null", 400, None, "found null"),
    ("array body", "/chat", b'[{"prompt": "x"}]', 400, None, "found an array"),
    ("trailing garbage", "/instruct", b'{"instruction": "x"} {}', 400, None, "not valid JSON"),
    ("n times prompts above the server's capacity", "/v1/completions", b'{"prompt": ["x", "y"], "n": 8}', 400, "n",
     "asks for 16 sequences"),
]


@pytest.mark.parametrize("name,route,raw,status,param,words", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_bodies_get_a_4xx_naming_the_problem(served, name, route, raw, status, param, words):
    server, _, _ = served
    r = httpx.post(server.url + route, content=raw, headers=AUTH | {"Content-Type": "application/json"}, timeout=30)
    check_answer(r.status_code, r.headers.get("content-type", ""), r.text, name)
    assert r.status_code == status, (name, r.text)
    err = r.json()["error"]
    assert err["param"] == param, (name, err)
    assert words.lower() in err["message"].lower(), (name, err)


def test_wrong_content_types_huge_bodies_and_odd_paths(served, codec):
    server, _, _ = served
    body = json.dumps({"prompt": "x"}).encode()
    for ctype in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                  "application/jsonx", "application/json-patch+json", "\u00e9/\u00e9".encode("latin-1")):
        headers = AUTH | ({"Content-Type": ctype} if ctype is not None else {})
        r = httpx.post(server.url + "/v1/completions", content=body, headers=headers, timeout=10)
        check_answer(r.status_code, r.headers.get("content-type", ""), r.text, f"content type {ctype!r}")
        assert r.status_code == 415 and "must be application/json" in r.json()["error"]["message"], (ctype, r.text)
    # UTF-16 with a charset that says so: this server takes UTF-8 only
    r = httpx.post(server.url + "/v1/completions", content='{"prompt": "x"}'.encode("utf-16"),
                   headers=AUTH | {"Content-Type": "application/json; charset=utf-16"}, timeout=10)
    check_answer(r.status_code, r.headers.get("content-type", ""), r.text, "utf-16")
    assert r.status_code == 400 and "UTF-8" in r.text
    big = b'{"prompt": "' + b"x" * 5_000_000 + b'"}'
    for name, content in (("5 MB with a length", big), ("5 MB chunked", iter([big[i:i + 65536]
                                                                               for i in range(0, len(big), 65536)]))):
        r = httpx.post(server.url + "/v1/completions", content=content, timeout=30,
                       headers=AUTH | {"Content-Type": "application/json"})
        check_answer(r.status_code, r.headers.get("content-type", ""), r.text, name)
        assert r.status_code == 413 and "65536 bytes" in r.json()["error"]["message"], (name, r.text)
    for path in ("/v1/models/%00", "/v1/models/%ED%A0%80", "/v1/models/" + "a" * 4000, "/v1/%FF", "/%00",
                 "/v1/completions/../../etc/passwd"):
        r = httpx.get(server.url + path, headers=AUTH, timeout=10)
        check_answer(r.status_code, r.headers.get("content-type", ""), r.text, path)
        assert r.status_code in (404, 405), (path, r.status_code, r.text)
    r = httpx.request("DELETE", server.url + "/v1/completions", headers=AUTH, timeout=10)
    check_answer(r.status_code, r.headers.get("content-type", ""), r.text, "DELETE")
    assert r.status_code == 405
    _answers_correctly(server, codec)
