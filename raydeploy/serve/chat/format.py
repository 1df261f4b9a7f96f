"""`ChatFormat`: one deployment's way of talking tools and reasoning with its model, chosen once at start.

It renders a conversation (tools through the model's own template where the template renders them, else the
documented fallback prompt), builds the grammar that forces a tool call in the model's format (tool_choice
`required` or a named function), and splits the model's output into content, reasoning and tool calls, whole or
streamed. The format comes from the model's family (`raydeploy.model.registry.chat_formats`); config keys
`model.tool_parser` and `model.reasoning_parser` override it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from raydeploy.constraints.spec import Constraint
from raydeploy.model.registry import chat_formats
from raydeploy.serve.chat import gemma3, hermes, llama3, mistral
from raydeploy.serve.chat.fallback import fallback_messages
from raydeploy.serve.chat.streaming import THINK_CLOSE, THINK_OPEN, ChatStreamer, collect, opens_thinking
from raydeploy.serve.chat.syntax import ToolSyntax, function_of
from raydeploy.serve.chat.types import ChatOutput
from raydeploy.serve.text import TextCodec

SYNTAXES: dict[str, ToolSyntax] = {s.name: s for s in (hermes.SYNTAX, llama3.SYNTAX, mistral.SYNTAX, gemma3.SYNTAX)}
TOOL_PARSERS: tuple[str, ...] = ("auto", *SYNTAXES)
"""Values of `model.tool_parser`."""
REASONING_PARSERS: tuple[str, ...] = ("auto", "none", "think")
"""Values of `model.reasoning_parser`."""
FALLBACK_FORMAT = "hermes"

_TOOLS_REF = re.compile(r"\btools\b")


def template_renders_tools(chat_template: Any) -> bool:
    """The template's source refers to `tools` (HF templates take them as `tools=`); a tokenizer with named
    templates (a dict) counts if one of them does."""
    sources = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    return any(isinstance(s, str) and bool(_TOOLS_REF.search(s)) for s in sources)


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as HF templates that render tools expect them: call arguments as objects (Llama's and Mistral's
    `tojson` would quote a JSON text a second time), no keys set to None (Llama's template tests `'tool_calls' in
    message`), and content "" where a client sent null (Gemma's raises on a content that is not text)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None or k == "content"}
        if m.get("content") is None:
            m["content"] = ""
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass  # the client's text stays as sent
                fixed.append({**c, "function": fn})
            m["tool_calls"] = fixed
        out.append(m)
    return out


class ChatFormat:
    """How this deployment renders tools and reads tool calls and reasoning (see the module docstring)."""

    def __init__(self, codec: TextCodec, tool_format: str, reasoning: str | None, template_has_tools: bool) -> None:
        self.codec = codec
        self.tool_format = tool_format
        """The tool-call format this deployment parses: hermes, llama3_json, mistral or gemma3."""
        self.reasoning = reasoning
        """"think" when `<think>...</think>` goes to reasoning_content; None otherwise."""
        self.template_has_tools = template_has_tools
        """The model's chat template renders `tools=` itself; otherwise the fallback prompt does."""
        self._syntax = SYNTAXES[tool_format]

    @classmethod
    def create(cls, codec: TextCodec, family: str | None, tool_parser: str = "auto",
               reasoning_parser: str = "auto") -> ChatFormat:
        """The format for a model: `family` is its model_type (config.json) or family name (None: unknown).
        `auto` takes the family's tool format when the template renders tools, else the fallback (hermes), and
        the family's reasoning markup."""
        if tool_parser not in TOOL_PARSERS:
            raise ValueError(f"model.tool_parser must be one of {', '.join(TOOL_PARSERS)}, got {tool_parser!r}")
        if reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"model.reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {reasoning_parser!r}")
        family_format, family_reasoning = chat_formats(family)
        has_tools = template_renders_tools(getattr(codec.tokenizer, "chat_template", None))
        if tool_parser == "auto":
            tool_format = family_format if has_tools else FALLBACK_FORMAT
        elif not has_tools and tool_parser != FALLBACK_FORMAT:
            raise ValueError(f"model.tool_parser {tool_parser!r} needs a chat template that renders tools, and this "
                             f"model's template does not (its tools go through the fallback prompt, which asks "
                             f"for {FALLBACK_FORMAT} calls): use auto or {FALLBACK_FORMAT}")
        else:
            tool_format = tool_parser
        reasoning = {"auto": family_reasoning, "none": None}.get(reasoning_parser, reasoning_parser)
        return cls(codec, tool_format, reasoning, has_tools)

    # -- prompts
    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text for OpenAI-shaped `messages` and `tools` (ChatTemplateError with the template's own
        message when it refuses them)."""
        has_tool_turns = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
        if self.template_has_tools:
            msgs = _template_messages(messages)
            return self.codec.chat_prompt(msgs, add_generation_prompt, tools=tools or None,
                                          template_kwargs=template_kwargs)
        if tools or has_tool_turns or any(m.get("content") is None for m in messages):
            return self.codec.chat_prompt(fallback_messages(messages, tools), add_generation_prompt,
                                          template_kwargs=template_kwargs)
        return self.codec.chat_prompt(messages, add_generation_prompt, template_kwargs=template_kwargs)

    def tool_constraint(self, tools: list[dict[str, Any]], name: str | None, parallel: bool) -> Constraint:
        """A grammar constraint whose output is one call (or, with `parallel`, one or more) in this format, to
        the function `name` (None: any of `tools`), arguments valid against its schema, and nothing else."""
        chosen = tools
        if name is not None:
            chosen = [t for t in tools if function_of(t)["name"] == name]
            if not chosen:
                known = ", ".join(function_of(t)["name"] for t in tools)
                raise ValueError(f"tool_choice names function {name!r}, which is not among the tools ({known})")
            parallel = False  # a named function: exactly that one call
        if not chosen:
            raise ValueError("tool_choice 'required' needs at least one tool")
        return Constraint("grammar", self._syntax.grammar(chosen, parallel))

    # -- output
    def parse(self, text: str, tools: bool, prompt: str | None = None) -> ChatOutput:
        """A finished message split into content, reasoning and calls (`tools` False: no call parsing). `prompt`,
        the rendered prompt, tells whether the template opened a `<think>` block the output starts inside; a whole
        message that closes `</think>` without opening it started inside one too."""
        inside = opens_thinking(prompt) or (THINK_CLOSE in text and THINK_OPEN not in text)
        streamer = ChatStreamer(self._syntax if tools else None, self.reasoning == "think", inside)
        return collect(streamer.feed(text) + streamer.finish())

    def streamer(self, tools: bool, prompt: str | None = None) -> ChatStreamer:
        """A fresh streaming splitter for one choice (see `parse` for `prompt`)."""
        return ChatStreamer(self._syntax if tools else None, self.reasoning == "think", opens_thinking(prompt))
