"""The fallback prompt for templates that cannot render tools (the demo's SmolLM2 ChatML template among them).

The tools go into a system-prompt section (merged into the first system message, or a new one) that lists each
function's JSON schema and asks for Hermes `<tool_call>` blocks, the format most open models were tuned on.
The history is rewritten into roles every template takes: an assistant's calls become their `<tool_call>` text,
and tool results become a user turn of `<tool_response>` blocks (consecutive results share one turn).
"""

from __future__ import annotations

import json
from typing import Any

from raydeploy.serve.chat.hermes import CLOSE, OPEN

TOOLS_SECTION = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def text_of(content: Any) -> str:
    """A message's content as text: None is empty, OpenAI content parts join their text."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def tools_section(tools: list[dict[str, Any]]) -> str:
    return TOOLS_SECTION.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def call_text(call: dict[str, Any]) -> str:
    """An assistant's OpenAI tool call as the Hermes block the model would have written."""
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass  # kept as the text the client sent
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """`messages` in plain {role, content} turns of system/user/assistant only, the tools in the system prompt."""
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m.get("role"), text_of(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            blocks = "\n".join(call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{blocks}" if content else blocks})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool") == "1":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": "1"})
        else:
            out.append({"role": str(role), "content": content})
    for m in out:
        m.pop("_tool", None)
    if tools:
        section = tools_section(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section
        else:
            out.insert(0, {"role": "system", "content": section})
    return out
