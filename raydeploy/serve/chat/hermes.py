"""Hermes tool calls (Qwen2/2.5/3, Hermes 2 Pro, and our fallback prompt): each call is a JSON object in its own
block, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, anywhere in the message."""

from __future__ import annotations

import json
from typing import Any

from raydeploy.serve.chat.syntax import (
    ParsedCall,
    ToolSyntax,
    call_from_object,
    json_call_grammar,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(ToolSyntax):
    name = "hermes"
    markers = (OPEN,)

    def end(self, block: str, final: bool) -> int | None:
        i = block.find(CLOSE, len(OPEN))
        if i >= 0:
            return i + len(CLOSE)
        return len(block) if final else None  # an unclosed last block (the model stopped at EOS) is still read

    def parse(self, block: str) -> list[ParsedCall] | None:
        body = block[len(OPEN):]
        if body.endswith(CLOSE):
            body = body[:-len(CLOSE)]
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        call = call_from_object(obj)
        return None if call is None else [call]

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        return json_call_grammar(tools, parallel, "arguments", "\n", before=OPEN + "\n", after="\n" + CLOSE)


SYNTAX = Hermes()
