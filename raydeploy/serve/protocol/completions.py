"""The `/v1/completions` body: a prompt (a text, texts, token ids or lists of them) and the shared sampling
fields, with echo and logprobs."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from raydeploy.serve.protocol.common import MAX_LOGPROBS, MAX_PROMPTS, InvalidValue, TooMany, _unsupported
from raydeploy.serve.protocol.sampling import _SamplingFields


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
