"""OpenAI-shaped response bodies and server-sent-event chunks, built from finished `Choice`s or `Piece`s.

A chat answer is split by the deployment's `ChatFormat` into content, reasoning (`reasoning_content`, vLLM's
field) and tool calls (`tool_calls`, with finish_reason "tool_calls" when there are any); streamed, each choice
has its own `ChatStreamer`, and its deltas become OpenAI's chunks: the role first, then content, reasoning or
a call's index, id and name, then that call's argument fragments.

A log-probability that is not a finite number (NaN from a broken step, -inf) has no JSON form: it is written
as null, with a warning in the log, so neither a whole answer (a 500 from the JSON encoder) nor a stream (a
bare `NaN`, invalid JSON) breaks on it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raydeploy.engine.request import PromptTokenLogprob
from raydeploy.serve.chat import ChatFormat, ChatStreamer, Delta, ToolCall
from raydeploy.serve.generation import Choice, Piece
from raydeploy.serve.text import TextCodec

log = logging.getLogger("raydeploy.serve")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: prompt tokens the prefix cache already held (0 when none)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": min(cached_tokens, prompt_tokens)}}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def json_logprobs(logprobs: Sequence[float | None], response_id: str = "") -> list[float | None]:
    """`logprobs` as JSON can hold them: each one that is not a finite number becomes None (logged)."""
    out = [None if lp is None or not math.isfinite(lp) else float(lp) for lp in logprobs]
    bad = sum(lp is not None for lp in logprobs) - sum(lp is not None for lp in out)
    if bad:
        log.warning("response %s: %d log-probabilities were not finite numbers (NaN or infinite); written as null",
                    response_id or "?", bad)
    return out


Alternatives = tuple[tuple[int, float], ...]
"""A token's most likely alternatives: (token id, logprob), descending (`TokenEvent.top_logprobs`)."""


def completion_logprobs(codec: TextCodec, token_ids: Sequence[int], logprobs: Sequence[float | None],
                        start_offset: int = 0, response_id: str = "",
                        tops: Sequence[Alternatives | None] | None = None, top: int = 0) -> dict[str, Any]:
    """The completions `logprobs` object. With `top` (the request's `logprobs` N > 0) each token's `top_logprobs`
    entry maps the texts of its N most likely tokens, and its own, to their logprobs (OpenAI: up to N + 1 entries);
    a token without a logprob (an echoed prompt's first) has null there."""
    tokens = [codec.token_text(t) for t in token_ids]
    offsets, pos = [], start_offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    lps = json_logprobs(logprobs, response_id)
    top_lps = None
    if top > 0:
        top_lps = [None if lp is None else _top_map(codec, t, lp, (tops or [None] * len(lps))[i], top)
                   for i, (t, lp) in enumerate(zip(token_ids, lps, strict=True))]
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_lps, "text_offset": offsets}


def _finite(lp: float) -> float | None:
    return float(lp) if math.isfinite(lp) else None


def _top_map(codec: TextCodec, token: int, logprob: float, alts: Alternatives | None, top: int) -> dict[str, Any]:
    out = {codec.token_text(t): _finite(v) for t, v in (alts or ())[:top]}
    out.setdefault(codec.token_text(token), logprob)
    return out


def chat_logprobs(codec: TextCodec, token_ids: Sequence[int], logprobs: Sequence[float | None],
                  response_id: str = "", tops: Sequence[Alternatives | None] | None = None,
                  top: int = 0) -> dict[str, Any]:
    """The chat `logprobs` object: per token its text, logprob, UTF-8 bytes and `top` alternatives alike."""
    content = []
    for i, (t, lp) in enumerate(zip(token_ids, json_logprobs(logprobs, response_id), strict=False)):
        alts = (tops[i] if tops is not None and i < len(tops) else None) or ()
        content.append({**_chat_token(codec, t, lp),
                        "top_logprobs": [_chat_token(codec, a, _finite(v)) for a, v in alts[:top]]})
    return {"content": content}


def _chat_token(codec: TextCodec, token: int, logprob: float | None) -> dict[str, Any]:
    text = codec.token_text(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def prompt_logprobs_json(codec: TextCodec, entries: Sequence[PromptTokenLogprob | None] | None, top: int
                         ) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), a map from token id to its logprob, rank
    (1 = most likely) and text: the token itself and its `top` most likely alternatives."""
    if entries is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        one = {str(e.token_id): {"logprob": _finite(e.logprob), "rank": e.rank,
                                 "decoded_token": codec.token_text(e.token_id)}}
        for rank, (t, v) in enumerate(e.top[:top], start=1):
            one.setdefault(str(t), {"logprob": _finite(v), "rank": rank, "decoded_token": codec.token_text(t)})
        out.append(one)
    return out


@dataclass(frozen=True)
class Echo:
    """A completions request's `echo`: each prompt's text and ids (choice i echoes prompt i // n)."""

    prompts: tuple[tuple[str, tuple[int, ...]], ...]
    n: int = 1

    def prompt(self, index: int) -> tuple[str, tuple[int, ...]]:
        return self.prompts[index // self.n]


class CompletionBuilder:
    """Bodies of one /v1/completions response (whole or streamed)."""

    system_fingerprint: str | None = None
    """OpenAI's `system_fingerprint` on every body (the route sets it: `ServerInfo.fingerprint`)."""

    def __init__(self, response_id: str, model: str, codec: TextCodec, want_logprobs: bool, *, top_logprobs: int = 0,
                 echo: Echo | None = None, prompt_logprobs: int | None = None) -> None:
        self.id, self.model, self.codec, self.want_logprobs = response_id, model, codec, want_logprobs
        self.top = top_logprobs
        """The request's `logprobs` N: alternatives per token in `top_logprobs` (0: that field is null)."""
        self.echo = echo
        """`echo`: each choice's text and logprobs start with its prompt's (the prompt's first token: null)."""
        self.prompt_logprobs = prompt_logprobs
        """vLLM's `prompt_logprobs` k: each choice carries its prompt's tokens' logprobs with k alternatives."""
        self.created = int(time.time())
        self._first: set[int] = set()

    def whole(self, choices: Sequence[Choice], prompt_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            text, lp = c.text, None
            if self.want_logprobs:
                start = 0 if self.echo is None else len(self.echo.prompt(c.index)[0])
                lp = completion_logprobs(self.codec, c.token_ids, c.logprobs, start, self.id, c.top_logprobs, self.top)
            if self.echo is not None:
                text = self.echo.prompt(c.index)[0] + text
                if lp is not None:
                    lp = _joined(self._echo_logprobs(c.index, c.prompt_logprobs), lp)
            choice = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
            if self.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(self.codec, c.prompt_logprobs, self.prompt_logprobs)
            out.append(choice)
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": out, "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices), cached_tokens),
                "system_fingerprint": self.system_fingerprint}

    def _echo_logprobs(self, index: int, entries: Sequence[PromptTokenLogprob | None] | None) -> dict[str, Any]:
        """The `logprobs` of choice `index`'s echoed prompt (its first token's logprob null)."""
        assert self.echo is not None
        ids = self.echo.prompt(index)[1]
        got = list(entries or [])
        if len(got) != len(ids):  # the gang sent no prompt logprobs (it was not asked): nulls, not a wrong answer
            got = [None] * len(ids)
        return completion_logprobs(self.codec, ids, [None if e is None else e.logprob for e in got], 0, self.id,
                                   [None if e is None else e.top for e in got], self.top)

    def chunk(self, index: int, piece: Piece, include_usage: bool) -> dict[str, Any]:
        lp = None
        start = 0 if self.echo is None else len(self.echo.prompt(index)[0])
        if self.want_logprobs and piece.token_id is not None:
            lp = completion_logprobs(self.codec, [piece.token_id], [piece.logprob], start, self.id,
                                     [piece.top_logprobs], self.top)
        return self._body(index, piece.text, lp, piece.finish_reason, include_usage)

    def _body(self, index: int, text: str, lp: dict[str, Any] | None, finish_reason: str | None,
              include_usage: bool, **extra: Any) -> dict[str, Any]:
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint,
                "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason, **extra}]}
        if include_usage:
            body["usage"] = None
        return body

    def chunks(self, index: int, piece: Piece, include_usage: bool) -> list[dict[str, Any]]:
        """The chunks of one piece: one, after (on a choice's first piece) a chunk of its echoed prompt (text and
        logprobs) when the request asked for `echo`, which also carries vLLM's `prompt_logprobs` when asked."""
        out = []
        if index not in self._first:
            self._first.add(index)
            extra = {} if self.prompt_logprobs is None else {
                "prompt_logprobs": prompt_logprobs_json(self.codec, piece.prompt_logprobs, self.prompt_logprobs)}
            if self.echo is not None:
                lp = self._echo_logprobs(index, piece.prompt_logprobs) if self.want_logprobs else None
                out.append(self._body(index, self.echo.prompt(index)[0], lp, None, include_usage, **extra))
            elif extra:
                body = self.chunk(index, piece, include_usage)
                body["choices"][0].update(extra)
                return [body]
        return [*out, self.chunk(index, piece, include_usage)]

    def usage_chunk(self, usage_now: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint, "choices": [], "usage": usage_now}


class ChatBuilder:
    """Bodies of one /v1/chat/completions response (whole or streamed). With a `chat` format the answer is split
    into content, reasoning and (when `tools`) tool calls; without one it is all content."""

    system_fingerprint: str | None = None
    """OpenAI's `system_fingerprint` on every body (the route sets it: `ServerInfo.fingerprint`)."""

    def __init__(self, response_id: str, model: str, codec: TextCodec, want_logprobs: bool,
                 chat: ChatFormat | None = None, tools: bool = False, prompt: str | None = None, *,
                 top_logprobs: int = 0, prompt_logprobs: int | None = None) -> None:
        self.id, self.model, self.codec, self.want_logprobs = response_id, model, codec, want_logprobs
        self.top = top_logprobs
        """Alternatives per token (`top_logprobs`)."""
        self.prompt_logprobs = prompt_logprobs
        """vLLM's `prompt_logprobs` k: the response (a stream: its first chunk) carries the prompt's logprobs."""
        self.chat, self.tools = chat, tools
        self.prompt = prompt
        """The rendered prompt: whether its template opened a reasoning block the answer starts inside."""
        self.created = int(time.time())
        self._started: set[int] = set()
        self._streamers: dict[int, ChatStreamer] = {}

    def whole(self, choices: Sequence[Choice], prompt_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            lp = (chat_logprobs(self.codec, c.token_ids, c.logprobs, self.id, c.top_logprobs, self.top)
                  if self.want_logprobs else None)
            message, reason = self.message(c.text, c.finish_reason)
            out.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": reason})
        body = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": out, "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices), cached_tokens),
                "system_fingerprint": self.system_fingerprint}
        if self.prompt_logprobs is not None:  # vLLM: one prompt, on the response
            body["prompt_logprobs"] = prompt_logprobs_json(self.codec, choices[0].prompt_logprobs if choices else None,
                                                           self.prompt_logprobs)
        return body

    def message(self, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
        """The assistant message of a finished answer, and its finish_reason ("tool_calls" when it called)."""
        if self.chat is None:
            return {"role": "assistant", "content": text}, finish_reason
        parsed = self.chat.parse(text, self.tools, prompt=self.prompt)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning_content is not None:
            message["reasoning_content"] = parsed.reasoning_content
        if parsed.tool_calls:
            message["tool_calls"] = [_tool_call(call) for call in parsed.tool_calls]
            finish_reason = "tool_calls"
        return message, finish_reason

    def chunk(self, index: int, piece: Piece, include_usage: bool) -> dict[str, Any]:
        """One piece as one chunk, all of its text content (the answer not split)."""
        delta: dict[str, Any] = {}
        if index not in self._started:
            self._started.add(index)
            delta["role"] = "assistant"
        if piece.text or "role" in delta:
            delta["content"] = piece.text
        return self._body(index, delta, self._piece_logprobs(piece), piece.finish_reason, include_usage)

    def chunks(self, index: int, piece: Piece, include_usage: bool) -> list[dict[str, Any]]:
        """The chunks of one piece: one per delta its text completes (none held back: one chunk with an empty
        delta, which still carries the token's logprob and the end). The piece's logprob goes on the first
        chunk, the finish_reason on the last; a choice's first chunk carries vLLM's `prompt_logprobs` when asked."""
        first = index not in self._started
        bodies = self._chunks(index, piece, include_usage)
        if first and self.prompt_logprobs is not None:
            bodies[0]["prompt_logprobs"] = prompt_logprobs_json(self.codec, piece.prompt_logprobs, self.prompt_logprobs)
        return bodies

    def _chunks(self, index: int, piece: Piece, include_usage: bool) -> list[dict[str, Any]]:
        if self.chat is None:
            return [self.chunk(index, piece, include_usage)]
        streamer = self._streamers.get(index)
        if streamer is None:
            streamer = self._streamers[index] = self.chat.streamer(self.tools, prompt=self.prompt)
        deltas = streamer.feed(piece.text) if piece.text else []
        reason = piece.finish_reason
        if reason is not None:
            deltas += streamer.finish()
            if streamer.called:
                reason = "tool_calls"
        fields = [_delta_fields(d) for d in deltas] or [{}]
        if index not in self._started:
            self._started.add(index)
            fields[0] = {"role": "assistant", **fields[0]}
            if len(fields[0]) == 1:
                fields[0]["content"] = ""
        lp = self._piece_logprobs(piece)
        last = len(fields) - 1
        return [self._body(index, f, lp if i == 0 else None, reason if i == last else None, include_usage)
                for i, f in enumerate(fields)]

    def _piece_logprobs(self, piece: Piece) -> dict[str, Any] | None:
        if self.want_logprobs and piece.token_id is not None:
            return chat_logprobs(self.codec, [piece.token_id], [piece.logprob], self.id, [piece.top_logprobs], self.top)
        return None

    def _body(self, index: int, delta: dict[str, Any], lp: dict[str, Any] | None, finish_reason: str | None,
              include_usage: bool) -> dict[str, Any]:
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint,
                "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}]}
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage_now: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint, "choices": [], "usage": usage_now}


def _joined(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two completions `logprobs` objects as one (an echoed prompt's, then the answer's)."""
    return {k: None if a[k] is None and b[k] is None else [*(a[k] or [None] * len(a["tokens"])),
                                                          *(b[k] or [None] * len(b["tokens"]))] for k in a}


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _delta_fields(d: Delta) -> dict[str, Any]:
    """One streaming delta in OpenAI's shape: a call's first delta has its index, id, type and name with empty
    arguments; its later ones only the index and an argument fragment."""
    if d.tool_call is not None:
        tc = d.tool_call
        call: dict[str, Any] = {"index": tc.index}
        if tc.id is not None:
            call.update(id=tc.id, type="function", function={"name": tc.name, "arguments": tc.arguments})
        else:
            call["function"] = {"arguments": tc.arguments}
        return {"tool_calls": [call]}
    if d.reasoning_content is not None:
        return {"reasoning_content": d.reasoning_content}
    return {"content": d.content or ""}
