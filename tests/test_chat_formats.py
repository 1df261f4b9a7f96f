"""Chat formats (raydeploy.serve.chat): tools rendered through each family's real chat template (or the fallback
prompt for the demo's template, which renders none), tool calls and reasoning parsed from that template's own
output, whole and streamed, and the grammars that force a call compiled and walked with llguidance on the demo
tokenizer. The templates are the published ones (tests/data/chat_templates/README.md)."""

from __future__ import annotations

import json
import random
import re
import typing
from pathlib import Path
from typing import Any

import llguidance
import pytest
from llguidance.hf import from_tokenizer

from raydeploy.config import ConfigError, load_config
from raydeploy.config.schema import ModelConfig
from raydeploy.model.registry import chat_formats, family_for
from raydeploy.serve.chat import REASONING_PARSERS, TOOL_PARSERS, ChatFormat, ChatOutput, Delta, ToolCall
from raydeploy.serve.text import ChatTemplateError, TextCodec

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}, "hour24": {"type": "boolean"}},
                   "required": ["zone", "hour24"]}}}
TOOLS = [WEATHER, TIME]

ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0123456789abcdef01234567", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "sunny, 21 C"},
]

# family (model_type) -> template file, the tool format it gets, and how its template writes an assistant turn
FAMILIES = {
    "qwen3": ("qwen3.jinja", "hermes", r"<\|im_start\|>assistant\n(?:<think>\n\n</think>\n\n)?(.*?)<\|im_end\|>"),
    "llama": ("llama3.1.jinja", "llama3_json", r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>"),
    "mistral": ("mistral-small-3.1.jinja", "mistral", r"\[/INST\](\[TOOL_CALLS\].*?)<\|im_end\|>"),
    "gemma3_text": ("gemma3_pythonic.jinja", "gemma3", r"<start_of_turn>model\n(.*?)<end_of_turn>"),
}

# calls as each format writes them when the model makes them itself: one call, two calls
SAMPLES = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "hour24": true}}\n</tool_call>'),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
                    '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET", "hour24": true}}'),
    "mistral": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}, '
                '{"name": "get_time", "arguments": {"zone": "CET", "hour24": true}}]'),
    "gemma3": ('[get_weather(city="Paris")]',
               '```tool_code\n[get_weather(city="Paris"), get_time(zone="CET", hour24=True)]\n```'),
}
TWO_CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET", "hour24": True})]

# malformed calls: each must come back whole, as content, with no call
MALFORMED = {
    "hermes": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',
               '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>', "<tool_call>\nnot json at all"],
    "llama3_json": ['{"name": "get_weather", "parameters": {"city": ', '{"city": "Paris"}',
                    '{"name": "get_weather", "parameters": {"city": "Paris"}} and then some'],
    "mistral": ['[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Par', "[TOOL_CALLS] [1, 2]",
                "[1] is the first footnote"],
    "gemma3": ['[get_weather(city=Paris)]', "[get_weather('Paris')]", "[1, 2, 3]",
               '```tool_code\n[get_weather(city="Paris"\n```'],
}


@pytest.fixture(scope="module")
def tokenizer_dir(demo_checkpoint: Path) -> Path:
    return demo_checkpoint


def _codec(tokenizer_dir: Path, template: str | None = None) -> TextCodec:
    codec = TextCodec.from_dir(tokenizer_dir)
    if template is not None:
        codec.tokenizer.chat_template = (TEMPLATES / template).read_text()
    return codec


@pytest.fixture(scope="module")
def formats(tokenizer_dir: Path) -> dict[str, ChatFormat]:
    """Each family's format through its real template, and the demo's own (fallback) one as "demo"."""
    out = {fam: ChatFormat.create(_codec(tokenizer_dir, tpl), fam) for fam, (tpl, _, _) in FAMILIES.items()}
    out["demo"] = ChatFormat.create(_codec(tokenizer_dir), "llama")
    return out


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer_dir: Path) -> Any:
    return from_tokenizer(TextCodec.from_dir(tokenizer_dir).tokenizer)


def _by_format(formats: dict[str, ChatFormat], tool_format: str) -> ChatFormat:
    return next(f for k, f in formats.items() if k != "demo" and f.tool_format == tool_format)


def _calls(out: ChatOutput) -> list[tuple[str, dict[str, Any]]]:
    for c in out.tool_calls:
        assert CALL_ID.match(c.id), c.id
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def _stream(fmt: ChatFormat, text: str, tools: bool = True, seed: int = 0, prompt: str | None = None
            ) -> tuple[list[Delta], bool]:
    """`text` fed in random pieces of 1..7 characters, as a detokenizer hands them out."""
    rng = random.Random(seed)
    streamer = fmt.streamer(tools, prompt=prompt)
    out: list[Delta] = []
    i = 0
    while i < len(text):
        n = rng.randint(1, 7)
        out += streamer.feed(text[i:i + n])
        i += n
    out += streamer.finish()
    return out, streamer.called


def _joined(deltas: list[Delta]) -> tuple[str, str, list[tuple[str, str, str]]]:
    """(content, reasoning, [(id, name, arguments)]) from deltas, checking the OpenAI delta discipline."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        assert sum(x is not None for x in (d.content, d.reasoning_content, d.tool_call)) == 1, d
        tc = d.tool_call
        if tc is None:
            continue
        if tc.index not in calls:  # the call's first delta: id and name, no arguments yet
            assert tc.index == len(calls) and tc.id and CALL_ID.match(tc.id) and tc.name and tc.arguments == "", tc
            calls[tc.index] = [tc.id, tc.name, ""]
        else:
            assert tc.id is None and tc.name is None, tc
            calls[tc.index][2] += tc.arguments
    content = "".join(d.content for d in deltas if d.content is not None)
    reasoning = "".join(d.reasoning_content for d in deltas if d.reasoning_content is not None)
    return content, reasoning, [(c[0], c[1], c[2]) for c in calls.values()]


# -- choosing a format ---------------------------------------------------------------------------------------------


def test_registry_chat_formats() -> None:
    assert (family_for("qwen3").tool_format, family_for("qwen3").reasoning) == ("hermes", "think")
    assert (family_for("qwen3_moe").tool_format, family_for("qwen3_moe").reasoning) == ("hermes", "think")
    assert family_for("llama").tool_format == "llama3_json" and family_for("llama").reasoning is None
    assert family_for("mistral").tool_format == "mistral" and family_for("mixtral").tool_format == "mistral"
    assert family_for("qwen2").tool_format == "hermes"
    assert family_for("mistral") is family_for("mistral")
    assert family_for("mistral").name == family_for("llama").name == "llama"  # one family, two chat formats
    assert chat_formats("gemma3_text") == chat_formats("gemma3") == ("gemma3", None)
    assert chat_formats(None) == chat_formats("no-such-type") == ("llama3_json", None)


def test_auto_takes_the_family_format_where_the_template_renders_tools(formats: dict[str, ChatFormat]) -> None:
    for fam, (_, tool_format, _) in FAMILIES.items():
        assert formats[fam].template_has_tools, fam
        assert formats[fam].tool_format == tool_format, fam
    assert formats["qwen3"].reasoning == "think" and formats["llama"].reasoning is None
    demo = formats["demo"]
    assert not demo.template_has_tools and demo.tool_format == "hermes" and demo.reasoning is None


def test_create_overrides_and_refusals(tokenizer_dir: Path) -> None:
    llama = _codec(tokenizer_dir, "llama3.1.jinja")
    assert ChatFormat.create(llama, "llama", tool_parser="hermes").tool_format == "hermes"
    assert ChatFormat.create(llama, "qwen3", reasoning_parser="none").reasoning is None
    assert ChatFormat.create(llama, "llama", reasoning_parser="think").reasoning == "think"
    assert ChatFormat.create(_codec(tokenizer_dir), "qwen3").tool_format == "hermes"  # fallback, family reasoning
    with pytest.raises(ValueError, match="model.tool_parser must be one of auto, hermes.*got 'pythonic'"):
        ChatFormat.create(llama, "llama", tool_parser="pythonic")
    with pytest.raises(ValueError, match="model.reasoning_parser must be one of .*got 'qwen3'"):
        ChatFormat.create(llama, "llama", reasoning_parser="qwen3")
    with pytest.raises(ValueError, match="'mistral' needs a chat template that renders tools.*use auto or hermes"):
        ChatFormat.create(_codec(tokenizer_dir), "llama", tool_parser="mistral")


def test_config_keys_are_strict() -> None:
    hints = typing.get_type_hints(ModelConfig)
    assert typing.get_args(hints["tool_parser"]) == TOOL_PARSERS  # the config takes exactly what ChatFormat does
    assert typing.get_args(hints["reasoning_parser"]) == REASONING_PARSERS
    cfg = load_config(None, ["model.tool_parser=mistral", "model.reasoning_parser=none"])
    assert (cfg.model.tool_parser, cfg.model.reasoning_parser) == ("mistral", "none")
    assert (load_config(None).model.tool_parser, load_config(None).model.reasoning_parser) == ("auto", "auto")
    with pytest.raises(ConfigError, match="model.tool_parser"):
        load_config(None, ["model.tool_parser=pythonic"])
    with pytest.raises(ConfigError, match="model.reasoning_parser"):
        load_config(None, ["model.reasoning_parser=deepseek"])


# -- rendering ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_real_template_renders_tools_and_a_round_trip(formats: dict[str, ChatFormat], family: str) -> None:
    """The tools reach the prompt through the model's own template, and the history's call, rendered by that
    template in the family's format, parses back to the same call."""
    fmt = formats[family]
    args = {"city": "Paris", "unit": "c"}
    if family == "gemma3_text":
        # that template writes no comma between keyword arguments (its `first` flag is set inside a Jinja loop,
        # which does not carry over), so its history of a call with two arguments is not Python; one argument is
        args = {"city": "Paris"}
    history = [*ROUND_TRIP[:2], {**ROUND_TRIP[2], "tool_calls": [
        {**ROUND_TRIP[2]["tool_calls"][0], "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
               ROUND_TRIP[3]]
    prompt = fmt.render(history, TOOLS)
    assert '"name": "get_time"' in prompt and "sunny, 21 C" in prompt  # the tool list and the tool result
    turns = re.findall(FAMILIES[family][2], prompt, re.S)
    assert len(turns) == 1, prompt
    assert _calls(fmt.parse(turns[0], tools=True)) == [("get_weather", args)], turns[0]
    without = fmt.render(ROUND_TRIP[:2], None)
    assert "get_time" not in without


def test_fallback_prompt_for_a_template_without_tools(formats: dict[str, ChatFormat]) -> None:
    demo = formats["demo"]
    prompt = demo.render(ROUND_TRIP, TOOLS)
    # one system turn: the client's system text, then the tools section with every schema
    assert prompt.count("<|im_start|>system\n") == 1
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    for tool in TOOLS:
        assert json.dumps(tool) in system
    assert "<tool_call></tool_call>" in system
    # no roles the template cannot take: the call is Hermes text, the result a user turn
    assert "<|im_start|>tool" not in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in prompt
    call_turn = re.findall(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", prompt, re.S)
    assert _calls(demo.parse(call_turn[0], tools=True)) == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert prompt.endswith("<|im_start|>assistant\n")
    # no system message: a new one, first; two results in a row share one user turn
    two = [ROUND_TRIP[1], {**ROUND_TRIP[2], "tool_calls": ROUND_TRIP[2]["tool_calls"] * 2},
           ROUND_TRIP[3], {**ROUND_TRIP[3], "content": "windy"}]
    prompt = demo.render(two, TOOLS)
    assert prompt.startswith("<|im_start|>system\n# Tools\n") and "SmolLM" not in prompt
    assert ("<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\nwindy\n</tool_response><|im_end|>"
            in prompt)
    # no tools and no tool turns: exactly what the template made before
    plain = [{"role": "user", "content": "hi"}]
    assert demo.render(plain, None) == demo.codec.tokenizer.apply_chat_template(plain, tokenize=False,
                                                                                add_generation_prompt=True)


def test_template_errors_and_kwargs(formats: dict[str, ChatFormat]) -> None:
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        formats["gemma3_text"].render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], None)
    with pytest.raises(ChatTemplateError, match="may not set tools"):
        formats["qwen3"].render(ROUND_TRIP[:2], None, template_kwargs={"tools": []})
    qwen = formats["qwen3"]
    assert qwen.render(ROUND_TRIP[:2], None, template_kwargs={"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen.render(ROUND_TRIP[:2], None).endswith("<|im_start|>assistant\n")


# -- parsing ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tool_format", list(SAMPLES))
def test_parse_text_one_and_several_calls(formats: dict[str, ChatFormat], tool_format: str) -> None:
    fmt = _by_format(formats, tool_format)
    text = "The weather in Paris is sunny [1], {mostly}."
    assert fmt.parse(text, tools=True) == ChatOutput(text, None, ())
    one, two = SAMPLES[tool_format]
    out = fmt.parse(one, tools=True)
    assert out.content is None and _calls(out) == TWO_CALLS[:1]
    out = fmt.parse(two, tools=True)
    assert out.content is None and _calls(out) == TWO_CALLS
    assert len({c.id for c in out.tool_calls}) == 2
    # tools off: nothing is read as a call
    assert fmt.parse(one, tools=False) == ChatOutput(one, None, ())


def test_hermes_calls_amid_text(formats: dict[str, ChatFormat]) -> None:
    fmt = formats["demo"]
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    out = fmt.parse(text, tools=True)
    assert out.content == "Let me check." and _calls(out) == TWO_CALLS[:1]
    # an unclosed last block (the model stopped at its end token) still counts; quoted arguments are taken too
    out = fmt.parse('<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\", \\"hour24\\": true}"}',
                    tools=True)
    assert _calls(out) == TWO_CALLS[1:]


@pytest.mark.parametrize("tool_format", list(MALFORMED))
def test_malformed_calls_stay_content(formats: dict[str, ChatFormat], tool_format: str,
                                      caplog: pytest.LogCaptureFixture) -> None:
    fmt = _by_format(formats, tool_format)
    for text in MALFORMED[tool_format]:
        with caplog.at_level("DEBUG", logger="raydeploy.serve.chat"):
            caplog.clear()
            out = fmt.parse(text, tools=True)
        assert out == ChatOutput(text, None, ()), text
        deltas, called = _stream(fmt, text)
        assert _joined(deltas) == (text, "", []) and not called, text
        if text.lstrip().startswith(fmt._syntax.markers) or "(" in text:
            assert f"malformed {tool_format} tool call" in caplog.text, text
    # a good call after a malformed one is still read, and the malformed one is kept as content
    if tool_format == "hermes":
        bad = MALFORMED["hermes"][0]
        out = fmt.parse(bad + "\n" + SAMPLES["hermes"][0], tools=True)
        assert out.content == bad and _calls(out) == TWO_CALLS[:1]


# -- streaming ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tool_format", list(SAMPLES))
def test_streamed_calls_join_into_the_parsed_ones(formats: dict[str, ChatFormat], tool_format: str) -> None:
    fmt = _by_format(formats, tool_format)
    for text in SAMPLES[tool_format]:
        for seed in range(5):
            deltas, called = _stream(fmt, text, seed=seed)
            content, reasoning, calls = _joined(deltas)
            assert called and content.strip() == "" and reasoning == ""
            assert [(name, json.loads(args)) for _, name, args in calls] == _calls(fmt.parse(text, tools=True))
        plain = "No call needed: it is sunny."
        deltas, called = _stream(fmt, plain, seed=1)
        assert _joined(deltas) == (plain, "", []) and not called


def test_content_streams_before_a_call_completes(formats: dict[str, ChatFormat]) -> None:
    fmt = formats["demo"]
    streamer = fmt.streamer(tools=True)
    sent = streamer.feed("Checking the weather")
    assert _joined(sent)[0] == "Checking the weather"  # nothing here can start a call: out at once
    assert _joined(streamer.feed(" now <tool"))[0] == " now "  # "<tool" may become "<tool_call>": held
    assert streamer.feed('_call>\n{"name": "get_weather", "arguments": {"city"') == []
    assert not streamer.called
    done = streamer.feed(': "Paris"}}\n</tool_call>')
    assert streamer.called and _joined(done)[2][0][1:] == ("get_weather", '{"city": "Paris"}')
    assert streamer.finish() == []


# -- reasoning ----------------------------------------------------------------------------------------------------


def test_qwen3_reasoning(formats: dict[str, ChatFormat]) -> None:
    qwen = formats["qwen3"]
    text = "<think>\nThe user wants the weather.\n</think>\n\nIt is sunny."
    assert qwen.parse(text, tools=False) == ChatOutput("It is sunny.", "The user wants the weather.", ())
    # the prompt opened the block: the output starts inside it and only closes it
    opened = qwen.render(ROUND_TRIP[:2], None) + "<think>\n"
    inside = "Short answer.\n</think>\n\nSunny."
    assert qwen.parse(inside, tools=False, prompt=opened) == ChatOutput("Sunny.", "Short answer.", ())
    assert qwen.parse(inside, tools=False) == ChatOutput("Sunny.", "Short answer.", ())
    deltas, _ = _stream(qwen, inside, tools=False, prompt=opened)
    assert _joined(deltas)[:2] == ("Sunny.", "Short answer.\n")
    # enable_thinking false: the template closes an empty block, and the output is all content
    off = qwen.render(ROUND_TRIP[:2], None, template_kwargs={"enable_thinking": False})
    assert qwen.parse("Sunny.", tools=False, prompt=off) == ChatOutput("Sunny.", None, ())
    # reasoning, then a call: the call is read only outside the reasoning
    call = SAMPLES["hermes"][0]
    text = f"<think>\nI should call <tool_call> for this.\n</think>\n\n{call}"
    out = qwen.parse(text, tools=True)
    assert out.reasoning_content == "I should call <tool_call> for this." and out.content is None
    assert _calls(out) == TWO_CALLS[:1]
    for seed in range(5):
        deltas, called = _stream(qwen, text, seed=seed)
        content, reasoning, calls = _joined(deltas)
        assert called and reasoning.strip() == "I should call <tool_call> for this." and content.strip() == ""
        assert [(n, json.loads(a)) for _, n, a in calls] == TWO_CALLS[:1]
    # a family without reasoning markup leaves it in the content
    assert formats["llama"].parse("<think>x</think>y", tools=False).content == "<think>x</think>y"


# -- grammars that force a call ---------------------------------------------------------------------------------


def _accepts(ll_tokenizer: Any, grammar: str, text: str, hf_tokenizer: Any) -> bool:
    """A matcher walking `text`'s tokens accepts each and may end there."""
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.grammar_from("lark", grammar))
    assert not matcher.is_error(), matcher.get_error()
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and not matcher.is_error() and matcher.is_accepting()


@pytest.mark.parametrize("tool_format", list(SAMPLES))
def test_tool_constraint_grammar(formats: dict[str, ChatFormat], ll_tokenizer: Any, tool_format: str) -> None:
    fmt = _by_format(formats, tool_format)
    hf = fmt.codec.tokenizer
    # what each format's grammar writes: one call to each tool, and both
    good = {
        "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "f"}}\n</tool_call>',
                   '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "hour24": false}}\n</tool_call>',
                   "\n"),
        "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "f"}}',
                        '{"name": "get_time", "parameters": {"zone": "CET", "hour24": false}}', "; "),
        "mistral": ('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "f"}}',
                    '{"name": "get_time", "arguments": {"zone": "CET", "hour24": false}}', ", "),
        "gemma3": ('get_weather(city="Paris", unit="f")', 'get_time(zone="CET", hour24=false)', ", "),
    }[tool_format]
    weather, time_, sep = good
    wrap = (lambda s: f"[{s}]") if tool_format in ("mistral", "gemma3") else (lambda s: s)
    required = fmt.tool_constraint(TOOLS, None, parallel=False)
    assert required.kind == "grammar"
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", required.source), ll_tokenizer) == ""
    assert _accepts(ll_tokenizer, required.source, wrap(weather), hf)
    assert _accepts(ll_tokenizer, required.source, wrap(time_), hf)
    assert not _accepts(ll_tokenizer, required.source, wrap(weather + sep + time_), hf)  # one call only
    assert not _accepts(ll_tokenizer, required.source, "It is sunny.", hf)
    bad_args = weather.replace('"f"', '"kelvin"')  # outside the enum
    assert not _accepts(ll_tokenizer, required.source, wrap(bad_args), hf)
    # what the grammar writes parses back into the call
    assert _calls(fmt.parse(wrap(weather + sep + time_), tools=True)) == [
        ("get_weather", {"city": "Paris", "unit": "f"}), ("get_time", {"zone": "CET", "hour24": False})]

    parallel = fmt.tool_constraint(TOOLS, None, parallel=True)
    assert _accepts(ll_tokenizer, parallel.source, wrap(weather + sep + time_), hf)
    assert _accepts(ll_tokenizer, parallel.source, wrap(time_), hf)

    named = fmt.tool_constraint(TOOLS, "get_time", parallel=True)
    assert _accepts(ll_tokenizer, named.source, wrap(time_), hf)
    assert not _accepts(ll_tokenizer, named.source, wrap(weather), hf)
    assert not _accepts(ll_tokenizer, named.source, wrap(time_ + sep + time_), hf)  # a named function: one call
    missing = time_.replace(", hour24=false", "").replace(', "hour24": false', "")  # a required argument left out
    assert not _accepts(ll_tokenizer, named.source, wrap(missing), hf)
    if tool_format != "gemma3":  # JSON arguments: no invented keys where the schema leaves them unsaid
        invented = weather.replace('"unit": "f"}', '"unit": "f", "properties": {}}')
        assert "additionalProperties" not in json.dumps(TOOLS)
        assert not _accepts(ll_tokenizer, required.source, wrap(invented), hf)


def test_tool_constraint_refusals(formats: dict[str, ChatFormat]) -> None:
    with pytest.raises(ValueError, match="tool_choice names function 'get_tide'.*get_weather, get_time"):
        formats["demo"].tool_constraint(TOOLS, "get_tide", parallel=False)
    with pytest.raises(ValueError, match="at least one tool"):
        formats["demo"].tool_constraint([], None, parallel=False)
    with pytest.raises(ValueError, match="function.name"):
        formats["demo"].tool_constraint([{"type": "function", "function": {}}], None, parallel=False)


def test_tool_call_ids_are_fresh(formats: dict[str, ChatFormat]) -> None:
    a = formats["demo"].parse(SAMPLES["hermes"][0], tools=True).tool_calls[0]
    b = formats["demo"].parse(SAMPLES["hermes"][0], tools=True).tool_calls[0]
    assert isinstance(a, ToolCall) and a.id != b.id and (a.name, a.arguments) == (b.name, b.arguments)


def test_gemma3_brackets_inside_arguments(formats: dict[str, ChatFormat]) -> None:
    gemma = formats["gemma3_text"]
    text = '[find(query="a ] b (", tags=["x", "y]"], nested={"k": [1, [2]]}, flag=None), ping()] Done.'
    want = [("find", {"query": "a ] b (", "tags": ["x", "y]"], "nested": {"k": [1, [2]]}, "flag": None}),
            ("ping", {})]
    out = gemma.parse(text, tools=True)
    assert _calls(out) == want and out.content == "Done."
    for seed in range(5):
        content, _, calls = _joined(_stream(gemma, text, seed=seed)[0])
        assert [(n, json.loads(a)) for _, n, a in calls] == want and content.strip() == "Done."
