"""A generation request as the scheduler sees it, the events it streams back, and the error that fails one
request without failing the others beside it.

These cross Ray (HTTP ingress -> coordinator actor) so they are plain picklable dataclasses; the HTTP layer
turns OpenAI / legacy JSON into a `GenerationRequest` and `TokenEvent`s back into JSON.

`RequestFailed` is how a failure is followed to the request that caused it. The scheduler raises it at submit
(a token id past the model's vocabulary: the request is refused, nothing else happens); an engine raises it
from `step` naming plan rows (`slots`) when a check of the plan's inputs fails before any device work of that
step. Every host runs the same plan through the same checks, so every host raises it at the same point,
skips that step's device work and stays in lockstep; the step loop on rank 0 then fails just those requests
(a non-retriable error event naming the request and the reason) and plans the others again
(raydeploy.engine.local.StepLoop, raydeploy.engine.scheduler.Scheduler.step_failed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from raydeploy.constraints.spec import Constraint
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
    constraint: Constraint | None = None
    """Structured output: what the generated text must match (`raydeploy.constraints`); rank 0's scheduler
    keeps a matcher for it and masks each draw."""
    top_logprobs: int = 0
    """Alternatives per generated token (0..`MAX_TOP_LOGPROBS`): its events carry that many of the most likely
    tokens of the distribution the token's logprob is under (the raw model's, `raydeploy.engine.logprobs`)."""
    prompt_logprobs: int | None = None
    """None: no prompt logprobs. k >= 0: the first event carries every prompt token's logprob with k alternatives;
    the request then computes its whole prompt (no prefix-cache reuse: cached pages hold no logits)."""
    report_stop: bool = False
    """The stop token that ends the request (eos, a stop id) comes back on the final event with its logprob (and
    alternatives), as OpenAI's and vLLM's logprobs count it; otherwise the final event carries no token."""
    adapter: str | None = None
    """The LoRA adapter the request runs under (`model: <adapter name>`, `raydeploy.lora`); None: the base model.
    Rank 0 resolves it when the request is submitted: `adapter_slot` (the device slot its every token uses) and
    `adapter_key` (what its prefix-cache pages are keyed under, so no page is shared across adapters)."""
    adapter_slot: int = -1
    adapter_key: str = ""


@dataclass(frozen=True)
class PromptTokenLogprob:
    """One prompt token's logprob under the raw model distribution at the place before it, its rank there (1 = the
    most likely), and the most likely tokens there (`top`: (token id, logprob), descending)."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


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
    """A gang failure the request had no part in (a host died): another gang may run it again."""
    invalid: bool = False
    """With finish_reason 'error': the request's own content is what failed (HTTP 400), not the server (500)."""
    refused: bool = False
    """With a retriable error: the gang never took the request (it was not ready, or refused it at submit), so
    sending it to another gang costs nothing; otherwise its gang broke while holding it (the ingress resends such
    a request once at most)."""
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    """With a token of a request that asked for alternatives (`GenerationRequest.top_logprobs`): (token id,
    logprob) of the most likely tokens, descending (a greedy draw's token first)."""
    prompt_logprobs: tuple[PromptTokenLogprob | None, ...] | None = None
    """On a request's first event, when it asked (`GenerationRequest.prompt_logprobs`): one entry per prompt
    token, None for the first (nothing precedes it)."""
    cached_tokens: int | None = None
    """On a request's first event: prompt tokens served from the prefix cache (not computed)."""


class RequestFailed(ValueError):
    """A failure that belongs to some requests only: they end with a non-retriable error, the others go on.

    Raised by an engine's `step` naming plan rows (`slots`; the step loop maps them to requests), or by the
    scheduler naming `request_ids`, always before any device work of the step, deterministically given the plan
    (so every host of a gang raises it alike). `invalid`: the request's content is at fault (a token id past
    the vocabulary): HTTP 400 rather than 500. A ValueError, so callers that refuse bad requests by ValueError
    keep doing so; it pickles intact across Ray."""

    def __init__(self, message: str, *, slots: tuple[int, ...] = (), request_ids: tuple[str, ...] = (),
                 invalid: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.slots = tuple(int(s) for s in slots)
        self.request_ids = tuple(str(r) for r in request_ids)
        self.invalid = invalid

    def __reduce__(self):  # pickles across Ray intact
        return (_rebuild_request_failed, (self.message, self.slots, self.request_ids, self.invalid))


def _rebuild_request_failed(message: str, slots: tuple[int, ...], request_ids: tuple[str, ...],
                            invalid: bool) -> RequestFailed:
    return RequestFailed(message, slots=slots, request_ids=request_ids, invalid=invalid)
