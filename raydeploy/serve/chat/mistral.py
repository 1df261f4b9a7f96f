"""Mistral tool calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v0.3 tokenizers, Mixtral), or the
newer `[TOOL_CALLS]name[ARGS]{...}` (one marker per call; `[CALL_ID]id` may sit before `[ARGS]`). A decode that
drops special tokens leaves the list form bare, so a message that starts with `[` is read as calls too; one that
does not parse stays content."""

from __future__ import annotations

import re
from typing import Any

from raydeploy.serve.chat.syntax import (
    ParsedCall,
    ToolSyntax,
    call_from_object,
    decode_json_prefix,
    json_call_grammar,
    skip_blank,
)

TOOL_CALLS = "[TOOL_CALLS]"
_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")


class Mistral(ToolSyntax):
    name = "mistral"
    markers = (TOOL_CALLS,)
    bare_starts = ("[",)

    def _body(self, block: str) -> int:
        return skip_blank(block, len(TOOL_CALLS) if block.startswith(TOOL_CALLS) else 0)

    def end(self, block: str, final: bool) -> int | None:
        i = self._body(block)
        named = _NAMED.match(block, i)
        if named:
            found = decode_json_prefix(block, named.end())
        elif block.startswith("[", i):
            found = decode_json_prefix(block, i)
        else:
            found = None
        if found is not None:
            return found[1]
        return len(block) if final else None

    def parse(self, block: str) -> list[ParsedCall] | None:
        i = self._body(block)
        named = _NAMED.match(block, i)
        found = decode_json_prefix(block, named.end() if named else i)
        if found is None or block[found[1]:].strip():
            return None
        value, _ = found
        if named:
            call = call_from_object({"name": named.group(1), "arguments": value})
            return None if call is None else [call]
        if not isinstance(value, list) or not value:
            return None
        calls = [call_from_object(v) for v in value]
        return None if any(c is None for c in calls) else [c for c in calls if c is not None]

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        # `[TOOL_CALLS]` is a special token, which a grammar over text cannot write: the bare list (`parse` reads it)
        return json_call_grammar(tools, parallel, "arguments", ", ", open_="[", close="]")


SYNTAX = Mistral()
