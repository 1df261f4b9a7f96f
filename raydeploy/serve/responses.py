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
from typing import Any

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


def completion_logprobs(codec: TextCodec, token_ids: Sequence[int], logprobs: Sequence[float | None],
                        start_offset: int = 0, response_id: str = "") -> dict[str, Any]:
    tokens = [codec.token_text(t) for t in token_ids]
    offsets, pos = [], start_offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": json_logprobs(logprobs, response_id), "top_logprobs": None,
            "text_offset": offsets}


def chat_logprobs(codec: TextCodec, token_ids: Sequence[int], logprobs: Sequence[float | None],
                  response_id: str = "") -> dict[str, Any]:
    content = []
    for t, lp in zip(token_ids, json_logprobs(logprobs, response_id), strict=False):
        text = codec.token_text(t)
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode("utf-8")), "top_logprobs": []})
    return {"content": content}


class CompletionBuilder:
    """Bodies of one /v1/completions response (whole or streamed)."""

    system_fingerprint: str | None = None
    """OpenAI's `system_fingerprint` on every body (the route sets it: `ServerInfo.fingerprint`)."""

    def __init__(self, response_id: str, model: str, codec: TextCodec, want_logprobs: bool) -> None:
        self.id, self.model, self.codec, self.want_logprobs = response_id, model, codec, want_logprobs
        self.created = int(time.time())

    def whole(self, choices: Sequence[Choice], prompt_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            lp = completion_logprobs(self.codec, c.token_ids, c.logprobs, 0, self.id) if self.want_logprobs else None
            out.append({"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": out, "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices), cached_tokens),
                "system_fingerprint": self.system_fingerprint}

    def chunk(self, index: int, piece: Piece, include_usage: bool) -> dict[str, Any]:
        lp = None
        if self.want_logprobs and piece.token_id is not None:
            lp = completion_logprobs(self.codec, [piece.token_id], [piece.logprob], 0, self.id)
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint,
                "choices": [{"index": index, "text": piece.text, "logprobs": lp,
                             "finish_reason": piece.finish_reason}]}
        if include_usage:
            body["usage"] = None
        return body

    def chunks(self, index: int, piece: Piece, include_usage: bool) -> list[dict[str, Any]]:
        """The chunks of one piece (always one here)."""
        return [self.chunk(index, piece, include_usage)]

    def usage_chunk(self, usage_now: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint, "choices": [], "usage": usage_now}


class ChatBuilder:
    """Bodies of one /v1/chat/completions response (whole or streamed). With a `chat` format the answer is split
    into content, reasoning and (when `tools`) tool calls; without one it is all content."""

    system_fingerprint: str | None = None
    """OpenAI's `system_fingerprint` on every body (the route sets it: `ServerInfo.fingerprint`)."""

    def __init__(self, response_id: str, model: str, codec: TextCodec, want_logprobs: bool,
                 chat: ChatFormat | None = None, tools: bool = False, prompt: str | None = None) -> None:
        self.id, self.model, self.codec, self.want_logprobs = response_id, model, codec, want_logprobs
        self.chat, self.tools = chat, tools
        self.prompt = prompt
        """The rendered prompt: whether its template opened a reasoning block the answer starts inside."""
        self.created = int(time.time())
        self._started: set[int] = set()
        self._streamers: dict[int, ChatStreamer] = {}

    def whole(self, choices: Sequence[Choice], prompt_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            lp = chat_logprobs(self.codec, c.token_ids, c.logprobs, self.id) if self.want_logprobs else None
            message, reason = self.message(c.text, c.finish_reason)
            out.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": reason})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": out, "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices), cached_tokens),
                "system_fingerprint": self.system_fingerprint}

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
        chunk, the finish_reason on the last."""
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
            return chat_logprobs(self.codec, [piece.token_id], [piece.logprob], self.id)
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
