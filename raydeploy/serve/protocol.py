"""The HTTP request bodies, as pydantic models (the only pydantic in raydeploy).

OpenAI's `/v1/completions` and `/v1/chat/completions` (with a few widely used extensions: top_k, seed,
repetition_penalty, ignore_eos, stop_token_ids, timeout_s, vLLM's `structured_outputs` and
`chat_template_kwargs`) and the old EasyDeL JAXServer `/chat` and `/instruct` bodies. Structured outputs
(`response_format`, `structured_outputs`) and tools are only shaped here; what they mean for generation (the
constraint, the checks that need the grammar engine) is :mod:`raydeploy.serve.structured`. Unknown fields are rejected so a typo is an error naming the field, not a silent
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
MAX_TOOLS = 128
"""Functions in `tools` (each one's schema is compiled when the call is constrained)."""
MAX_TOOL_CALLS = 128
"""Calls in one assistant message's `tool_calls`."""
MAX_CHOICES = 1024
"""Strings in `structured_outputs.choice`."""
MAX_TEMPLATE_KWARGS = 32
"""Keys in `chat_template_kwargs`."""
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
"""A function name, as OpenAI accepts it."""
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "tokenize",
                                      "continue_final_message", "return_dict", "return_tensors", "chat_template",
                                      "padding", "truncation", "max_length", "tokenizer_kwargs",
                                      "return_assistant_tokens_mask"})
"""`chat_template_kwargs` keys the server sets itself (or that change what rendering returns)."""


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


# -- structured outputs --------------------------------------------------------------------------------


class JsonSchemaSpec(_Strict):
    """`response_format.json_schema`: OpenAI's named schema (`schema` is checked in serve.structured, so that
    a missing or unusable one is a 400 naming the problem rather than pydantic's wording)."""

    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    schema_: Any = Field(default=None, alias="schema")
    strict: bool | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extension: exactly one of a JSON schema (an object, or its JSON text), any
    JSON object, a regex, a choice among strings, or a Lark grammar (llguidance's dialect)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    _choice_count = _at_most("choice", MAX_CHOICES, "strings")

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k, v in (("json", self.json_), ("json_object", self.json_object or None),
                                ("regex", self.regex), ("choice", self.choice), ("grammar", self.grammar))
                 if v is not None]
        if len(given) != 1:
            found = ", ".join(given) if given else "none"
            raise ValueError(f"set exactly one of json, json_object, regex, choice, grammar (found: {found})")
        if self.choice is not None and not self.choice:
            raise ValueError("'choice' must hold at least one string")
        return self


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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    """Extension (vLLM): a schema, regex, choice or grammar the output must match."""

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
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise _unsupported("structured_outputs", "and 'response_format' cannot be combined; send one of them")
        return self


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


class FunctionCall(_Strict):
    name: str
    arguments: str
    """The arguments object as JSON text (as OpenAI sends it back)."""


class ToolCallItem(_Strict):
    """One call in an assistant message's `tool_calls` (history the client sends back)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """One message of the history. `tool` messages carry the result of the call named by `tool_call_id`;
    assistant messages may carry `tool_calls`, and then their content may be null or absent, and the
    `reasoning_content` this server answered with (a client that sends the SDK's message object back sends
    it; templates that show past reasoning read it)."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    _content_count = _at_most("content", MAX_TEXT_PARTS, "text parts")
    _tool_calls_count = _at_most("tool_calls", MAX_TOOL_CALLS, "tool calls")

    @model_validator(mode="before")
    @classmethod
    def _calls_need_no_content(cls, data: Any) -> Any:
        # an assistant turn that only calls tools may leave `content` out (OpenAI's SDKs and agent frameworks do)
        if isinstance(data, dict) and "content" not in data and data.get("role") == "assistant" \
                and data.get("tool_calls"):
            return {**data, "content": None}
        return data

    @model_validator(mode="after")
    def _check_roles(self):
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs 'tool_call_id' (the id of the call it answers)")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError(f"'tool_call_id' belongs to 'tool' messages, not to a '{self.role}' message")
        for only_assistant in ("tool_calls", "reasoning_content"):
            if getattr(self, only_assistant) is not None and self.role != "assistant":
                raise ValueError(f"'{only_assistant}' belongs to 'assistant' messages, not to a '{self.role}' "
                                 f"message")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a '{self.role}' message needs 'content' (only an assistant message with "
                             f"'tool_calls' may have none)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates take it (OpenAI's shape; `developer` is a system message there)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": None if self.content is None else self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


class FunctionSpec(_Strict):
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema (an object schema); absent: any arguments object."""
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    _messages_count = _at_most("messages", MAX_MESSAGES, "messages")
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True
    """Extension: append the assistant turn header of the chat template (default true)."""
    tools: list[Tool] | None = None
    _tools_count = _at_most("tools", MAX_TOOLS, "tools")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: "auto" with tools, "none" without."""
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    """Extension: extra variables for the chat template (e.g. {"enable_thinking": false})."""

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return None
        if len(v) > MAX_TEMPLATE_KWARGS:
            raise ValueError(f"holds {len(v)} keys; at most {MAX_TEMPLATE_KWARGS} are allowed")
        reserved = sorted(set(v) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"may not set {', '.join(reserved)} (the server sets them from the request)")
        return v

    @model_validator(mode="after")
    def _check_tools(self):
        names = [t.function.name for t in self.tools or ()]
        dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if dup is not None:
            raise InvalidValue("tools", f"define the function {dup!r} more than once; names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                known = ", ".join(names) if names else "no tools were given"
                raise InvalidValue("tool_choice", f"names the function {choice.function.name!r}, which is not "
                                                  f"among 'tools' ({known})")
        elif choice == "required" and not names:
            raise InvalidValue("tool_choice", "is 'required' but no 'tools' were given")
        if self.forced_tool is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise InvalidValue("tool_choice", f"{self.forced_tool_label} cannot be combined with 'response_format' "
                                              f"(the call is already constrained to the function's schema)")
        if self.forced_tool is not None and self.structured_outputs is not None:
            raise InvalidValue("tool_choice", f"{self.forced_tool_label} cannot be combined with "
                                              f"'structured_outputs' (the call is already constrained to the "
                                              f"function's schema)")
        return self

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

    @property
    def tools_on(self) -> bool:
        """Tools are shown to the model and calls parsed from its answer: some given, and tool_choice not none."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool(self) -> str | None:
        """"" for tool_choice "required" (any function), a function's name for a named choice, else None."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "" if self.tool_choice == "required" else None

    @property
    def forced_tool_label(self) -> str:
        forced = self.forced_tool
        return "set to 'required'" if not forced else f"naming {forced!r}"


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
