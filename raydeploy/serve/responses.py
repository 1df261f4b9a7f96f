"""OpenAI-shaped response bodies and server-sent-event chunks, built from finished `Choice`s or `Piece`s.

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

from raydeploy.serve.generation import Choice, Piece
from raydeploy.serve.text import TextCodec

log = logging.getLogger("raydeploy.serve")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


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

    def __init__(self, response_id: str, model: str, codec: TextCodec, want_logprobs: bool) -> None:
        self.id, self.model, self.codec, self.want_logprobs = response_id, model, codec, want_logprobs
        self.created = int(time.time())

    def whole(self, choices: Sequence[Choice], prompt_tokens: int) -> dict[str, Any]:
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            lp = completion_logprobs(self.codec, c.token_ids, c.logprobs, 0, self.id) if self.want_logprobs else None
            out.append({"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": out, "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices))}

    def chunk(self, index: int, piece: Piece, include_usage: bool) -> dict[str, Any]:
        lp = None
        if self.want_logprobs and piece.token_id is not None:
            lp = completion_logprobs(self.codec, [piece.token_id], [piece.logprob], 0, self.id)
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": index, "text": piece.text, "logprobs": lp,
                             "finish_reason": piece.finish_reason}]}
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


class ChatBuilder:
    """Bodies of one /v1/chat/completions response (whole or streamed)."""

    def __init__(self, response_id: str, model: str, codec: TextCodec, want_logprobs: bool) -> None:
        self.id, self.model, self.codec, self.want_logprobs = response_id, model, codec, want_logprobs
        self.created = int(time.time())
        self._started: set[int] = set()

    def whole(self, choices: Sequence[Choice], prompt_tokens: int) -> dict[str, Any]:
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            lp = chat_logprobs(self.codec, c.token_ids, c.logprobs, self.id) if self.want_logprobs else None
            out.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": lp, "finish_reason": c.finish_reason})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": out, "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices))}

    def chunk(self, index: int, piece: Piece, include_usage: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if index not in self._started:
            self._started.add(index)
            delta["role"] = "assistant"
        if piece.text or "role" in delta:
            delta["content"] = piece.text
        lp = None
        if self.want_logprobs and piece.token_id is not None:
            lp = chat_logprobs(self.codec, [piece.token_id], [piece.logprob], self.id)
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": piece.finish_reason}]}
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
