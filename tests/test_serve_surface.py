"""The OpenAI surface clients actually send, over real HTTP with the real SmolLM2 tokenizer and a fake gang:
the tolerant schema (SDK round trips, explicit nulls, unknown fields named in a header), values that cannot be
honoured (400 naming them), lengths up to the context, many stop strings, n, the tokenizer endpoints, chat
template overrides and continue_final_message, CORS preflight from the openai JS SDK, and the plan-time
refusal of a model without a chat template.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from serve_fakes import FakeBackend, ThreadedServer, tokenizer_dir

from raydeploy.commands import check_chat_template
from raydeploy.config import ConfigError, load_config
from raydeploy.engine.geometry import EngineGeometry
from raydeploy.engine.request import GenerationRequest
from raydeploy.engine.scheduler import Paging, Scheduler
from raydeploy.model.sharding import merge_rules
from raydeploy.serve.app import create_app
from raydeploy.serve.auth import ApiKeyCheck
from raydeploy.serve.generation import Limits, ServingCore
from raydeploy.serve.routes.shared import IGNORED_FIELDS_HEADER, ServerInfo
from raydeploy.serve.text import StopMatcher, TextCodec

KEY = "sk-surface-0123456789"
SCRIPT = " Hello! I am a small model, and this is my answer."
MODEL = "smollm2-135m-instruct"
MAX_SEQ_LEN = 256
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_dir(tokenizer_dir())


def _serve(codec: TextCodec, *overrides: str, cors: list[str] | None = None, **app_kw):
    cfg = load_config(None, [f"model.max_seq_len={MAX_SEQ_LEN}", "engine.max_slots=8", "serving.max_queue=8",
                             *overrides])
    backend = FakeBackend(codec.encode(SCRIPT) + list(codec.eos_token_ids), codec.eos_token_ids[0], step_s=0.0005)
    core = ServingCore(backend, codec, Limits.from_config(cfg, MODEL))
    app = create_app(core, api_keys=ApiKeyCheck((KEY,)), info=ServerInfo(config={"model": MODEL}),
                     cors_origins=cors, **app_kw)
    return ThreadedServer(app), backend


@pytest.fixture(scope="module")
def served(codec):
    server, backend = _serve(codec, cors=["https://app.example"])
    with server:
        yield server, backend


def _post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30, **kw)


def _err(resp, param, contains):
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert contains.lower() in err["message"].lower(), err
    return err


# -- the tolerant schema ---------------------------------------------------------------------------------


def test_sdk_message_objects_sent_back_and_explicit_nulls(served, codec):
    from openai import OpenAI

    server, backend = served
    client = OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    first = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4)
    sent_back = first.choices[0].message.model_dump()  # refusal, annotations, audio, function_call: None
    assert {"refusal", "annotations", "audio", "function_call"} <= set(sent_back)
    history = [*HI, sent_back, {"role": "user", "content": "and then?"}]
    second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4)
    assert second.choices[0].message.content == codec.decode(codec.encode(SCRIPT)[:4])
    rendered = codec.chat_prompt([*HI, {"role": "assistant", "content": first.choices[0].message.content},
                                  {"role": "user", "content": "and then?"}])
    assert list(backend.requests[-1].prompt_token_ids) == codec.encode_chat(rendered)
    nulls = {"messages": HI, "max_tokens": 3, "n": None, "stream": None, "temperature": None, "top_p": None,
             "stop": None, "seed": None, "stream_options": None, "logit_bias": None, "presence_penalty": None,
             "frequency_penalty": None, "tools": None, "tool_choice": None, "response_format": None, "user": None,
             "logprobs": None, "top_logprobs": None, "max_completion_tokens": None, "parallel_tool_calls": None}
    r = _post(server, "/v1/chat/completions", nulls)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and IGNORED_FIELDS_HEADER not in r.headers
    r = _post(server, "/v1/completions", {"prompt": "hi", "n": None, "stream": None, "max_tokens": None,
                                          "echo": None, "best_of": None, "suffix": None, "logprobs": None})
    assert r.status_code == 200, r.text
    assert backend.requests[-1].max_tokens == 16  # null is the default: OpenAI's 16 for completions


def test_reference_fields_with_no_effect_are_accepted_unknown_ones_named(served, codec):
    server, _ = served
    known = {"store": True, "metadata": {"a": "b"}, "service_tier": "auto", "user": "u1",
             "prompt_cache_key": "k", "safety_identifier": "s", "reasoning_effort": "low", "verbosity": "low",
             "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
             "modalities": ["text"], "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "ignore_eos": False,
             "min_tokens": 0, "include_stop_str_in_output": False, "skip_special_tokens": True,
             "spaces_between_special_tokens": True, "add_generation_prompt": True, "continue_final_message": False,
             "echo": False, "use_beam_search": False, "length_penalty": 1.0, "priority": 0,
             "chat_template_kwargs": {}, "documents": None, "stream_options": {"include_usage": True}}
    r = _post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, **known})
    assert r.status_code == 200, r.text
    assert IGNORED_FIELDS_HEADER not in r.headers
    r = _post(server, "/v1/chat/completions", {"messages": [{**HI[0], "mood": "happy"}], "max_tokens": 2,
                                               "temprature": 0.5, "guided_json": {}, "x_custom": [1, 2]})
    assert r.status_code == 200, r.text
    assert r.headers[IGNORED_FIELDS_HEADER] == "temprature,guided_json,x_custom,messages.mood"
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **{f"f{i}": i for i in range(200)}})
    assert r.status_code == 200
    assert len(r.headers[IGNORED_FIELDS_HEADER]) <= 520  # bounded however many were sent


@pytest.mark.parametrize("path, extra, param, contains", [
    ("/v1/completions", {"best_of": 2}, "best_of", "must equal n"),
    ("/v1/completions", {"suffix": "end"}, "suffix", "not supported"),
    ("/v1/completions", {"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ("/v1/chat/completions", {"top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities", "text only"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio", "text only"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search", "beam search"),
    ("/v1/completions", {"logit_bias": {"99999999": 5}}, "logit_bias", "token id 99999999"),
    ("/v1/completions", {"logit_bias": {"hello": 5}}, "logit_bias", "token ids"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias.5", "less than or equal to 100"),
    ("/v1/completions", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
    ("/v1/completions", {"min_p": 1.5}, "min_p", "less than or equal to 1"),
    ("/v1/completions", {"min_tokens": 9, "max_tokens": 4}, "min_tokens", "more than 'max_tokens' (4)"),
    ("/v1/completions", {"seed": 2**63}, None, "outside the 64-bit range"),  # refused as the body is read
    ("/v1/completions", {"stop": ["s"] * 65}, "stop", "at most 64 stop strings"),
    ("/v1/completions", {"stop": ["x" * 257]}, "stop", "at most 256"),
    ("/v1/completions", {"n": 17}, "n", "at most 16"),
    ("/v1/chat/completions", {"continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message", "cannot both be true"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}], "tools": [{"type": "function",
                                                                        "function": {"name": "g"}}]},
     "functions", "cannot be combined"),
])
def test_values_that_cannot_be_honoured_are_400s_naming_the_field(served, path, extra, param, contains):
    server, _ = served
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": HI}
    _err(_post(server, path, {**base, "max_tokens": 8, **extra}), param, contains)


def test_sampling_controls_and_seeds_reach_the_gang(served, codec):
    server, backend = served
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "presence_penalty": 0.5,
                                          "frequency_penalty": -0.25, "min_p": 0.1, "min_tokens": 2,
                                          "logit_bias": {"17": -100, "42": 2.5}, "seed": -1, "n": 2})
    assert r.status_code == 200, r.text
    sps = [req.sampling for req in backend.requests[-2:]]
    for sp in sps:
        assert (sp.presence_penalty, sp.frequency_penalty, sp.min_p, sp.min_tokens) == (0.5, -0.25, 0.1, 2)
        assert dict(sp.logit_bias) == {17: -100.0, 42: 2.5}
    assert sorted(sp.seed for sp in sps) == [0, 2**64 - 1]  # -1 as unsigned, and choice 1 wraps to 0
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "seed": 2**63 - 1})
    assert r.status_code == 200 and backend.requests[-1].sampling.seed == 2**63 - 1


def test_functions_become_tools_and_text_parts_join_with_newlines(served, codec):
    server, backend = served
    parts = {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}
    r = _post(server, "/v1/chat/completions", {"messages": [parts], "max_tokens": 2})
    assert r.status_code == 200, r.text
    expected = codec.encode_chat(codec.chat_prompt([{"role": "user", "content": "one\ntwo"}]))
    assert list(backend.requests[-1].prompt_token_ids) == expected
    r = _post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "function_call": "none",
                                               "functions": [{"name": "get_time", "parameters": {}}]})
    assert r.status_code == 200, r.text
    _err(_post(server, "/v1/chat/completions", {"messages": HI, "function_call": {"name": "nope"},
                                                "functions": [{"name": "get_time"}]}), "tool_choice", "nope")


# -- lengths, stops, n -----------------------------------------------------------------------------------


def test_max_tokens_up_to_the_context_and_no_further(served, codec):
    server, backend = served
    prompt_len = len(codec.encode("hi"))
    room = MAX_SEQ_LEN - prompt_len
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": room, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == room and backend.requests[-1].max_tokens == room
    err = _err(_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": room + 1}), "max_tokens",
               f"over this model's context of {MAX_SEQ_LEN}")
    assert f"({prompt_len} tokens)" in err["message"] and f"({room + 1})" in err["message"]
    chat_len = len(codec.encode_chat(codec.chat_prompt(HI)))
    r = _post(server, "/v1/chat/completions", {"messages": HI})  # no max_tokens: until a stop or the context
    assert r.status_code == 200 and backend.requests[-1].max_tokens == MAX_SEQ_LEN - chat_len


def test_every_slot_takes_a_request_as_long_as_the_context_at_once():
    """An unlimited request reserves pages up to the context; the default pool (engine.num_pages: 0, auto) holds
    that for every slot, so max_slots of them start together instead of waiting for pages."""
    cfg = load_config(None, [])
    g = EngineGeometry.create(cfg.engine, cfg.model, cfg.mesh_shape, merge_rules(cfg.mesh.rules), "cpu", "float32",
                              False)
    sched = Scheduler(g.max_slots, g.max_seq_len, (2,), g.max_slots, Paging(g.page_size, g.pages_per_group, g.groups,
                                                                            g.max_step_tokens),
                      decode_steps=cfg.engine.decode_steps)
    for i in range(g.max_slots):
        sched.submit(GenerationRequest(f"r{i}", (10, 11, 12), g.max_seq_len - 3), lambda ev: None)
    plan = sched.next_plan()
    assert plan is not None and sorted({q.slot for q in plan.seqs}) == list(range(g.max_slots))


def test_the_operators_cap_is_named(codec):
    server, _ = _serve(codec, "engine.max_new_tokens=32")
    with server:
        _err(_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 33}), "max_tokens",
             "at most 32 tokens per request (engine.max_new_tokens)")
        assert _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 32}).status_code == 200


def test_twenty_stop_strings_and_the_stop_kept_on_request(served):
    server, _ = served
    stops = [f"zz{i}" for i in range(19)] + ["small"]
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 40, "stop": stops})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " Hello! I am a " and r.json()["choices"][0]["finish_reason"] == "stop"
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 40, "stop": stops,
                                          "include_stop_str_in_output": True})
    assert r.json()["choices"][0]["text"] == " Hello! I am a small"


def test_stop_strings_wait_for_min_tokens(served):
    """As vLLM: no stop string ends a request before its min_tokens are generated; from then on the new text and
    the stop string's length before it are searched (the script's tokens: " Hello", "!", " I", " am", ...)."""
    server, _ = served
    body = {"prompt": "hi", "max_tokens": 40, "stop": ["!", " a"]}
    assert _post(server, "/v1/completions", body).json()["choices"][0]["text"] == " Hello"
    r = _post(server, "/v1/completions", {**body, "min_tokens": 4}).json()["choices"][0]
    assert (r["text"], r["finish_reason"]) == (" Hello! I", "stop")  # " a" of " am", the 4th token


def test_stop_matcher_and_detokenizer_flags(codec):
    m = StopMatcher(["ab", "abc"], include_stop=True)
    assert m.feed("xxab") + m.feed("c") == "xxab" and m.stopped  # the first stop found, kept
    ids = codec.encode("<|im_start|>hello", add_special_tokens=False)
    kept, skipped = codec.detokenizer(False), codec.detokenizer(True)
    assert "".join(kept.add(t) for t in ids) + kept.flush() == "<|im_start|>hello"
    assert "".join(skipped.add(t) for t in ids) + skipped.flush() == "hello"


def test_n16_where_the_slots_allow_it_and_the_limit_named(served):
    server, backend = served
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 16})
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == list(range(16))


def test_skip_special_tokens_false_keeps_them_in_the_text(codec):
    special = codec.encode("<|im_start|>", add_special_tokens=False)
    server, backend = _serve(codec)
    backend.script_ids = special + codec.encode(" ok") + list(codec.eos_token_ids)
    with server:
        r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 10, "skip_special_tokens": False})
        assert r.json()["choices"][0]["text"] == "<|im_start|> ok"
        r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 10})
        assert r.json()["choices"][0]["text"] == " ok"


# -- streaming usage and fingerprint ---------------------------------------------------------------------


def test_continuous_usage_stats_and_system_fingerprint(served):
    server, _ = served
    body = {"messages": HI, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5 and all(c["usage"] for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    fps = {c["system_fingerprint"] for c in chunks}
    assert len(fps) == 1 and next(iter(fps)).startswith("fp_")
    whole = _post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2}).json()
    assert whole["system_fingerprint"] in fps and whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # stream_options on a request that does not stream is ignored (guidellm and others send it anyway)
    assert _post(server, "/v1/chat/completions", {**body, "stream": False}).status_code == 200


# -- tokenizer endpoints ---------------------------------------------------------------------------------


def test_tokenize_detokenize_version(served, codec):
    server, _ = served
    r = _post(server, "/tokenize", {"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == codec.encode("Hello world") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == MAX_SEQ_LEN and "".join(out["token_strs"]).replace("Ġ", " ") == "Hello world"
    r = _post(server, "/tokenize", {"messages": HI, "add_generation_prompt": True})
    assert r.json()["tokens"] == codec.encode_chat(codec.chat_prompt(HI)) and r.json()["token_strs"] is None
    r = _post(server, "/detokenize", {"tokens": codec.encode("Hello world")})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello world"}
    _err(_post(server, "/detokenize", {"tokens": [1, 10**9]}), "tokens", "outside the vocabulary")
    assert _post(server, "/tokenize", {"prompt": "x", "model": "other"}).status_code == 404
    r = httpx.get(server.url + "/version", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and isinstance(r.json()["version"], str) and r.json()["version"]
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(server.url + "/version").status_code == 401


# -- chat templates --------------------------------------------------------------------------------------


def test_request_chat_template_and_continue_final_message(served, codec):
    server, backend = served
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}" \
               "{% if add_generation_prompt %}[assistant]{% endif %}"
    r = _post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "chat_template": template})
    assert r.status_code == 200, r.text
    assert list(backend.requests[-1].prompt_token_ids) == codec.encode_chat("[user] hi\n[assistant]")
    started = [*HI, {"role": "assistant", "content": "The answer is"}]
    r = _post(server, "/v1/chat/completions", {"messages": started, "max_tokens": 2,
                                               "continue_final_message": True})
    assert r.status_code == 200, r.text
    sent = codec.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert sent.endswith("<|im_start|>assistant\nThe answer is")
    broken = "{% for m in messages %}{{ raise_exception('no ' + m.role + ' here') }}{% endfor %}"
    _err(_post(server, "/v1/chat/completions", {"messages": HI, "chat_template": broken}), "messages",
         "no user here")


def test_configured_chat_template_and_plan_time_refusal(codec, tmp_path):
    from raydeploy.serve.app import chat_format_for

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tokenizer_dir(), ckpt)
    for name in ("chat_template.jinja", "chat_template.json"):
        (ckpt / name).unlink(missing_ok=True)
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    yaml = tmp_path / "deploy.yaml"
    yaml.write_text(f"model:\n  checkpoint: {ckpt}\n")
    with pytest.raises(ConfigError, match="set model.chat_template") as e:
        check_chat_template(load_config(str(yaml)), None)
    assert e.value.key == "model.chat_template"
    (tmp_path / "tpl.jinja").write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    yaml.write_text(f"model:\n  checkpoint: {ckpt}\n  chat_template: tpl.jinja\n")
    cfg = load_config(str(yaml))
    check_chat_template(cfg, None)  # the file beside the YAML is found
    bare = TextCodec.from_dir(ckpt)
    assert not bare.has_chat_template
    with pytest.raises(Exception, match="no chat template"):
        bare.chat_prompt(HI)  # no made-up "role: content" format
    chat_format_for(cfg, ckpt, bare)
    assert bare.chat_prompt(HI, add_generation_prompt=False) == "<user>hi"
    yaml.write_text(f"model:\n  checkpoint: {ckpt}\n  chat_template: missing.jinja\n")
    with pytest.raises(ConfigError, match="missing.jinja does not exist"):
        check_chat_template(load_config(str(yaml)), None)


# -- CORS ------------------------------------------------------------------------------------------------


def _preflight(server, headers: str, method: str = "POST"):
    return httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": headers})


def test_cors_preflight_of_the_openai_js_sdk(served, codec):
    server, _ = served
    sdk = ("authorization,content-type,x-stainless-os,x-stainless-lang,x-stainless-package-version,"
           "x-stainless-runtime,x-stainless-runtime-version,x-stainless-arch,x-stainless-retry-count,"
           "x-stainless-timeout")
    r = _preflight(server, sdk)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert _preflight(server, "x-my-own-header").status_code == 400  # not allowed by default
    server2, _ = _serve(codec, cors=["https://app.example"], cors_allow_headers=["*"], cors_allow_methods=["*"])
    with server2:
        assert _preflight(server2, "x-my-own-header", "PUT").status_code == 200


def test_system_fingerprint_follows_the_config_and_the_checkpoint(demo_checkpoint, tmp_path):
    from raydeploy.serve.routes.shared import system_fingerprint

    cfg = load_config(None, ["model.max_seq_len=512"])
    fp = system_fingerprint(cfg, demo_checkpoint)
    assert fp.startswith("fp_") and fp == system_fingerprint(cfg, demo_checkpoint)
    assert system_fingerprint(load_config(None, ["serving.port=9001", "model.max_seq_len=512"]), demo_checkpoint) == fp
    assert system_fingerprint(load_config(None, ["model.max_seq_len=1024"]), demo_checkpoint) != fp
    other = tmp_path / "ckpt"
    shutil.copytree(demo_checkpoint, other, ignore=shutil.ignore_patterns("*.msgpack"))
    for shard in demo_checkpoint.glob("*.msgpack"):
        (other / shard.name).symlink_to(shard)
    (other / "config.json").write_text((other / "config.json").read_text() + "\n")  # other bytes, same model
    assert system_fingerprint(cfg, other) != fp
    info = ServerInfo(config={"a": 1}, system_fingerprint=fp)
    assert info.fingerprint() == fp and ServerInfo(config={"a": 1}).fingerprint().startswith("fp_")
