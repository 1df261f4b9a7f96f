"""The HTTP request bodies, as pydantic models (the only pydantic in raydeploy).

OpenAI's `/v1/completions` and `/v1/chat/completions` with every field the OpenAI reference defines, vLLM's
extensions (top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos,
include_stop_str_in_output, skip_special_tokens, `structured_outputs`, chat_template, chat_template_kwargs,
continue_final_message, ...) and the old EasyDeL JAXServer `/chat` and `/instruct` bodies.

The schema is tolerant, as clients need it to be (`common` tells how): an explicit `null` is the field's default,
a field with no effect on the output is accepted and ignored, an unknown field is ignored and named in the
`X-Raydeploy-Ignored-Fields` header; a *value* this server cannot honour is a 400 naming the field. Lists are
counted before their items are validated, so a huge list costs one len().

The modules:
- `common`: the limits, the tolerant bases (`ignored_fields`), `TooMany`, `UnsupportedValue`, `InvalidValue`;
- `formats`: structured outputs as requests shape them (`response_format`, `structured_outputs`);
- `sampling`: the fields both OpenAI endpoints share (sampling, streaming, stops, logit_bias, ...);
- `completions`: the `/v1/completions` body;
- `chat`: the `/v1/chat/completions` body, its messages, tools and tool choice;
- `tokens`: the `/tokenize` and `/detokenize` bodies;
- `legacy`: the EasyDeL `/chat` and `/instruct` bodies.
Every public name is importable from this package.

Structured outputs and tools are only shaped here; what they mean for generation is
:mod:`raydeploy.serve.structured`. Checks that need the tokenizer or the config (context length, max_tokens cap,
token ids against the vocabulary) live in :mod:`raydeploy.serve.generation` and the routes.
"""

from raydeploy.serve.protocol.chat import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionName,
    FunctionSpec,
    NamedToolChoice,
    TextPart,
    Tool,
    ToolCallItem,
)
from raydeploy.serve.protocol.common import (
    MAX_CHOICES,
    MAX_HISTORY_TURNS,
    MAX_IGNORED_LISTED,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPLATE_CHARS,
    MAX_TEMPLATE_KWARGS,
    MAX_TEXT_PARTS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    MAX_TOP_K,
    RESERVED_TEMPLATE_KWARGS,
    SEED_RANGE,
    TOOL_NAME,
    InvalidValue,
    TooMany,
    UnsupportedValue,
    unsigned_seed,
)
from raydeploy.serve.protocol.completions import CompletionRequest
from raydeploy.serve.protocol.formats import (
    JsonObjectFormat,
    JsonSchemaFormat,
    JsonSchemaSpec,
    ResponseFormat,
    StructuredOutputs,
    TextFormat,
)
from raydeploy.serve.protocol.legacy import LegacyChatRequest, LegacyInstructRequest
from raydeploy.serve.protocol.sampling import StreamOptions
from raydeploy.serve.protocol.tokens import (
    MAX_DETOKENIZE_TOKENS,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

__all__ = [
    "MAX_CHOICES", "MAX_DETOKENIZE_TOKENS", "MAX_HISTORY_TURNS", "MAX_IGNORED_LISTED", "MAX_LOGIT_BIAS", "MAX_LOGPROBS",
    "MAX_MESSAGES", "MAX_N", "MAX_PROMPTS", "MAX_STOP_CHARS", "MAX_STOP_STRINGS", "MAX_STOP_TOKEN_IDS",
    "MAX_TEMPLATE_CHARS", "MAX_TEMPLATE_KWARGS", "MAX_TEXT_PARTS", "MAX_TOOLS", "MAX_TOOL_CALLS", "MAX_TOP_K",
    "RESERVED_TEMPLATE_KWARGS", "SEED_RANGE", "TOOL_NAME", "ChatCompletionRequest", "ChatMessage",
    "CompletionRequest", "DetokenizeRequest", "FunctionCall", "FunctionName", "FunctionSpec", "InvalidValue",
    "JsonObjectFormat", "JsonSchemaFormat", "JsonSchemaSpec", "LegacyChatRequest", "LegacyInstructRequest",
    "NamedToolChoice", "ResponseFormat", "StreamOptions", "StructuredOutputs", "TextFormat", "TextPart",
    "TokenizeChatRequest", "TokenizeCompletionRequest", "TooMany", "Tool", "ToolCallItem", "UnsupportedValue",
    "unsigned_seed",
]
