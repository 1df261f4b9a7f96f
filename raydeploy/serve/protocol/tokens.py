"""The tokenizer endpoints' bodies (vLLM's): POST /tokenize with a text prompt or with messages, and
POST /detokenize."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from raydeploy.serve.protocol.chat import ChatCompletionRequest, ChatMessage, Tool
from raydeploy.serve.protocol.common import (
    MAX_MESSAGES,
    MAX_TEMPLATE_CHARS,
    MAX_TOOLS,
    InvalidValue,
    _at_most,
    _NullIsDefault,
)

MAX_DETOKENIZE_TOKENS = 1 << 20
"""Ids in one /detokenize body."""


class TokenizeCompletionRequest(_NullIsDefault):
    """POST /tokenize with a text prompt: its ids as /v1/completions would tokenize it."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_NullIsDefault):
    """POST /tokenize with messages: the ids of the rendered chat, as /v1/chat/completions would render it."""

    model: str | None = None
    messages: list[ChatMessage]
    _messages_count = _at_most("messages", MAX_MESSAGES, "messages")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: Annotated[str, Field(max_length=MAX_TEMPLATE_CHARS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    _tools_count = _at_most("tools", MAX_TOOLS, "tools")
    return_token_strs: bool = False

    _check_template_kwargs = field_validator("chat_template_kwargs")(
        classmethod(lambda cls, v: ChatCompletionRequest._check_template_kwargs(v)))

    @model_validator(mode="after")
    def _check_continue(self):
        if self.continue_final_message:
            if "add_generation_prompt" not in self.model_fields_set:
                self.add_generation_prompt = False
            elif self.add_generation_prompt:
                raise InvalidValue("continue_final_message", "and 'add_generation_prompt' cannot both be true "
                                                             "(the last message is continued, no new turn opened)")
        return self


class DetokenizeRequest(_NullIsDefault):
    """POST /detokenize: ids back to text."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
    _tokens_count = _at_most("tokens", MAX_DETOKENIZE_TOKENS, "token ids")
