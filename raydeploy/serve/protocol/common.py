"""What every request body of the package stands on: the limits, the tolerant bases and the errors.

The schema is tolerant, as clients need it to be: an explicit `null` is the field's default (`_NullIsDefault`); a
field that has no effect on this server's output (`store`, `metadata`, `service_tier`, `user`, `prediction`, ...)
is accepted and ignored; an unknown field is ignored too, and named in the response's `X-Raydeploy-Ignored-Fields`
header and a debug log (`ignored_fields`), so a typo is visible without breaking a client that sends newer fields.
What stays a 400 naming the field is a *value* that would change the output and that this server cannot
honour (`best_of` other than n, a `suffix`, audio output, more alternatives than 20...): `UnsupportedValue`,
`InvalidValue`. Lists are counted before their items are validated (`_at_most`, `TooMany`), so a huge list costs
one len().
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 256
"""Characters of one stop string (the stream holds back up to this much text while a stop may still begin)."""
MAX_N = 1024
"""A ceiling on `n` before admission; what the server can actually hold at once is checked there, naming it."""
MAX_LOGPROBS = 20
"""Alternatives per token (`logprobs`, `top_logprobs`, `prompt_logprobs`), as OpenAI allows."""
MAX_LOGIT_BIAS = 300
"""Entries in `logit_bias`."""
SEED_RANGE = (-(2**63), 2**63)
"""Seeds OpenAI accepts (a signed 64-bit integer); negative ones are taken modulo 2**64 (`unsigned_seed`)."""
MAX_PROMPTS = 1024
"""Prompts in one /v1/completions body (each one is `n` sequences, and admission bounds their product)."""
MAX_MESSAGES = 2048
"""Messages in one /v1/chat/completions body."""
MAX_TEXT_PARTS = 2048
"""Text parts in one message's `content` list."""
MAX_HISTORY_TURNS = 1024
"""[user, assistant] turns in the `history` of one /chat body."""
MAX_STOP_TOKEN_IDS = 1024
"""Ids in `stop_token_ids`."""
MAX_TOP_K = 2**31 - 1
"""top_k travels to the engine as int32; any value above the vocabulary size already means 'all tokens'."""
MAX_TOOLS = 128
"""Functions in `tools` (each one's schema is compiled when the call is constrained)."""
MAX_TOOL_CALLS = 128
"""Calls in one assistant message's `tool_calls`."""
MAX_CHOICES = 1024
"""Strings in `structured_outputs.choice`."""
MAX_TEMPLATE_KWARGS = 32
"""Keys in `chat_template_kwargs`."""
MAX_TEMPLATE_CHARS = 65536
"""Characters of a request's own `chat_template`."""
MAX_IGNORED_LISTED = 32
"""Ignored field names one request reports (its header stays short whatever the body holds)."""
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
"""A function name, as OpenAI accepts it."""
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "tokenize",
                                      "continue_final_message", "return_dict", "return_tensors", "chat_template",
                                      "padding", "truncation", "max_length", "tokenizer_kwargs",
                                      "return_assistant_tokens_mask"})
"""`chat_template_kwargs` keys the server sets itself (or that change what rendering returns)."""


class _Strict(BaseModel):
    """A body whose fields are all known (the legacy ones' sub-objects)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class _Tolerant(BaseModel):
    """An OpenAI body or sub-object: strict types for the fields it knows, unknown fields kept aside (never used)
    so that `ignored_fields` can name them."""

    model_config = ConfigDict(extra="allow", strict=True)

    def ignored_fields(self) -> list[str]:
        """The unknown fields of this object and the objects inside it, as dotted paths (list positions left
        out, so a field repeated in every message is named once), in order, without repeats."""
        seen: dict[str, None] = {}
        for path in self._unknown(""):
            seen.setdefault(path, None)
            if len(seen) >= MAX_IGNORED_LISTED:
                break
        return list(seen)

    def _unknown(self, prefix: str) -> Iterator[str]:
        for name in self.__pydantic_extra__ or {}:
            yield f"{prefix}{name}"
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = value if isinstance(value, list) else [value]
            for item in items:
                if isinstance(item, _Tolerant):
                    yield from item._unknown(f"{prefix}{name}.")


class _NullIsDefault(_Tolerant):
    """An object whose fields take their default when sent as explicit `null` (as OpenAI reads them)."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class TooMany(ValueError):
    """A list longer than this server takes (the field is the error's location). Checked before the list's items
    are validated, so a huge list costs one len() and not a validation of each item."""

    def __init__(self, limit: int, found: int, what: str) -> None:
        super().__init__(f"holds {found} {what}; at most {limit} {what} are allowed")


def _at_most(param: str, limit: int, what: str) -> Any:
    """A before-validator bounding a list (or mapping) field's length."""

    def check(v: Any) -> Any:
        if isinstance(v, list | dict) and len(v) > limit:
            raise TooMany(limit, len(v), what)
        return v

    return field_validator(param, mode="before")(classmethod(lambda cls, v: check(v)))


def unsigned_seed(seed: int) -> int:
    """A seed as the engine takes it: OpenAI's signed 64-bit seeds, negatives modulo 2**64."""
    return seed % 2**64


class UnsupportedValue(ValueError):
    """A field this server knows but cannot honour with the given value; carries the field name."""

    code = "unsupported_value"

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"'{param}' {message}")
        self.param = param


class InvalidValue(UnsupportedValue):
    """A field whose value is wrong in itself (a duplicate tool name, a tool_choice naming no tool)."""

    code = "invalid_value"


def _unsupported(param: str, message: str) -> UnsupportedValue:
    return UnsupportedValue(param, message)
