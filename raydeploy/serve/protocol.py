"""The HTTP request bodies, as pydantic models (the only pydantic in raydeploy).

OpenAI's `/v1/completions` and `/v1/chat/completions` with every field the OpenAI reference defines, vLLM's
extensions (top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos,
include_stop_str_in_output, skip_special_tokens, `structured_outputs`, chat_template, chat_template_kwargs,
continue_final_message, ...) and the old EasyDeL JAXServer `/chat` and `/instruct` bodies.

The schema is tolerant, as clients need it to be: an explicit `null` is the field's default; a field that has
no effect on this server's output (`store`, `metadata`, `service_tier`, `user`, `prediction`, ...) is accepted
and ignored; an unknown field is ignored too, and named in the response's `X-Raydeploy-Ignored-Fields` header
and a debug log (`ignored_fields`), so a typo is visible without breaking a client that sends newer fields.
What stays a 400 naming the field is a *value* that would change the output and that this server cannot
honour (`best_of` other than n, a `suffix`, audio output, more alternatives than 20...). Lists are counted
before their items are validated, so a huge list costs one len().

Structured outputs (`response_format`, `structured_outputs`) and tools are only shaped here; what they mean for
generation is :mod:`raydeploy.serve.structured`. Checks that need the tokenizer or the config (context length,
max_tokens cap, token ids against the vocabulary) live in :mod:`raydeploy.serve.generation` and the routes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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


class StreamOptions(_NullIsDefault):
    include_usage: bool = False
    """A last chunk with the usage of the whole request."""
    continuous_usage_stats: bool = False
    """Extension (vLLM): the usage so far on every chunk."""


# -- structured outputs --------------------------------------------------------------------------------


class JsonSchemaSpec(_Tolerant):
    """`response_format.json_schema`: OpenAI's named schema (`schema` is checked in serve.structured, so that
    a missing or unusable one is a 400 naming the problem rather than pydantic's wording)."""

    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    schema_: Any = Field(default=None, alias="schema")
    strict: bool | None = None


class TextFormat(_Tolerant):
    type: Literal["text"]


class JsonObjectFormat(_Tolerant):
    type: Literal["json_object"]


class JsonSchemaFormat(_Tolerant):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputs(_Tolerant):
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


class _SamplingFields(_NullIsDefault):
    """Fields shared by both OpenAI endpoints."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    """0 only with completions' `echo` (the prompt's logprobs, nothing generated)."""
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] | None = None
    """Extension: keep the k most likely tokens; 0 or -1 disables."""
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    """Extension: drop tokens less likely than min_p times the most likely one."""
    seed: Annotated[int, Field(ge=SEED_RANGE[0], lt=SEED_RANGE[1])] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    """Read only when stream is true (ignored otherwise)."""
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    """Extension (CTRL-style): > 1 discourages repeating tokens already in the sequence."""
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    """Token id (as a string) -> a bias added to its logit; -100 bans the token, 100 all but forces it."""
    min_tokens: Annotated[int, Field(ge=0)] = 0
    """Extension: no end-of-sequence or stop before this many tokens."""
    ignore_eos: bool = False
    """Extension: keep generating past end-of-sequence until max_tokens."""
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    """Extension: extra token ids that end generation."""
    include_stop_str_in_output: bool = False
    """Extension: the stop string that ended the text stays at its end."""
    skip_special_tokens: bool = True
    """Extension: special tokens (end of turn, ...) are left out of the text."""
    timeout_s: Annotated[float, Field(gt=0.0)] | None = None
    """Extension: a deadline shorter than serving.request_timeout_s for this request."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    """Extension (vLLM): a schema, regex, choice or grammar the output must match."""
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    """Extension (vLLM): the logprob of every prompt token, with this many alternatives."""
    # accepted and ignored: they do not change what this server generates
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    priority: int = 0
    request_id: str | None = None
    cache_salt: str | None = None
    spaces_between_special_tokens: bool = True
    # vLLM's extensions accepted at their default only (another value is a 400 naming the field)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False

    _stop_count = _at_most("stop", MAX_STOP_STRINGS, "stop strings")
    _stop_token_ids_count = _at_most("stop_token_ids", MAX_STOP_TOKEN_IDS, "token ids")
    _logit_bias_count = _at_most("logit_bias", MAX_LOGIT_BIAS, "entries")
    _allowed_count = _at_most("allowed_token_ids", MAX_STOP_TOKEN_IDS, "token ids")
    _bad_words_count = _at_most("bad_words", MAX_STOP_STRINGS, "words")

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        long = next((s for s in stops if len(s) > MAX_STOP_CHARS), None)
        if long is not None:
            raise ValueError(f"holds a stop string of {len(long)} characters; at most {MAX_STOP_CHARS} are allowed")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not (key.isascii() and key.isdigit()) or len(key) > 12:
                raise InvalidValue("logit_bias", f"has the key {key[:32]!r}; keys are token ids (digits, e.g. "
                                                 f"\"50256\")")
        return v

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        """`logit_bias` keyed by token id."""
        return {int(k): float(b) for k, b in (self.logit_bias or {}).items()}

    @property
    def stops(self) -> list[str]:
        """`stop` as validated: the field accepts a string, `_check_stop` has made it a list."""
        return list(self.stop or [])

    @property
    def token_limit(self) -> int | None:
        """The output's length limit the request asks for (None: until a stop or the context's end)."""
        return self.max_tokens

    @property
    def token_limit_param(self) -> str:
        return "max_tokens"

    @property
    def engine_seed(self) -> int | None:
        return None if self.seed is None else unsigned_seed(self.seed)

    @property
    def stream_usage(self) -> tuple[bool, bool]:
        """(a last usage chunk, usage on every chunk), read only when streaming."""
        so = self.stream_options
        if not self.stream or so is None:
            return False, False
        return so.include_usage or so.continuous_usage_stats, so.continuous_usage_stats

    @model_validator(mode="after")
    def _check_unsupported(self):
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise _unsupported("structured_outputs", "and 'response_format' cannot be combined; send one of them")
        limit = self.token_limit
        if limit is not None and self.min_tokens > limit:
            raise InvalidValue("min_tokens", f"is {self.min_tokens}, more than '{self.token_limit_param}' "
                                             f"({limit})")
        at_default = (("use_beam_search", self.use_beam_search, False, "beam search is not supported"),
                      ("length_penalty", self.length_penalty, 1.0, "it applies to beam search, which is not "
                       "supported"),
                      ("truncate_prompt_tokens", self.truncate_prompt_tokens, None, "truncation is not "
                       "supported; shorten the prompt"),
                      ("allowed_token_ids", self.allowed_token_ids or None, None, "it is not supported; use "
                       "structured_outputs or logit_bias"),
                      ("bad_words", self.bad_words or None, None, "it is not supported; use logit_bias"),
                      ("return_tokens_as_token_ids", self.return_tokens_as_token_ids, False, "it is not supported"),
                      ("return_token_ids", self.return_token_ids, False, "it is not supported"))
        for param, value, default, why in at_default:
            if value != default:
                shown = "set" if default is None else repr(value)
                raise _unsupported(param, f"is {shown}: {why} (only {'null' if default is None else default!r} "
                                          f"is accepted)")
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None
    add_special_tokens: bool = True
    """Extension: a text prompt is tokenized with the tokenizer's special tokens (BOS...)."""

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_count(cls, v: Any) -> Any:
        # a list of token ids is one prompt (bounded by the context); a list of texts or id lists is many
        if isinstance(v, list) and len(v) > MAX_PROMPTS and not isinstance(v[0], int):
            raise TooMany(MAX_PROMPTS, len(v), "prompts")
        return v

    @model_validator(mode="after")
    def _check_completion(self):
        if self.max_tokens == 0 and not self.echo:
            raise InvalidValue("max_tokens", "is 0, which only 'echo': true allows (the prompt's logprobs alone); "
                                             "ask for at least 1 token")
        if self.suffix:
            raise _unsupported("suffix", "is not supported (no fill-in-the-middle)")
        if self.best_of is not None and self.best_of != self.n:
            raise _unsupported("best_of", "must equal n (best-of ranking is not supported)")
        return self


class TextPart(_Tolerant):
    type: Literal["text"]
    text: str


class FunctionCall(_Tolerant):
    name: str
    arguments: str
    """The arguments object as JSON text (as OpenAI sends it back)."""


class ToolCallItem(_Tolerant):
    """One call in an assistant message's `tool_calls` (history the client sends back)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Tolerant):
    """One message of the history. `tool` messages carry the result of the call named by `tool_call_id`;
    assistant messages may carry `tool_calls`, and then their content may be null or absent, and the
    `reasoning_content` this server answered with (a client that sends the SDK's message object back sends
    it, as `reasoning` in newer vLLM's naming; templates that show past reasoning read it). The rest of the
    SDK's message object (`refusal`, `annotations`, `audio`, `function_call`, all null) is accepted; a legacy
    `function_call` becomes the message's one tool call."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: FunctionCall | None = None

    _content_count = _at_most("content", MAX_TEXT_PARTS, "text parts")
    _tool_calls_count = _at_most("tool_calls", MAX_TOOL_CALLS, "tool calls")
    _annotations_count = _at_most("annotations", MAX_TOOL_CALLS, "annotations")

    @model_validator(mode="before")
    @classmethod
    def _calls_need_no_content(cls, data: Any) -> Any:
        # an assistant turn that only calls tools may leave `content` out (OpenAI's SDKs and agent frameworks do)
        if isinstance(data, dict) and "content" not in data and data.get("role") == "assistant" \
                and (data.get("tool_calls") or data.get("function_call")):
            return {**data, "content": None}
        return data

    @model_validator(mode="after")
    def _check_roles(self):
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs 'tool_call_id' (the id of the call it answers)")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError(f"'tool_call_id' belongs to 'tool' messages, not to a '{self.role}' message")
        for only_assistant in ("tool_calls", "reasoning_content", "reasoning", "function_call", "refusal"):
            if getattr(self, only_assistant) is not None and self.role != "assistant":
                raise ValueError(f"'{only_assistant}' belongs to 'assistant' messages, not to a '{self.role}' "
                                 f"message")
        if self.audio is not None:
            raise ValueError("'audio' (a reference to an earlier audio answer) is not supported: this server "
                             "answers in text only")
        if self.function_call is not None and not self.tool_calls:
            self.tool_calls = [ToolCallItem(id="call_0", function=self.function_call)]
        if self.reasoning_content is None and self.reasoning is not None:
            self.reasoning_content = self.reasoning
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal is not None)):
            raise ValueError(f"a '{self.role}' message needs 'content' (only an assistant message with "
                             f"'tool_calls' or a 'refusal' may have none)")
        return self

    def text(self) -> str:
        """The message's text: its parts joined with newlines, as vLLM joins them."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates take it (OpenAI's shape; `developer` is a system message there)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": None if self.content is None else self.text()}
        if self.content is None and self.refusal is not None and not self.tool_calls:
            out["content"] = self.refusal
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


class FunctionSpec(_Tolerant):
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema (an object schema); absent: any arguments object."""
    strict: bool | None = None


class Tool(_Tolerant):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Tolerant):
    name: str


class NamedToolChoice(_Tolerant):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    _messages_count = _at_most("messages", MAX_MESSAGES, "messages")
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    """Extension: append the assistant turn header of the chat template (default true; false by default with
    continue_final_message)."""
    continue_final_message: bool = False
    """Extension (vLLM): the last message is continued, left open (no end of turn, no new turn header)."""
    chat_template: Annotated[str, Field(max_length=MAX_TEMPLATE_CHARS)] | None = None
    """Extension (vLLM): a Jinja chat template used for this request instead of the deployment's."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extension: extra variables for the chat template (e.g. {"enable_thinking": false})."""
    add_special_tokens: bool = False
    """Extension: the tokenizer's special tokens (BOS...) added on top of the rendered template's."""
    documents: list[Any] | None = None
    echo: bool = False
    tools: list[Tool] | None = None
    _tools_count = _at_most("tools", MAX_TOOLS, "tools")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: "auto" with tools, "none" without."""
    parallel_tool_calls: bool = True
    functions: list[FunctionSpec] | None = None
    """Deprecated by OpenAI for `tools`: each becomes a function tool."""
    _functions_count = _at_most("functions", MAX_TOOLS, "functions")
    function_call: Literal["none", "auto"] | FunctionName | None = None
    """Deprecated by OpenAI for `tool_choice`."""
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    # accepted and ignored: they do not change what this server generates
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None

    _modalities_count = _at_most("modalities", 4, "modalities")

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
        self._take_legacy_functions()
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

    def _take_legacy_functions(self) -> None:
        """`functions` / `function_call` (OpenAI's deprecated names) as `tools` / `tool_choice`."""
        if self.functions is not None:
            if self.tools is not None:
                raise InvalidValue("functions", "and 'tools' cannot be combined; send 'tools' (functions is the "
                                                "deprecated name)")
            self.tools = [Tool(type="function", function=f) for f in self.functions]
        if self.function_call is not None:
            if self.tool_choice is not None:
                raise InvalidValue("function_call", "and 'tool_choice' cannot be combined; send 'tool_choice' "
                                                    "(function_call is the deprecated name)")
            fc = self.function_call
            self.tool_choice = fc if isinstance(fc, str) else NamedToolChoice(type="function", function=fc)

    @model_validator(mode="after")
    def _check_chat(self):
        if self.max_tokens == 0:
            raise InvalidValue("max_tokens", "is 0; ask for at least 1 token")
        if self.top_logprobs and not self.logprobs:
            raise InvalidValue("top_logprobs", f"is {self.top_logprobs} but 'logprobs' is not true; alternatives come "
                                               "with the chosen tokens' logprobs (set 'logprobs': true)")
        if self.max_completion_tokens is not None and self.max_tokens is not None \
                and self.max_completion_tokens != self.max_tokens:
            raise _unsupported("max_completion_tokens", "and max_tokens disagree; send one of them")
        if self.continue_final_message:
            if "add_generation_prompt" not in self.model_fields_set:
                self.add_generation_prompt = False
            elif self.add_generation_prompt:
                raise InvalidValue("continue_final_message", "and 'add_generation_prompt' cannot both be true "
                                                             "(the last message is continued, no new turn opened)")
        other = [m for m in self.modalities or () if m != "text"]
        if other:
            raise _unsupported("modalities", f"may only hold \"text\" (found {other[0][:32]!r}): this server "
                                             f"answers in text only")
        if self.audio is not None:
            raise _unsupported("audio", "output is not supported: this server answers in text only")
        if self.echo:
            raise _unsupported("echo", "is not supported for chat")
        if self.documents:
            raise _unsupported("documents", "are not supported")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def token_limit_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

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


# -- the tokenizer endpoints (vLLM's bodies) ------------------------------------------------------------

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
