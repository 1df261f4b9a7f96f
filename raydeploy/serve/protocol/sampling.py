"""The fields `/v1/completions` and `/v1/chat/completions` share (`_SamplingFields`): OpenAI's sampling and
streaming fields, vLLM's extensions (top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos,
include_stop_str_in_output, skip_special_tokens, `structured_outputs`, ...), the ones accepted and ignored, and
vLLM's that are refused unless left at their default (beam search, truncation, ...)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from raydeploy.serve.protocol.common import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_K,
    SEED_RANGE,
    InvalidValue,
    _at_most,
    _NullIsDefault,
    _unsupported,
    unsigned_seed,
)
from raydeploy.serve.protocol.formats import ResponseFormat, StructuredOutputs


class StreamOptions(_NullIsDefault):
    include_usage: bool = False
    """A last chunk with the usage of the whole request."""
    continuous_usage_stats: bool = False
    """Extension (vLLM): the usage so far on every chunk."""


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

