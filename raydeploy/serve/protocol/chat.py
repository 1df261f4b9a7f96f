"""The `/v1/chat/completions` body: the messages (text parts, tool calls sent back, tool results), the tools
and the tool choice (OpenAI's deprecated `functions` / `function_call` read as them), and the chat template's
options (vLLM's chat_template, chat_template_kwargs, continue_final_message, ...). Tools are only shaped here;
what they mean for generation is :mod:`raydeploy.serve.structured`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from raydeploy.serve.protocol.common import (
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_TEMPLATE_CHARS,
    MAX_TEMPLATE_KWARGS,
    MAX_TEXT_PARTS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    RESERVED_TEMPLATE_KWARGS,
    TOOL_NAME,
    InvalidValue,
    _at_most,
    _Tolerant,
    _unsupported,
)
from raydeploy.serve.protocol.sampling import _SamplingFields


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
