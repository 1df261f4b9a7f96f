"""What every tool-call format supplies: where a call block starts and ends in the model's text, how a block
parses into calls, and the Lark grammar (llguidance's dialect) that forces a call in the format.

A format is data plus two small functions, so the one streaming machine (`streaming.ToolStreamer`) serves them
all and `parse` of a whole message is the streamer run over it: the two can never disagree.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from raydeploy.constraints.grammar import JSON_OPTIONS, strict_schema

log = logging.getLogger("raydeploy.serve.chat")


@dataclass(frozen=True)
class ParsedCall:
    """A call read from the model's text: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolSyntax:
    """One tool-call format (subclasses: hermes, llama3_json, mistral, gemma3)."""

    name: str = ""
    markers: tuple[str, ...] = ()
    """Texts that open a call block wherever they appear in the content."""
    bare_starts: tuple[str, ...] = ()
    """Texts that open a call block only as the message's first non-blank text (the form a tokenizer leaves when
    it drops the special marker token, or the format has no marker)."""

    def end(self, block: str, final: bool) -> int | None:
        """Length of the complete call block at the start of `block` (which starts with a marker or a bare
        start); None while more text is needed. With `final` (the message ended) never None."""
        raise NotImplementedError

    def parse(self, block: str) -> list[ParsedCall] | None:
        """The calls in one block; None when the block is malformed (it then stays content)."""
        raise NotImplementedError

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar whose language is one call (or, with `parallel`, one or more) to one of `tools`, in this
        format, with arguments valid against each function's JSON schema, and nothing else."""
        raise NotImplementedError


# -- helpers the formats share ----------------------------------------------------------------------------------


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    """The `function` object of an OpenAI tool ({type: function, function: {name, parameters}})."""
    fn = tool.get("function", tool)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"a tool needs function.name, got {json.dumps(tool)[:200]}")
    return fn


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    """The function's parameters schema; a function without one takes any object."""
    params = function_of(tool).get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def call_from_object(obj: Any, arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    """`{"name": str, "arguments": {...}}` (or one of `arg_keys`) -> a call; anything else None. Arguments given as
    JSON text of an object are accepted too (some models quote them)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in arg_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def decode_json_prefix(text: str, start: int = 0) -> tuple[Any, int] | None:
    """(value, end index) of the JSON value at `start` (after blanks), or None when it is not (yet) whole."""
    i = skip_blank(text, start)
    try:
        return json.JSONDecoder().raw_decode(text, i)
    except ValueError:
        return None


def skip_blank(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def lark_literal(text: str) -> str:
    """A Lark string literal for `text` (Lark takes JSON's escapes)."""
    return json.dumps(text, ensure_ascii=False)


def lark_json_rule(rule: str, schema: dict[str, Any]) -> str:
    """A rule whose language is the JSON values valid against `schema` (llguidance's `%json` extension), with the
    constraints' JSON conventions: objects that list their properties take no others unless the schema says so,
    and whitespace between tokens is one space or one line break with its indent (`raydeploy.constraints.grammar`)."""
    strict = strict_schema(schema)
    assert isinstance(strict, dict)
    guided = {**strict, "x-guidance": {**JSON_OPTIONS, **strict.get("x-guidance", {})}}
    return f"{rule}: %json {json.dumps(guided, ensure_ascii=False)}"


def lark_calls(items: list[str], parallel: bool, sep: str, open_: str = "", close: str = "") -> str:
    """`start`: one `call` (or, with `parallel`, one or more separated by `sep`) between `open_` and `close`;
    `call`: one of `items` (Lark expressions, one per function)."""
    body = "call" if not parallel else f"call ({lark_literal(sep)} call)*"
    ends = [lark_literal(t) for t in (open_, close)]
    start = " ".join(p for p in (ends[0] if open_ else "", body, ends[1] if close else "") if p)
    return f"start: {start}\ncall: " + " | ".join(items)


def json_call_grammar(tools: list[dict[str, Any]], parallel: bool, args_key: str, sep: str, before: str = "",
                      after: str = "", open_: str = "", close: str = "") -> str:
    """Calls written as JSON objects `{"name": <name>, <args_key>: <arguments>}`, each between `before` and
    `after`, several separated by `sep`, all between `open_` and `close`; the arguments are JSON valid against
    the function's schema."""
    items, rules = [], []
    for k, tool in enumerate(tools):
        head = f'{before}{{"name": {json.dumps(function_of(tool)["name"], ensure_ascii=False)}, "{args_key}": '
        items.append(f"{lark_literal(head)} args{k} {lark_literal('}' + after)}")
        rules.append(lark_json_rule(f"args{k}", parameters_of(tool)))
    return "\n".join([lark_calls(items, parallel, sep, open_, close), *rules]) + "\n"
