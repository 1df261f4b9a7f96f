"""Hostile and careless requests cost the server little before it refuses them, and never get a 5xx.

- Reading a body is linear in its size: the bodies that were worst for the old depth pre-scan (quadratic on an
  unclosed string of escaped quotes) cost about what `json.loads` of the same bytes costs.
- Counts are bounded in validation, and capacity is taken before any tokenizer call: a body with huge counts is
  a 4xx with no tokenizer call at all (the tokenizer is wrapped in a counting double).
- Token ids are checked against the model's vocabulary, a chat template that raises is a 400 naming its
  message, a NaN log-probability is written as null.

The app is the real FastAPI app (`create_app`) over the in-process fake gang of tests/serve_fakes.py, called
in-process through httpx's ASGI transport; the tokenizer is the real SmolLM2 one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from raydeploy.serve.body import MAX_DEPTH, parse_json_object
from raydeploy.serve.errors import InvalidRequest

# -- parsing cost ------------------------------------------------------------------------------------------


def _old_worst_case(size: int) -> bytes:
    """More brackets than MAX_DEPTH (so the pre-scan runs), then an unclosed string of escaped quotes: the old
    string-stripping regex retried from every quote inside it, each time to the end of the body."""
    head = b'{"prompt": ' + b"[" * (MAX_DEPTH + 8) + b'"'
    return head + b'\\"' * ((size - len(head)) // 2)


def _best_s(fn: Callable[[], Any], reps: int = 7, budget_s: float = 3.0) -> float:
    """The fastest of a few runs (the least disturbed by other work on the machine); fewer runs when slow."""
    times: list[float] = []
    spent = 0.0
    while len(times) < reps and (spent < budget_s or not times):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        spent += times[-1]
    return min(times)


def _parse(raw: bytes) -> str | None:
    try:
        parse_json_object(raw)
    except InvalidRequest as e:
        return e.message
    return None


def _loads(raw: bytes) -> None:
    try:
        json.loads(raw)
    except ValueError:
        pass


def test_the_worst_body_for_the_old_pre_scan_parses_in_linear_time():
    small, big = _old_worst_case(16 * 1024), _old_worst_case(128 * 1024)
    assert "levels deep" in (_parse(small) or "")
    # 8x the bytes: a linear check costs ~8x, the old quadratic one cost 64x (2 s vs 33 s measured)
    ratio = _best_s(lambda: _parse(big)) / _best_s(lambda: _parse(small))
    assert ratio < 24, f"8x the body cost {ratio:.1f}x the time: not linear"
    mib = _old_worst_case(1 << 20)
    assert "levels deep" in (_parse(mib) or "")
    vs_loads = _best_s(lambda: _parse(mib)) / _best_s(lambda: _loads(mib))
    assert vs_loads < 50, f"checking a 1 MiB body cost {vs_loads:.0f}x json.loads of it"


SHAPES = {
    "200k short strings": b'{"prompt": [' + b'"a",' * 200_000 + b'"a"]}',
    "400k integers": b'{"prompt": [' + b"1," * 400_000 + b"1]}",
    "200k one-item lists": b'{"prompt": [' + b"[1]," * 200_000 + b"[1]]}",
    "100k objects": b'{"messages": [' + b'{"a":1},' * 100_000 + b"{}]}",
    "a long key over many values": b'{"' + b"k" * 8192 + b'": [' + b"0," * 60_000 + b"0]}",
    "many values, the last one bad": b'{"prompt": [' + b'"a",' * 200_000 + b'"\\u0000"]}',
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_every_shape_of_body_costs_about_what_json_loads_costs(name):
    raw = SHAPES[name]
    vs_loads = _best_s(lambda: _parse(raw), reps=3) / _best_s(lambda: _loads(raw), reps=3)
    assert vs_loads < 50, f"{name}: the check cost {vs_loads:.0f}x json.loads"


def test_the_rules_still_hold_after_the_fast_path():
    assert _parse(b'{"prompt": [1, 9223372036854775807, -9223372036854775808]}') is None
    assert "outside the 64-bit range" in (_parse(b'{"prompt": [1, 9223372036854775808]}') or "")
    assert "outside the 64-bit range" in (_parse(b'{"a": {"b": [-9223372036854775809]}}') or "")
    assert "outside the 64-bit range" in (_parse(b'{"a": ' + b"7" * 5000 + b"}") or "")
    assert _parse(b'{"prompt": "12345678901234567890 is text, not a number"}') is None
    assert _parse(b'{"prompt": "\\ud83d\\ude00 a pair is fine"}') is None
    assert _parse(b'{"prompt": "an escaped backslash then u0000: \\\\u0000"}') is None
    msg = _parse(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\u0000"}]}]}')
    assert msg == "'messages.0.content.0.text' holds a NUL character (U+0000), which is not valid in text"
    assert "a key in 'a'" in (_parse(b'{"a": {"\\udc00": 1}}') or "")
    assert "appears twice" in (_parse(b'{"a": 1, "a": 2}') or "")
    assert "too large for a float" in (_parse(b'{"a": 1e999}') or "")
    assert "NaN is not a JSON number" in (_parse(b'{"a": NaN}') or "")
    assert _parse(b'{"a": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}") is not None
    assert _parse(b'{"a": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}") is None


# -- counts, admission, vocabulary, templates, NaN over HTTP -----------------------------------------------

MODEL = "smollm2-135m-instruct"
MODEL_VOCAB = 1000
"""The test model's embedding is smaller than its tokenizer here, so ids the tokenizer knows can be past it."""
RAISING_TEMPLATE = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                    "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
"""What Gemma's and Mistral's templates do on an unexpected role order."""


class CountingTokenizer:
    """The real tokenizer, counting the calls that do per-prompt work and noting the threads they run on."""

    def __init__(self, inner: Any, chat_template: str | None = None) -> None:
        self.inner = inner
        self.chat_template = chat_template if chat_template is not None else inner.chat_template
        self.calls = 0
        self.threads: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def _note(self) -> None:
        import threading

        self.calls += 1
        self.threads.add(threading.current_thread().name)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self._note()
        return self.inner.encode(*args, **kwargs)

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> Any:
        self._note()
        if self.chat_template == self.inner.chat_template:
            return self.inner.apply_chat_template(messages, **kwargs)
        return self.inner.apply_chat_template(messages, chat_template=self.chat_template, **kwargs)


class NaNLogprobBackend:
    """The fake gang, reporting NaN for every token's log-probability (as a broken step would)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, req: Any) -> Any:
        import dataclasses

        async for events in self.inner.generate(req):
            yield [dataclasses.replace(e, logprob=float("nan")) if e.token_id is not None else e for e in events]


@pytest.fixture(scope="module")
def real_tokenizer() -> Any:
    from serve_fakes import tokenizer_dir

    from raydeploy.serve.text import TextCodec

    return TextCodec.from_dir(tokenizer_dir()).tokenizer


def _serve(tokenizer: Any, *, nan_logprobs: bool = False) -> Any:
    from serve_fakes import FakeBackend, ThreadedServer

    from raydeploy.config import load_config
    from raydeploy.serve.app import create_app
    from raydeploy.serve.generation import Limits, ServingCore
    from raydeploy.serve.text import TextCodec

    cfg = load_config(None, ["model.max_seq_len=128", "engine.max_new_tokens=64",
                             "engine.max_slots=4", "serving.max_queue=2", "serving.max_body_bytes=4194304"])
    codec = TextCodec(tokenizer, model_vocab_size=MODEL_VOCAB)
    script = [t for t in tokenizer.inner.encode(" Hi there.") if t < MODEL_VOCAB] + [codec.eos_token_ids[0]]
    backend: Any = FakeBackend(script, codec.eos_token_ids[0])
    if nan_logprobs:
        backend = NaNLogprobBackend(backend)
    core = ServingCore(backend, codec, Limits.from_config(cfg, MODEL))
    return ThreadedServer(create_app(core, max_body_bytes=cfg.serving.max_body_bytes)), core


@pytest.fixture(scope="module")
def counted(real_tokenizer):
    tok = CountingTokenizer(real_tokenizer)
    server, core = _serve(tok)
    with server:
        yield server, tok, core


def _post(server: Any, path: str, body: Any) -> Any:
    import httpx

    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)


def _error(resp: Any, status: int, param: str | None, *words: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    return err


HUGE_COUNTS = [
    ("150k one-token prompts, n=8", "/v1/completions", {"prompt": ["x"] * 150_000, "n": 8}, "prompt",
     ["150000 prompts", "at most 1024"]),
    ("150k prompts of ids", "/v1/completions", {"prompt": [[42]] * 150_000}, "prompt", ["150000 prompts"]),
    ("1000 prompts x n=8, past capacity", "/v1/completions", {"prompt": ["x"] * 1000, "n": 8}, "n",
     ["asks for 8000 sequences", "at most 6"]),
    ("100k stop_token_ids", "/v1/completions", {"prompt": "x", "stop_token_ids": list(range(100_000))},
     "stop_token_ids", ["100000 token ids", "at most 1024"]),
    ("60k messages", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 60_000},
     "messages", ["60000 messages", "at most 2048"]),
    ("3000 text parts", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 3000}]}, "messages.0.content",
     ["3000 text parts", "at most 2048"]),
    ("5000 history turns", "/chat", {"prompt": "x", "history": [["a", "b"]] * 5000}, "history",
     ["5000 turns", "at most 1024"]),
    ("65 stop strings", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "stop": [f"s{i}" for i in range(65)]}, "stop",
     ["at most 64 stop strings"]),
]


@pytest.mark.parametrize("name,route,body,param,words", HUGE_COUNTS, ids=[h[0] for h in HUGE_COUNTS])
def test_huge_counts_are_a_4xx_before_any_tokenizer_call(counted, name, route, body, param, words):
    server, tok, core = counted
    before = tok.calls
    _error(_post(server, route, body), 400, param, *words)
    assert tok.calls == before, f"{name}: the tokenizer ran {tok.calls - before} times before the refusal"
    assert core.in_flight == 0


def test_prompts_are_tokenized_after_admission_and_off_the_event_loop(counted):
    server, tok, core = counted
    before = tok.calls
    r = _post(server, "/v1/completions", {"prompt": ["one", "two", "three"], "n": 2, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 6
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert tok.calls - before == 3 + 2  # three prompts; one template and its encoding
    assert tok.threads and all(t.startswith("raydeploy-tokenize") for t in tok.threads), tok.threads
    assert core.in_flight == 0


def test_token_ids_are_checked_against_the_models_vocabulary(counted, real_tokenizer):
    server, tok, core = counted
    assert len(real_tokenizer) > MODEL_VOCAB  # the tokenizer knows ids the model's embedding does not
    _error(_post(server, "/v1/completions", {"prompt": [5, MODEL_VOCAB], "max_tokens": 1}), 400, "prompt",
           f"token id {MODEL_VOCAB}", f"vocabulary of this model ({MODEL_VOCAB} ids: 0 to {MODEL_VOCAB - 1})")
    _error(_post(server, "/v1/completions", {"prompt": [[1, 2], [3, 4000]], "max_tokens": 1}), 400, "prompt",
           "token id 4000")
    _error(_post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                  "stop_token_ids": [7, 20_000]}), 400, "stop_token_ids",
           "token id 20000", f"{MODEL_VOCAB} ids")
    r = _post(server, "/v1/completions", {"prompt": [5, MODEL_VOCAB - 1], "max_tokens": 1,
                                          "stop_token_ids": [MODEL_VOCAB - 1]})
    assert r.status_code == 200, r.text
    assert core.in_flight == 0


def test_a_chat_template_that_raises_is_a_400_naming_its_message(real_tokenizer):
    tok = CountingTokenizer(real_tokenizer, chat_template=RAISING_TEMPLATE)
    server, core = _serve(tok)
    with server:
        bad = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]
        err = _error(_post(server, "/v1/chat/completions", {"messages": bad}), 400, "messages",
                     "chat template", "Conversation roles must alternate user/assistant")
        assert err["code"] == "invalid_chat_template"
        err = _error(_post(server, "/v1/chat/completions", {"messages": bad, "stream": True}), 400, "messages",
                     "Conversation roles must alternate")
        assert core.in_flight == 0  # admitted before templating, released on the refusal
        good = [{"role": "user", "content": "hi"}]
        r = _post(server, "/v1/chat/completions", {"messages": good, "max_tokens": 2})
        assert r.status_code == 200, r.text
        r = _post(server, "/chat", {"prompt": "hi", "history": [["a", "b"]], "system": "be brief"})
        _error(r, 400, "prompt", "Conversation roles must alternate")


def test_nan_logprobs_are_written_as_null_whole_and_streamed(real_tokenizer, caplog):
    server, _ = _serve(CountingTokenizer(real_tokenizer), nan_logprobs=True)

    def strict(text: str) -> Any:
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in a JSON answer"))

    with server, caplog.at_level("WARNING", logger="raydeploy.serve"):
        r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 3, "logprobs": 0})
        assert r.status_code == 200, r.text
        lps = strict(r.text)["choices"][0]["logprobs"]["token_logprobs"]
        assert lps and all(lp is None for lp in lps)
        r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                   "max_tokens": 3, "logprobs": True})
        assert r.status_code == 200, r.text
        content = strict(r.text)["choices"][0]["logprobs"]["content"]
        assert content and all(c["logprob"] is None for c in content)
        for route, body in (("/v1/completions", {"prompt": "x", "logprobs": 0}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                      "logprobs": True})):
            r = _post(server, route, body | {"max_tokens": 3, "stream": True})
            assert r.status_code == 200, r.text
            events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ") and ln != "data: [DONE]"]
            assert events and "NaN" not in r.text
            for e in events:
                strict(e)
    assert any("not finite numbers" in rec.getMessage() for rec in caplog.records)


def test_responses_write_non_finite_logprobs_as_null(real_tokenizer, caplog):
    from raydeploy.serve.generation import Choice, Piece
    from raydeploy.serve.responses import ChatBuilder, CompletionBuilder
    from raydeploy.serve.text import TextCodec

    codec = TextCodec(real_tokenizer)
    choice = Choice(0, "ab", [28, 29, 30], [float("nan"), -0.25, float("-inf")], "length", 2)
    with caplog.at_level("WARNING", logger="raydeploy.serve"):
        whole = CompletionBuilder("cmpl-1", MODEL, codec, True).whole([choice], 2)
        assert whole["choices"][0]["logprobs"]["token_logprobs"] == [None, -0.25, None]
        chat = ChatBuilder("chat-1", MODEL, codec, True).whole([choice], 2)
        assert [c["logprob"] for c in chat["choices"][0]["logprobs"]["content"]] == [None, -0.25, None]
        chunk = ChatBuilder("chat-2", MODEL, codec, True).chunk(0, Piece("a", 28, float("nan")), False)
        assert chunk["choices"][0]["logprobs"]["content"][0]["logprob"] is None
        for body in (whole, chat, chunk):
            json.dumps(body, allow_nan=False)
    assert sum("not finite numbers" in r.getMessage() for r in caplog.records) == 3
    assert any("cmpl-1" in r.getMessage() for r in caplog.records)


def test_a_page_pool_smaller_than_one_sequence_is_a_config_error():
    from raydeploy.config import ConfigError, load_config

    base = ["model.max_seq_len=128", "engine.max_new_tokens=64"]
    with pytest.raises(ConfigError, match=r"engine.num_pages.*is 7 pages, fewer than one sequence of "
                                          r"model.max_seq_len 128 needs \(8 pages of engine.page_size 16\)"):
        load_config(None, [*base, "engine.num_pages=7"])
    assert load_config(None, [*base, "engine.num_pages=8"]).engine.num_pages == 8
    assert load_config(None, [*base, "engine.num_pages=0"]).engine.num_pages == 0
