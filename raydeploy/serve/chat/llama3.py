"""Llama 3.1/3.2/3.3 JSON tool calls: the message is the call, `{"name": ..., "parameters": {...}}`, possibly
after `<|python_tag|>`, several separated by `;` (as vLLM's llama3_json parser reads them). The tokenizer's decode
drops `<|python_tag|>` (a special token), so a message that starts with `{` is read as calls too; one that does
not parse as calls stays content."""

from __future__ import annotations

from typing import Any

from raydeploy.serve.chat.syntax import (
    ParsedCall,
    ToolSyntax,
    call_from_object,
    decode_json_prefix,
    json_call_grammar,
    skip_blank,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3Json(ToolSyntax):
    name = "llama3_json"
    markers = (PYTHON_TAG,)
    bare_starts = ("{",)

    def end(self, block: str, final: bool) -> int | None:
        return len(block) if final else None  # the calls are the rest of the message

    def parse(self, block: str) -> list[ParsedCall] | None:
        text = block[len(PYTHON_TAG):] if block.startswith(PYTHON_TAG) else block
        calls: list[ParsedCall] = []
        i = skip_blank(text, 0)
        while i < len(text):
            found = decode_json_prefix(text, i)
            if found is None:
                return None
            call = call_from_object(found[0], ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            i = skip_blank(text, found[1])
            if i < len(text):
                if text[i] != ";":
                    return None
                i = skip_blank(text, i + 1)
        return calls or None

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        return json_call_grammar(tools, parallel, "parameters", "; ")


SYNTAX = Llama3Json()
