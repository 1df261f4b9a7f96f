"""A generation request as the scheduler sees it, and the events it streams back.

These cross Ray (HTTP ingress -> coordinator actor) so they are plain picklable dataclasses; the HTTP layer
turns OpenAI / legacy JSON into a `GenerationRequest` and `TokenEvent`s back into JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from raydeploy.engine.step import SamplingParams

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop ids; the model's eos ids always stop (unless ignore_eos)."""
    ignore_eos: bool = False


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of one request, or its end. `finish_reason` is set on the last event only."""

    request_id: str
    token_id: int | None
    logprob: float | None = None
    index: int = 0
    """Position of this token among the request's generated tokens (0-based)."""
    finish_reason: FinishReason | None = None
    error: str | None = None
    """Set with finish_reason 'error': what failed (retriable gang failures say so)."""
    retriable: bool = False
