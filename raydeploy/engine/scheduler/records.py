"""What the scheduler keeps per request, and what it needs to know about the engine's pages (no JAX)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from raydeploy.constraints.matcher import Matcher
from raydeploy.engine.geometry import EngineGeometry
from raydeploy.engine.pages import SequencePages
from raydeploy.engine.request import GenerationRequest, PromptTokenLogprob, TokenEvent
from raydeploy.engine.speculative.policy import Acceptance

Sink = Callable[[TokenEvent], None]


@dataclass(frozen=True)
class Paging:
    """What the scheduler needs to know about the engine's KV pages and step sizes."""

    page_size: int
    """Tokens per page."""
    pages_per_group: int
    """Pages in each dp group's pool."""
    groups: int
    """dp groups; slot s belongs to group s // (max_slots // groups)."""
    max_step_tokens: int
    """Most tokens one step computes per dp group (prompt chunks plus one per decode row)."""
    prefix_caching: bool = True
    """Reuse cached full pages of matching prompt prefixes."""
    mixed_step_tokens: int | None = None
    """Most tokens per dp group in a step that carries decode rows (the engine's smaller step program), so
    running streams keep a short step while a long prompt is prefilled; None = max_step_tokens."""
    max_decode_slowdown: float = 0.0
    """While streams decode: hold a prompt's next chunk back for as many decode passes as keep their mean time
    per token within this factor of a decode pass, from measured step times (`engine.max_decode_slowdown`);
    0 = a chunk every step."""
    burst_wait: float = 0.0
    """A request that finds the engine idle waits this fraction of a measured decode pass for others arriving
    with it (`engine.burst_wait`); 0 = its step starts at once."""

    @classmethod
    def from_geometry(cls, geometry: EngineGeometry, prefix_caching: bool = True, max_decode_slowdown: float = 0.0,
                      burst_wait: float = 0.0) -> Paging:
        """The engine's pages and step sizes from its geometry (`raydeploy.engine.geometry`), with the config's
        prefix caching and pacing."""
        return cls(geometry.page_size, geometry.pages_per_group, geometry.groups, geometry.max_step_tokens,
                   prefix_caching, geometry.mixed_step_tokens, max_decode_slowdown, burst_wait)

    def check(self, max_slots: int) -> None:
        """Raise ValueError if these figures cannot serve `max_slots` slots."""
        if self.groups < 1 or max_slots % self.groups:
            raise ValueError(f"paging: max_slots {max_slots} does not divide over {self.groups} dp groups")
        per_group = max_slots // self.groups
        for name, tokens in (("max_step_tokens", self.max_step_tokens), ("mixed_step_tokens", self.mixed_step_tokens)):
            if tokens is not None and tokens < per_group:
                raise ValueError(f"paging: {name}={tokens} tokens per dp group in a step cannot hold a decode row for "
                                 f"each of the group's {per_group} slots (engine.prefill_chunk is too small)")


@dataclass
class Queued:
    req: GenerationRequest
    sink: Sink
    submitted_s: float
    keys: list[bytes] | None = None
    """The prompt's prefix keys, computed once."""
    matcher: Matcher | None = None
    """The request's constraint compiled at submit (structured outputs), at the start of its grammar."""
    allowed: np.ndarray | None = None
    """Its first draw's allowed tokens (packed), computed at submit with the matcher."""


@dataclass
class Running:
    req: GenerationRequest
    sink: Sink
    prompt_len: int
    submitted_s: float
    generated: int = 0
    first_token_s: float | None = None
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    pages: SequencePages | None = None
    tokens: list[int] = field(default_factory=list)
    """Prompt and emitted tokens (position i holds tokens[i])."""
    computed: int = 0
    """Positions whose K/V is in the slot's pages: prefill progress, then len(tokens) - 1 while decoding."""
    cap: int = 0
    """Positions this request's reservation covers."""
    started: bool = False
    """Its first chunk was planned (the engine has its sampling parameters)."""
    resend_row: bool = False
    """A step that carried it failed before the engine ran it: its next plan sends its page-table row whole."""
    matcher: Matcher | None = None
    """Its constraint's matcher (structured outputs): fills each sampling row's allowed tokens and follows the
    emitted tokens only (it advances when a token is emitted, never when one is planned)."""
    allowed: np.ndarray | None = None
    """Its next draw's allowed tokens (packed), computed before planning and outside the scheduler's lock
    (`constrained`); None until then, and again once a token is emitted."""
    cached_tokens: int = 0
    """Prompt tokens its first chunk found in the prefix cache (not computed); on its first event."""
    prompt_logprobs: list[PromptTokenLogprob | None] | None = None
    """With `req.prompt_logprobs`: the prompt tokens' logprobs gathered chunk by chunk (position 0's None first);
    on its first event."""
    reported: bool = False
    """Its first event went out (the one that carries `cached_tokens` and the prompt logprobs)."""
    acceptance: Acceptance = field(default_factory=Acceptance)
    """Its recent speculative acceptance and back-off (`raydeploy.engine.speculative.policy`)."""
