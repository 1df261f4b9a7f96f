"""Admission: what a request may ask of this engine, and how many positions it reserves (no JAX).

A request is refused at submit (`RequestFailed`, `invalid`: HTTP 400) when it can never run here: an empty or too
long prompt, max_tokens below 1, a token id past the model's vocabulary, or more pages than a dp group's pool
holds. One that could run waits in the queue (`QueueFullError` when `serving.max_queue` requests already wait).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raydeploy.engine.request import GenerationRequest, RequestFailed
from raydeploy.engine.scheduler.records import Paging
from raydeploy.engine.step import MAX_TOP_LOGPROBS


class QueueFullError(RuntimeError):
    """The wait queue is full; the client should retry later (HTTP 503 + Retry-After)."""

    def __init__(self, queue_depth: int, max_queue: int) -> None:
        super().__init__(f"queue is full: {queue_depth} requests waiting (max_queue={max_queue}); retry later")
        self.queue_depth = queue_depth
        self.max_queue = max_queue

    def __reduce__(self):  # pickles across Ray intact
        return (QueueFullError, (self.queue_depth, self.max_queue))


@dataclass(frozen=True)
class Admission:
    """The limits a request is checked against, and its page reservation."""

    max_seq_len: int
    paging: Paging
    decode_steps: int = 1
    vocab_size: int | None = None
    """The model's vocabulary: a prompt token id at or past it is refused (None: not checked)."""

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt: at least one token must be generated within max_seq_len."""
        return self.max_seq_len - 1

    def reserve_for(self, prompt_len: int, max_tokens: int) -> int:
        """Positions a request may write: its prompt, all but its last generated token, and the positions a
        multi-step decode plan may run past a stop (within max_seq_len)."""
        return min(prompt_len + max_tokens - 1 + max(self.decode_steps - 1, 0), self.max_seq_len)

    def validate(self, req: GenerationRequest) -> None:
        """Raise `RequestFailed` (a ValueError; `invalid`: the request's content, HTTP 400) saying what is wrong with a
        request that can never run here."""
        def refuse(message: str) -> RequestFailed:
            return RequestFailed(f"request {req.request_id}: {message}", request_ids=(req.request_id,), invalid=True)

        n = len(req.prompt_token_ids)
        if n == 0:
            raise refuse("prompt is empty (prompt_token_ids has no tokens)")
        if n > self.max_prompt_len:
            raise refuse(f"prompt has {n} tokens, more than the {self.max_prompt_len} this engine accepts "
                         f"(max_seq_len {self.max_seq_len}, at least one token must be generated)")
        if req.max_tokens < 1:
            raise refuse(f"max_tokens must be >= 1, found {req.max_tokens}")
        for name, k in (("top_logprobs", req.top_logprobs), ("prompt_logprobs", req.prompt_logprobs)):
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise refuse(f"{name} must be between 0 and {MAX_TOP_LOGPROBS}, found {k}")
        if self.vocab_size is not None:
            ids = np.asarray(req.prompt_token_ids, np.int64)
            bad = ids[(ids < 0) | (ids >= self.vocab_size)]
            if bad.size:
                raise refuse(f"prompt token id {int(bad[0])} is outside the model's vocabulary (ids "
                             f"0..{self.vocab_size - 1}, vocab_size {self.vocab_size})")
        ps = self.paging.page_size
        need = -(-self.reserve_for(n, req.max_tokens) // ps)
        if need > self.paging.pages_per_group:
            raise refuse(f"needs up to {need} KV pages of {ps} tokens (prompt {n} + max_tokens {req.max_tokens}), "
                         f"more than the {self.paging.pages_per_group} pages of a dp group's pool "
                         f"(engine.num_pages); lower max_tokens or shorten the prompt")
