"""The chat layer's results: a finished assistant message split into content, reasoning and tool calls, and the
streaming pieces of one (OpenAI's delta shapes, so the HTTP layer only copies fields)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id: `call_` and 24 hex digits (clients key tool results by it)."""
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call."""

    id: str
    """`call_<24 hex>`, new per call."""
    name: str
    arguments: str
    """JSON text of the arguments object."""


@dataclass(frozen=True)
class ChatOutput:
    """A finished assistant message, split."""

    content: str | None
    """Text outside tool calls and reasoning (None when empty and there are calls)."""
    reasoning_content: str | None
    tool_calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class ToolCallDelta:
    """OpenAI's streaming delta of one call: id and name on the call's first delta, then argument fragments."""

    index: int
    """The call's index in this choice."""
    id: str | None
    name: str | None
    arguments: str
    """A fragment ("" on the first delta); the fragments join into the JSON arguments."""


@dataclass(frozen=True)
class Delta:
    """One streaming piece: exactly one field is set."""

    content: str | None = None
    reasoning_content: str | None = None
    tool_call: ToolCallDelta | None = None
