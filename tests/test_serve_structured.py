"""Structured outputs and tool calling at the HTTP layer, over an in-process fake gang.

Real HTTP (uvicorn on loopback), the real SmolLM2 tokenizer and chat template (which has no tool support, so
tools go through the fallback prompt and calls are parsed in the Hermes format), the real grammar engine for the
400s; only the gang is a stand-in, which records the requests it gets and answers with a scripted token list.
The same requests against the real gang are in test_structured_e2e.py.
"""

from __future__ import annotations

import json

import httpx
import pytest
from serve_fakes import FakeBackend, ThreadedServer, tokenizer_dir

from raydeploy.config import load_config
from raydeploy.constraints import check
from raydeploy.serve.app import ServerInfo, create_app
from raydeploy.serve.auth import ApiKeyCheck
from raydeploy.serve.chat import ChatFormat
from raydeploy.serve.generation import Limits, ServingCore
from raydeploy.serve.text import TextCodec

KEY = "sk-test-structured-0123"
MODEL = "smollm2-135m-instruct"
PLAIN = " The weather is fine."
ARGS = {"city": "Paris", "days": 3, "units": ["c", "f"]}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(ARGS) + '}\n</tool_call>'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "units": {"type": "array", "items": {"type": "string"}}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_dir(tokenizer_dir())


@pytest.fixture(scope="module")
def served(codec):
    cfg = load_config(None, ["model.max_seq_len=1024", "engine.max_new_tokens=128", "engine.max_slots=4",
                             "serving.max_queue=4"])
    backend = FakeBackend(_script(codec, PLAIN), codec.eos_token_ids[0])
    core = ServingCore(backend, codec, Limits.from_config(cfg, MODEL))
    chat = ChatFormat.create(codec, "llama")  # SmolLM2's config says llama; its template has no tools
    app = create_app(core, api_keys=ApiKeyCheck((KEY,)), info=ServerInfo(), chat=chat)
    with ThreadedServer(app) as server:
        yield server, backend


@pytest.fixture()
def answers(served, codec):
    """Set what the fake gang answers (token ids of a text, then eos) for one test."""
    _, backend = served

    def set_to(text: str) -> None:
        backend.script_ids = _script(codec, text)

    yield set_to
    set_to(PLAIN)


def _script(codec: TextCodec, text: str) -> list[int]:
    return codec.encode(text) + list(codec.eos_token_ids)


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30, **kw)


def _chat(server, **body) -> httpx.Response:
    return _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 100, **body})


def _err(resp: httpx.Response, param: str, *contains: str) -> dict:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    for c in contains:
        assert c.lower() in err["message"].lower(), err
    assert "Traceback" not in resp.text and "/work" not in resp.text
    return err


def _events(resp: httpx.Response) -> list[dict]:
    assert resp.status_code == 200, resp.text
    lines = [ln[len("data: "):] for ln in resp.text.split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


# -- 400s naming the problem -------------------------------------------------------------------------------


@pytest.mark.parametrize("body, param, contains", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nope"}}}},
     "response_format", ["nope"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
     "response_format", ["json_schema.schema", "required"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": [1]}}},
     "response_format", ["must be a JSON object", "array"]),
    ({"response_format": {"type": "xml"}}, "response_format", ["xml"]),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", ["regex", "unclosed group"]),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs", ["grammar"]),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", ["not valid JSON"]),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", ["at least one"]),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", ["exactly one", "regex, choice"]),
    ({"structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}},
     "structured_outputs", ["response_format", "cannot be combined"]),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_wether"}}},
     "tool_choice", ["get_wether", "get_weather"]),
    ({"tools": [WEATHER, WEATHER]}, "tools", ["get_weather", "more than once"]),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", ["pattern"]),
    ({"tool_choice": "required"}, "tool_choice", ["no 'tools'"]),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", ["required", "response_format", "cannot be combined"]),
    ({"tools": [{"type": "function", "function": {"name": "broken", "parameters": {"type": "nope"}}}, WEATHER],
      "tool_choice": "required"}, "tools", ["broken", "nope"]),
    ({"tools": [WEATHER] * 129}, "tools", ["at most 128"]),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", ["add_generation_prompt"]),
])
def test_chat_structured_and_tool_errors_name_the_problem(served, body, param, contains):
    server, backend = served
    before = len(backend.requests)
    _err(_chat(server, **body), param, *contains)
    assert len(backend.requests) == before  # refused before reaching the gang


@pytest.mark.parametrize("messages, contains", [
    ([*USER, {"role": "tool", "content": "sunny"}], ["tool_call_id"]),
    ([*USER, {"role": "user", "content": None}], ["needs 'content'"]),
    ([*USER, {"role": "user", "content": "x", "tool_call_id": "call_1"}], ["belongs to 'tool' messages"]),
    ([{"role": "user", "content": "x", "tool_calls": []}], ["'tool_calls' belongs to 'assistant' messages"]),
    ([{"role": "user", "content": "x", "reasoning_content": "hm"}], ["'reasoning_content' belongs to 'assistant'"]),
])
def test_tool_history_errors_name_the_message(served, messages, contains):
    server, _ = served
    _err(_post(server, "/v1/chat/completions", {"messages": messages}), f"messages.{len(messages) - 1}", *contains)


def test_completions_take_structured_outputs_and_refuse_bad_ones(served):
    server, backend = served
    _err(_post(server, "/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "[a-"}}),
         "structured_outputs", "regex")
    r = _post(server, "/v1/completions", {"prompt": "Name:", "max_tokens": 4,
                                          "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.status_code == 200, r.text
    c = backend.requests[-1].constraint
    assert c is not None and c.kind == "choice" and json.loads(c.source) == ["yes", "no"]
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    c = backend.requests[-1].constraint
    assert c is not None and c.kind == "json_schema" and json.loads(c.source) == SCHEMA


# -- the constraint each request carries to the gang ----------------------------------------------------------


@pytest.mark.parametrize("body, kind, source", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                  "strict": True}}}, "json_schema", SCHEMA),
    ({"response_format": {"type": "json_object"}}, "json_object", None),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"regex": r"\d{3}"}}, "regex", r"\d{3}"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", ["a", "b"]),
    ({"structured_outputs": {"grammar": 'start: "x" | "y"'}}, "grammar", 'start: "x" | "y"'),
    ({"response_format": {"type": "text"}}, None, None),
    ({"tools": [WEATHER]}, None, None),
    ({"tools": [WEATHER], "tool_choice": "auto", "response_format": {"type": "json_object"}}, "json_object", None),
    ({"tools": [WEATHER], "tool_choice": "none"}, None, None),
])
def test_chat_request_carries_its_constraint(served, body, kind, source):
    server, backend = served
    r = _chat(server, n=2, **body)
    assert r.status_code == 200, r.text
    sent = backend.requests[-2:]
    assert sent[0].constraint == sent[1].constraint  # every choice carries it
    c = sent[0].constraint
    if kind is None:
        assert c is None
        return
    assert c is not None and c.kind == kind
    if isinstance(source, dict | list):
        assert json.loads(c.source) == source
    elif source is not None:
        assert c.source == source


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_puts_the_call_grammar_on_the_request(served, tool_choice):
    server, backend = served
    r = _chat(server, tools=[CLOCK, WEATHER], tool_choice=tool_choice)
    assert r.status_code == 200, r.text
    c = backend.requests[-1].constraint
    assert c is not None and c.kind == "grammar"
    assert "get_weather" in c.source and "<tool_call>" in c.source  # the Hermes call of this deployment
    assert ("get_time" in c.source) == (tool_choice == "required")  # a named choice allows that function only
    check(c)  # the grammar engine takes it


def test_tools_and_tool_history_reach_the_prompt(served, codec):
    """Tools through the fallback prompt (SmolLM2's template has none), the assistant's call with content null
    and the tool's result all in the prompt the gang gets."""
    server, backend = served
    messages = [*USER,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_abc", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 21 degrees"}]
    r = _post(server, "/v1/chat/completions", {"messages": messages, "tools": [WEATHER], "max_tokens": 20,
                                               "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    prompt = codec.decode(backend.requests[-1].prompt_token_ids)
    assert "sunny, 21 degrees" in prompt and "get_weather" in prompt and "Paris" in prompt
    assert "The forecast for a city" in prompt  # the tool's description, from the tools list
    # the assistant turn may also leave content out entirely
    messages[1] = {k: v for k, v in messages[1].items() if k != "content"}
    r = _post(server, "/v1/chat/completions", {"messages": messages, "tools": [WEATHER], "max_tokens": 20})
    assert r.status_code == 200, r.text
    # tool_choice none: the tools are not shown
    r = _post(server, "/v1/chat/completions", {"messages": USER, "tools": [WEATHER], "tool_choice": "none",
                                               "max_tokens": 20})
    assert r.status_code == 200, r.text
    assert "get_weather" not in codec.decode(backend.requests[-1].prompt_token_ids)


# -- answers: tool calls parsed, whole and streamed -------------------------------------------------------------


def test_tool_call_answer_gives_tool_calls(served, answers):
    server, _ = served
    answers("I will check. " + CALL)
    r = _chat(server, tools=[WEATHER])
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == ARGS
    assert msg["content"].strip() == "I will check."
    # with tool_choice none the same text is plain content
    r = _chat(server, tools=[WEATHER], tool_choice="none")
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert "<tool_call>" in choice["message"]["content"]


def test_text_answer_with_tools_is_content(served):
    server, _ = served
    choice = _chat(server, tools=[WEATHER]).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == PLAIN
    assert "tool_calls" not in choice["message"]


def test_streamed_tool_call_sends_openai_deltas(served, answers):
    server, _ = served
    answers(CALL + CALL.replace("Paris", "Lyon"))
    events = _events(_chat(server, tools=[WEATHER], stream=True, n=2))
    for index in (0, 1):
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"][0]["index"] == index]
        reasons = [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["index"] == index]
        assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
        assert reasons[-1] == "tool_calls" and not any(reasons[:-1])
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert not "".join(d.get("content") or "" for d in deltas).strip()
        for i, city in enumerate(["Paris", "Lyon"]):
            mine = [c for c in calls if c["index"] == i]
            first = mine[0]  # index, id, type and name first, with empty arguments
            assert first["id"].startswith("call_") and first["type"] == "function"
            assert first["function"] == {"name": "get_weather", "arguments": ""}
            assert all("id" not in c and "name" not in c["function"] for c in mine[1:])
            assert json.loads("".join(c["function"]["arguments"] for c in mine)) == {**ARGS, "city": city}
        ids = {c["id"] for c in calls if "id" in c}
        assert len(ids) == 2


def test_streamed_text_with_tools_is_content(served, codec):
    server, _ = served
    events = _events(_chat(server, tools=[WEATHER], stream=True, stream_options={"include_usage": True}))
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == PLAIN
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["usage"]["completion_tokens"] == len(_script(codec, PLAIN))


def test_openai_sdk_reads_tool_calls_whole_and_streamed(served, answers):
    from openai import OpenAI

    server, _ = served
    answers(CALL)
    client = OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    out = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=100)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGS
    assert out.choices[0].finish_reason == "tool_calls"
    # the SDK's message object sent back as history (OpenAI's documented loop) is accepted as it is
    answers(PLAIN)
    history = [*USER, out.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=100)
    assert again.choices[0].message.content == PLAIN and again.choices[0].finish_reason == "stop"
    answers(CALL)
    args, names = "", []
    for chunk in client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=100,
                                                stream=True):
        for tc in chunk.choices[0].delta.tool_calls or ():
            args += tc.function.arguments or ""
            names += [tc.function.name] if tc.function.name else []
    assert names == ["get_weather"] and json.loads(args) == ARGS


def test_model_card_says_what_the_deployment_supports(served):
    server, _ = served
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    caps = r.json()["data"][0]["capabilities"]
    assert set(caps["structured_outputs"]) == {"json_schema", "json_object", "regex", "choice", "grammar"}
    assert caps["tool_calling"] is True and caps["tool_parser"] == "hermes" and caps["reasoning"] is False
    assert caps["tools_in_template"] is False


def test_reasoning_goes_to_reasoning_content_whole_and_streamed(codec):
    """A deployment whose family reasons in <think> blocks (qwen3's markup, over SmolLM2's template): the thought
    is `reasoning_content`, the rest `content`; streamed, the pieces come as those two delta fields."""
    cfg = load_config(None, ["model.max_seq_len=1024", "engine.max_new_tokens=128", "engine.max_slots=4"])
    backend = FakeBackend(_script(codec, "<think>Paris is in France.</think>It is sunny."), codec.eos_token_ids[0])
    app = create_app(ServingCore(backend, codec, Limits.from_config(cfg, MODEL)), api_keys=ApiKeyCheck((KEY,)),
                     chat=ChatFormat.create(codec, "qwen3"))
    with ThreadedServer(app) as server:
        msg = _chat(server).json()["choices"][0]["message"]
        assert msg["reasoning_content"].strip() == "Paris is in France." and msg["content"].strip() == "It is sunny."
        deltas = [e["choices"][0]["delta"] for e in _events(_chat(server, stream=True))]
        assert "".join(d.get("reasoning_content") or "" for d in deltas).strip() == "Paris is in France."
        assert "".join(d.get("content") or "" for d in deltas).strip() == "It is sunny."
        card = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
        assert card["data"][0]["capabilities"]["reasoning"] is True
        # the SDK's message object, reasoning_content and all, sent back as history
        from openai import OpenAI

        client = OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        first = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=100).choices[0].message
        assert first.model_dump()["reasoning_content"].strip() == "Paris is in France."
        history = [*USER, first, {"role": "user", "content": "And tomorrow?"}]
        again = client.chat.completions.create(model=MODEL, messages=history, max_tokens=100)
        assert again.choices[0].message.content.strip() == "It is sunny."
