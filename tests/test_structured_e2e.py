"""Structured outputs and tool calling end to end, as users call them: the openai SDK's `parse`, LangChain's
`bind_tools` and `with_structured_output`, instructor's JSON mode and raw HTTP, against the embedded default
gang shape (2 host processes with a virtual CPU device each, dp=2, real jax.distributed), the real SmolLM2 demo
model and Ray Serve HTTP.

- 50 samples at temperature 1.0 under a schema with enums, bounded arrays and bounded integers all validate.
- A tool round trip (call, `tool` result, answer) and a streamed tool call whose fragments join into JSON.
- regex and choice through vLLM's `structured_outputs`; bad schemas, regexes and tool names are 400s naming them.
- Every host applies the same mask: one constrained sampled request gives the same tokens through HTTP, on the
  dp=2 gang, and in this process on a 1-device mesh and on an fsdp x tp mesh of this process's virtual devices.

One deployment is shared by every test of this module; the mesh comparison runs last (it builds two engines).
"""

from __future__ import annotations

import json
import os
import re
from typing import Literal

import httpx
import jax
import jsonschema
import pytest
from live_http import free_port, live_serving
from pydantic import BaseModel, Field

from raydeploy.config import load_config
from raydeploy.constraints.spec import Constraint
from raydeploy.engine.local import LocalRunner
from raydeploy.engine.request import GenerationRequest
from raydeploy.engine.step import SamplingParams
from raydeploy.gang.gang import resolve_checkpoint_path
from raydeploy.gang.runtime import load_checkpoint_engine
from raydeploy.model.sharding import build_mesh
from raydeploy.serve.text import TextCodec

pytestmark = [pytest.mark.ray, pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

KEY = "sk-structured-4e1f"
KEYS_ENV = "RAYDEPLOY_STRUCTURED_E2E_API_KEYS"
MODEL = "smollm2-135m-instruct"
AUTH = {"Authorization": f"Bearer {KEY}"}
READY_TIMEOUT_S = 600
MAX_NEW = 200
ENGINE_OVERRIDES = ["model.max_seq_len=1024", f"engine.max_new_tokens={MAX_NEW}", "engine.max_slots=8"]
"""What the served gang and the in-process engines of the mesh comparison share (the tools' fallback system
prompt takes a few hundred tokens, hence the context)."""

CHARACTER = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["wizard", "knight", "thief", "bard"]},
        "level": {"type": "integer", "minimum": 1, "maximum": 20},
        "skills": {"type": "array", "items": {"enum": ["stealth", "magic", "swords", "music", "archery"]},
                   "minItems": 1, "maxItems": 3},
        "stats": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                  "minItems": 2, "maxItems": 4},
        "alive": {"type": "boolean"},
    },
    "required": ["kind", "level", "skills", "stats", "alive"],
    "additionalProperties": False,
}
"""Enums, arrays with minItems/maxItems and integer bounds; no free text, so every sample is short."""
CHARACTER_PROMPT = [{"role": "user", "content": "Invent a fantasy game character. Answer in JSON."}]

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in "
                                                 "a city.", "parameters": WEATHER_PARAMS}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class Capital(BaseModel):
    """A country and its capital city."""

    country: str = Field(max_length=40)
    city: str = Field(max_length=40)


class CapitalCity(BaseModel):
    """The capital city of a country."""

    capital: str = Field(max_length=40)


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=30)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def live(demo_checkpoint):
    os.environ[KEYS_ENV] = KEY  # before Ray starts: the ingress replica reads it
    cfg = load_config(None, [*ENGINE_OVERRIDES, "serving.max_queue=16", f"serving.port={free_port()}",
                             f"serving.api_keys_env={KEYS_ENV}", "serving.request_timeout_s=600",
                             "cluster.heartbeat_timeout_s=5", "cluster.restart_backoff_s=0.5",
                             "cluster.max_restarts=2"])
    with live_serving(cfg, str(demo_checkpoint), "rds", READY_TIMEOUT_S) as serving:
        yield serving


def _client(live):
    from openai import OpenAI

    return OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def _post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(live.url + path, json=body, headers=AUTH, timeout=300)


def _ok(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.text
    return resp.json()


def _err(resp: httpx.Response, param: str, *names: str) -> dict:
    """A 400 whose `param` is (or starts with) `param` and whose message names each of `names`."""
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["param"] or "").startswith(param), err
    assert all(n.lower() in err["message"].lower() for n in names), err
    assert "Traceback" not in resp.text and "/work" not in resp.text and KEY not in resp.text
    return err


def _json_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# -- the SDKs and frameworks as users call them ---------------------------------------------------------------


def test_openai_sdk_parse_returns_the_pydantic_object(live):
    client = _client(live)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    chat = client.chat.completions.parse(model=MODEL, messages=messages, response_format=Capital, temperature=0,
                                         max_tokens=MAX_NEW)
    msg = chat.choices[0].message
    assert chat.choices[0].finish_reason == "stop", chat
    assert isinstance(msg.parsed, Capital), msg
    assert msg.parsed == Capital.model_validate_json(msg.content)
    assert not msg.tool_calls

    # the SDK's streaming helper parses the joined deltas: the same object, greedy
    with client.chat.completions.stream(model=MODEL, messages=messages, response_format=Capital, temperature=0,
                                        max_tokens=MAX_NEW) as stream:
        pieces = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(pieces) > 1 and "".join(pieces) == msg.content, pieces
    assert final.choices[0].message.parsed == msg.parsed, final


def _langchain(live):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=live.url + "/v1", api_key=KEY, model=MODEL, temperature=0, max_tokens=MAX_NEW,
                      max_retries=0, timeout=300)


def test_langchain_bind_tools_returns_tool_calls(live):
    """A pydantic tool as LangChain users bind it: its schema leaves additionalProperties out (no strict mode),
    so the forced call's arguments must still end after the declared properties."""
    reply = _langchain(live).bind_tools([GetWeather], tool_choice="GetWeather").invoke(
        "What is the weather like in Paris?")
    assert len(reply.tool_calls) >= 1, reply
    for call in reply.tool_calls:
        assert call["name"] == "GetWeather" and call["id"], call
        jsonschema.validate(call["args"], GetWeather.model_json_schema())
        GetWeather.model_validate(call["args"])
    assert reply.response_metadata.get("finish_reason") == "tool_calls", reply.response_metadata


def test_langchain_with_structured_output_returns_the_object(live):
    capital = _langchain(live).with_structured_output(Capital).invoke("What is the capital of Italy? Answer in JSON.")
    assert isinstance(capital, Capital), capital


def test_instructor_json_mode_returns_the_object(live):
    """JSON mode asks only for some JSON object (response_format json_object) and puts the schema in a system
    prompt; one example turn is what it takes the demo model to fill this schema rather than describe it."""
    import instructor

    client = instructor.from_openai(_client(live), mode=instructor.Mode.JSON)
    answer = client.chat.completions.create(
        model=MODEL, response_model=CapitalCity, max_retries=0, temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": "What is the capital of Italy?"},
                  {"role": "assistant", "content": '{"capital": "Rome"}'},
                  {"role": "user", "content": "What is the capital of Spain?"}])
    assert isinstance(answer, CapitalCity) and answer.capital == "Madrid", answer


# -- sampled outputs under a schema ---------------------------------------------------------------------------


def test_fifty_samples_at_temperature_one_all_validate(live):
    outputs: list[str] = []
    for i, n in enumerate([8] * 6 + [2]):  # choice k of a request is seeded seed + k: 50 distinct seeds
        body = _ok(_post(live, "/v1/chat/completions", {
            "model": MODEL, "messages": CHARACTER_PROMPT, "temperature": 1.0, "seed": 100 + 8 * i, "n": n,
            "max_tokens": 120, "response_format": _json_format("character", CHARACTER)}))
        assert len(body["choices"]) == n
        for choice in body["choices"]:
            assert choice["finish_reason"] == "stop", choice
            outputs.append(choice["message"]["content"])
    assert len(outputs) == 50
    for text in outputs:
        jsonschema.validate(json.loads(text), CHARACTER)
    assert len(set(outputs)) >= 10, outputs  # sampled, not one greedy answer repeated


def test_regex_and_choice_through_structured_outputs(live):
    pattern = r"[A-Z][a-z]{2,10}, [0-9]{2}"
    body = _ok(_post(live, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Name a city and a two-digit number."}],
        "temperature": 0, "max_tokens": 40, "structured_outputs": {"regex": pattern}}))
    assert re.fullmatch(pattern, body["choices"][0]["message"]["content"]), body
    assert body["choices"][0]["finish_reason"] == "stop", body

    choices = ["Paris", "London", "Berlin", "Madrid"]
    body = _ok(_post(live, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Which city is the capital of Germany?"}],
        "temperature": 1.0, "seed": 3, "n": 4, "max_tokens": 20, "structured_outputs": {"choice": choices}}))
    assert [c["message"]["content"] in choices for c in body["choices"]] == [True] * 4, body

    body = _ok(_post(live, "/v1/completions", {
        "model": MODEL, "prompt": "The first moon landing was in the year", "temperature": 0, "max_tokens": 20,
        "structured_outputs": {"regex": r" 19[0-9]{2}\."}}))
    assert re.fullmatch(r" 19[0-9]{2}\.", body["choices"][0]["text"]), body

    cards = _ok(httpx.get(live.url + "/v1/models", headers=AUTH, timeout=30))["data"]
    caps = cards[0]["capabilities"]
    assert set(caps["structured_outputs"]) >= {"json_schema", "json_object", "regex", "choice", "grammar"}, caps
    assert caps["tool_calling"] is True, caps


def test_bad_schemas_regexes_and_tool_names_are_400s_naming_them(live):
    _err(_post(live, "/v1/chat/completions", {
        "model": MODEL, "messages": WEATHER_QUESTION, "max_tokens": 8,
        "response_format": _json_format("broken", {"type": "nope"})}), "response_format", "nope")
    _err(_post(live, "/v1/chat/completions", {
        "model": MODEL, "messages": WEATHER_QUESTION, "max_tokens": 8,
        "structured_outputs": {"regex": "([a-z]+"}}), "structured_outputs", "regex", "([a-z]+")
    _err(_post(live, "/v1/chat/completions", {
        "model": MODEL, "messages": WEATHER_QUESTION, "max_tokens": 8, "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "book_flight"}}}), "tool_choice", "book_flight")


# -- tools ------------------------------------------------------------------------------------------------------


def test_tool_round_trip(live):
    client = _client(live)
    first = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
                                           tool_choice="required", temperature=0, max_tokens=MAX_NEW)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id, call
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)

    history = [*WEATHER_QUESTION,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER_TOOL],
                                            tool_choice="none", temperature=0, max_tokens=60)
    msg = answer.choices[0].message
    assert msg.content and msg.content.strip() and not msg.tool_calls, answer
    assert answer.choices[0].finish_reason in ("stop", "length"), answer

    auto = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER_TOOL], tool_choice="auto",
                                          temperature=0, max_tokens=60)
    msg = auto.choices[0].message
    assert (msg.content or "").strip() or msg.tool_calls, auto
    want = "tool_calls" if msg.tool_calls else None
    assert auto.choices[0].finish_reason in ((want,) if want else ("stop", "length")), auto


def test_streamed_tool_call(live):
    stream = _client(live).chat.completions.create(
        model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], stream=True, temperature=0,
        max_tokens=MAX_NEW, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas, finish, content = [], None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        deltas.extend(delta.tool_calls or [])
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and deltas, (finish, deltas, content)
    assert not content.strip(), content
    first = deltas[0]
    assert first.index == 0 and first.id and first.function.name == "get_weather", first
    assert all(d.id is None and d.function.name is None for d in deltas[1:] if d.index == 0), deltas
    fragments = [d.function.arguments or "" for d in deltas if d.index == 0]
    assert len(fragments) >= 2, fragments  # streamed in pieces, not in one final delta
    jsonschema.validate(json.loads("".join(fragments)), WEATHER_PARAMS)


# -- every host applies the same mask --------------------------------------------------------------------------


def _local_tokens(mesh_overrides: list[str], devices: int, checkpoint: str,
                  reqs: list[GenerationRequest]) -> list[list[int]]:
    """`reqs`' tokens from an engine built in this process over `devices` of its virtual CPU devices, with the
    scheduler (and its grammar engine) the gang's rank 0 builds."""
    cfg = load_config(None, [*ENGINE_OVERRIDES, "cluster.num_hosts=1", f"cluster.devices_per_host={devices}",
                             *mesh_overrides])
    mesh = build_mesh(cfg.mesh_shape, jax.devices()[:devices])
    loaded = load_checkpoint_engine(cfg, mesh, checkpoint)
    outs = LocalRunner(loaded.engine, loaded.make_scheduler()).generate(reqs, timeout_s=600)
    assert all(o.error is None for o in outs), outs
    return [o.token_ids for o in outs]


def test_constrained_sampling_is_the_same_on_every_mesh(live, demo_checkpoint):
    """A sampled (temperature 1.0, fixed seed) request under a JSON schema: HTTP on the dp=2 gang, the gang
    directly, a 1-device engine and an fsdp=2 x tp=2 engine all give the same tokens. A host that applied
    another mask (or none) would draw other tokens from the same key: the same request without its constraint
    draws others."""

    seed, max_tokens = 4321, 120
    body = _ok(_post(live, "/v1/chat/completions", {
        "model": MODEL, "messages": CHARACTER_PROMPT, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": seed,
        "max_tokens": max_tokens, "response_format": _json_format("character", CHARACTER)}))
    http_text = body["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(http_text), CHARACTER)

    ckpt = resolve_checkpoint_path(live.cfg)
    codec = TextCodec.from_dir(ckpt)
    prompt = tuple(codec.encode_chat(codec.chat_prompt(CHARACTER_PROMPT)))
    assert body["usage"]["prompt_tokens"] == len(prompt), body["usage"]
    req = GenerationRequest("mask-parity", prompt, max_tokens, SamplingParams(temperature=1.0, seed=seed),
                            constraint=Constraint("json_schema", json.dumps(CHARACTER)))
    events = live.gangs.ready_gang().generate(req, 300)
    assert events[-1].finish_reason == "stop", events[-1]
    gang_ids = [e.token_id for e in events if e.token_id is not None]
    assert codec.decode(gang_ids) == http_text and body["usage"]["completion_tokens"] == len(gang_ids)

    free = GenerationRequest("mask-parity-free", prompt, max_tokens, req.sampling)
    one, one_free = _local_tokens(["mesh.axes={dp: 1}"], 1, ckpt, [req, free])
    (fsdp_tp,) = _local_tokens(["mesh.axes={fsdp: 2, tp: 2}",
                                "mesh.rules={q_heads: null, kv_heads: null, cache_kv_heads: null}"], 4, ckpt, [req])
    assert one == gang_ids, (codec.decode(one), http_text)
    assert fsdp_tp == gang_ids, (codec.decode(fsdp_tp), http_text)
    assert one_free[:len(one)] != one, codec.decode(one_free)
