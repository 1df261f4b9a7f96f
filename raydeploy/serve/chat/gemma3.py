"""Gemma 3 tool calls, Python style (what Google's function-calling prompt for Gemma 3 asks for, and vLLM's
pythonic parser reads): a list of calls with keyword arguments, `[get_weather(city="Paris"), get_time()]`, bare (as
vLLM's Gemma 3 tool template asks: "DO NOT USE MARKDOWN SYNTAX") or in a ```` ```tool_code ```` block (Google's own
prompt); a single call and a `print(...)` wrapper are taken too. Values are Python literals; JSON's true/false/null
are accepted as well, since the grammar (the bare list) writes argument values as JSON."""

from __future__ import annotations

import ast
import json
from typing import Any

from raydeploy.serve.chat.syntax import (
    ParsedCall,
    ToolSyntax,
    function_of,
    lark_calls,
    lark_json_rule,
    lark_literal,
)

FENCE_OPEN, FENCE_CLOSE = "```tool_code", "```"
_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and not isinstance(node.value, bytes | complex):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _value(node.operand)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.List | ast.Tuple):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_value(k) if k is not None else None for k in node.keys]
        if all(isinstance(k, str) for k in keys):
            return {k: _value(v) for k, v in zip(keys, node.values, strict=True)}
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    raise ValueError("not a function name")


def _call(node: ast.AST) -> ParsedCall:
    if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
        raise ValueError("not a call with keyword arguments")
    args = {k.arg: _value(k.value) for k in node.keywords}
    return ParsedCall(_name(node.func), json.dumps(args, ensure_ascii=False))


def parse_calls(source: str) -> list[ParsedCall] | None:
    """The calls in a Python expression (a call, or a list of them), or None."""
    try:
        tree = ast.parse(source.strip(), mode="eval").body
        if isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name) and tree.func.id == "print" \
                and len(tree.args) == 1 and not tree.keywords:
            tree = tree.args[0]
        nodes = tree.elts if isinstance(tree, ast.List | ast.Tuple) else [tree]
        calls = [_call(n) for n in nodes]
    except (SyntaxError, ValueError, RecursionError):
        return None
    return calls or None


def _whole_list_end(text: str) -> int | None:
    """End of the bracketed list `text` starts with (after blanks): the `]` that closes its `[`, brackets inside
    string literals not counted; None while it is open. One pass: a stream calls this on every piece."""
    depth, quote, i = 0, "", 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "[({":
            depth += 1
        elif ch in "])}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


class Gemma3(ToolSyntax):
    name = "gemma3"
    markers = (FENCE_OPEN,)
    bare_starts = ("[",)

    def end(self, block: str, final: bool) -> int | None:
        if block.startswith(FENCE_OPEN):
            i = block.find(FENCE_CLOSE, len(FENCE_OPEN))
            if i >= 0:
                return i + len(FENCE_CLOSE)
        else:
            n = _whole_list_end(block)
            if n is not None:
                return n
        return len(block) if final else None

    def parse(self, block: str) -> list[ParsedCall] | None:
        if block.startswith(FENCE_OPEN):
            block = block[len(FENCE_OPEN):]
            block = block[:-len(FENCE_CLOSE)] if block.rstrip().endswith(FENCE_CLOSE) else block
            block = block.rstrip()
            block = block[:-len(FENCE_CLOSE)] if block.endswith(FENCE_CLOSE) else block
        return parse_calls(block)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        items, rules = [], []
        for k, tool in enumerate(tools):
            fn = function_of(tool)
            kwargs, more = _kwargs_rule(k, fn.get("parameters") or {})
            items.append(f"{lark_literal(fn['name'] + '(')} {kwargs} {lark_literal(')')}".replace("  ", " "))
            rules += more
        # the bare list the template asks for
        return "\n".join([lark_calls(items, parallel, ", ", open_="[", close="]"), *rules]) + "\n"


def _kwargs_rule(k: int, schema: dict[str, Any]) -> tuple[str, list[str]]:
    """The keyword arguments of function `k` from its schema's properties: required ones in order, then optional
    ones in order (each may be left out). A property's value is JSON valid against its schema (with the schema's
    `$defs`, so references still resolve); constraints on the object as a whole are not expressed."""
    props: dict[str, Any] = schema.get("properties") or {}
    required = [p for p in props if p in (schema.get("required") or [])]
    optional = [p for p in props if p not in required]
    defs: dict[str, Any] = {d: schema[d] for d in ("$defs", "definitions") if d in schema}
    rules, parts = [], []
    for j, p in enumerate(required + optional):
        rule = f"a{k}_{j}"
        sub = props[p] if isinstance(props[p], dict) else {}
        rules.append(lark_json_rule(rule, {**sub, **defs}))
        parts.append((p, f"{lark_literal(p + '=')} {rule}", p in required))
    if not parts:
        return "", rules
    if required:
        seq = ' ", " '.join(text for _, text, req in parts if req)
        seq += "".join(f' (", " {text})?' for _, text, req in parts if not req)
        return seq, rules
    first, *rest = [text for _, text, _ in parts]
    return "(" + first + "".join(f' (", " {text})?' for text in rest) + ")?", rules


SYNTAX = Gemma3()
