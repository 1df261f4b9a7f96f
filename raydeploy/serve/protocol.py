"""The HTTP request bodies, as pydantic models (the only pydantic in raydeploy).

OpenAI's `/v1/completions` and `/v1/chat/completions` (with a few widely used extensions: top_k, seed,
repetition_penalty, ignore_eos, stop_token_ids, timeout_s) and the old EasyDeL JAXServer `/chat` and
`/instruct` bodies. Unknown fields are rejected so a typo is an error naming the field, not a silent
default. Checks that need the tokenizer or the config (context length, max_tokens bound) live in
:mod:`raydeploy.serve.generation`. Responses are built as plain dicts there too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 4
MAX_N = 8
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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TooMany(ValueError):
    """A list longer than this server takes (the field is the error's location). Checked before the list's items
    are validated, so a huge list costs one len() and not a validation of each item."""

    def __init__(self, limit: int, found: int, what: str) -> None:
        super().__init__(f"holds {found} {what}; at most {limit} {what} are allowed")


def _at_most(param: str, limit: int, what: str) -> Any:
    """A before-validator bounding a list field's length."""

    def check(v: Any) -> Any:
        if isinstance(v, list) and len(v) > limit:
            raise TooMany(limit, len(v), what)
        return v

    return field_validator(param, mode="before")(classmethod(lambda cls, v: check(v)))


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields shared by both OpenAI endpoints."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] | None = None
    """Extension: keep the k most likely tokens; 0 or -1 disables."""
    seed: Annotated[int, Field(ge=0, lt=2**31)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    """Extension (CTRL-style): > 1 discourages repeating tokens already in the sequence."""
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    """Extension: keep generating past end-of-sequence until max_tokens."""
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    """Extension: extra token ids that end generation."""
    timeout_s: Annotated[float, Field(gt=0.0)] | None = None
    """Extension: a deadline shorter than serving.request_timeout_s for this request."""

    _stop_count = _at_most("stop", MAX_STOP_STRINGS, "stop strings")
    _stop_token_ids_count = _at_most("stop_token_ids", MAX_STOP_TOKEN_IDS, "token ids")

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, found {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @model_validator(mode="after")
    def _check_unsupported(self):
        if self.presence_penalty != 0.0 or self.frequency_penalty != 0.0:
            param = "presence_penalty" if self.presence_penalty != 0.0 else "frequency_penalty"
            raise _unsupported(param, "is not supported; use repetition_penalty")
        if self.logit_bias:
            raise _unsupported("logit_bias", "is not supported")
        if self.stream_options is not None and not self.stream:
            raise _unsupported("stream_options", "is only allowed when stream is true")
        return self


class UnsupportedValue(ValueError):
    """A field this server knows but cannot honour with the given value; carries the field name."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"'{param}' {message}")
        self.param = param


def _unsupported(param: str, message: str) -> UnsupportedValue:
    return UnsupportedValue(param, message)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_count(cls, v: Any) -> Any:
        # a list of token ids is one prompt (bounded by the context); a list of texts or id lists is many
        if isinstance(v, list) and len(v) > MAX_PROMPTS and not isinstance(v[0], int):
            raise TooMany(MAX_PROMPTS, len(v), "prompts")
        return v

    @model_validator(mode="after")
    def _check_completion(self):
        if self.echo:
            raise _unsupported("echo", "is not supported")
        if self.suffix:
            raise _unsupported("suffix", "is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise _unsupported("best_of", "must equal n (best-of ranking is not supported)")
        if self.logprobs is not None and self.logprobs > 0:
            raise _unsupported("logprobs", "values above 0 (alternative tokens) are not supported; "
                                           "logprobs=0 returns each chosen token's log-probability")
        return self


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    _content_count = _at_most("content", MAX_TEXT_PARTS, "text parts")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    _messages_count = _at_most("messages", MAX_MESSAGES, "messages")
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True
    """Extension: append the assistant turn header of the chat template (default true)."""

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs:
            raise _unsupported("top_logprobs", "above 0 (alternative tokens) is not supported; "
                                               "logprobs=true returns each chosen token's log-probability")
        if self.max_completion_tokens is not None and self.max_tokens is not None \
                and self.max_completion_tokens != self.max_tokens:
            raise _unsupported("max_completion_tokens", "and max_tokens disagree; send one of them")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- the old EasyDeL JAXServer endpoints ----------------------------------------------------------------


class LegacyChatRequest(BaseModel):
    """POST /chat of EasyDeL's JAXServer: a prompt, the history as [[user, assistant], ...], greedy or not."""

    model_config = ConfigDict(extra="ignore", strict=True)
    prompt: str
    history: list[Annotated[list[str], Field(min_length=2, max_length=2)]] = Field(default_factory=list)
    _history_count = _at_most("history", MAX_HISTORY_TURNS, "turns")
    greedy: bool = False
    system: str | None = None
    max_new_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_TOP_K)] | None = None


class LegacyInstructRequest(BaseModel):
    """POST /instruct of EasyDeL's JAXServer: an instruction with an optional system prompt."""

    model_config = ConfigDict(extra="ignore", strict=True)
    instruction: str
    system: str | None = None
    greedy: bool = False
    max_new_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_TOP_K)] | None = None
