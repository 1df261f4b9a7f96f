"""Chat formats: tools in the prompt, tool calls and reasoning out of the model's text, per model family.

`ChatFormat.create(codec, family, tool_parser, reasoning_parser)` picks the format once per deployment; it
renders conversations with tools (the model's template, or the fallback prompt of `fallback.py`), builds the
grammar that forces a call (`tool_constraint`), and splits output into `ChatOutput` or streamed `Delta`s. One
module per tool-call format: hermes.py, llama3.py, mistral.py, gemma3.py. See docs/structured-outputs.md.
"""

from raydeploy.serve.chat.format import REASONING_PARSERS, TOOL_PARSERS, ChatFormat, template_renders_tools
from raydeploy.serve.chat.streaming import ChatStreamer
from raydeploy.serve.chat.types import ChatOutput, Delta, ToolCall, ToolCallDelta, new_call_id

__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "ChatFormat", "ChatOutput", "ChatStreamer", "Delta", "ToolCall",
           "ToolCallDelta", "new_call_id", "template_renders_tools"]
