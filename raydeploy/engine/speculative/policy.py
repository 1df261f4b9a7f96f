"""Which rows of a plan speculate (`SpeculationPolicy`), the per-request back-off (`Acceptance`) and the counters
that metrics read (`SpecCounters`). No JAX: rank 0's scheduler uses it while it plans.

A speculating row costs its plan the multi-pass decode (`engine.decode_steps`): it needs its emitted tokens
before its next proposal, so its plan runs one pass, as a constrained row's does. Two back-offs keep that cost
where it pays:
- per step: a plan whose dp group holds more than `max_rows` decode rows speculates for none of them (under load
  the step is bound by its batch, not by reading the weights, and the multi-pass plans keep their speed);
- per request: a request whose recent proposals were accepted at a rate below `min_acceptance` stops proposing
  for `PAUSE_PLANS` plans, then tries again with a fresh record.
And one that keeps the rows that pay speculating: a request whose last verified row had at least
`WARM_ACCEPTED` proposals accepted (it is copying) is *warm* for `RETRY_PLANS` plans in which its lookup finds
nothing; such a plan runs one pass instead of
`decode_steps`, so the lookup tries again after one token instead of several (a copy that resumes after a changed
word is caught at once). A warm row costs the per-plan cost of a one-pass plan, nothing when its plan had one
pass anyway.
Rows that cannot speculate exactly in this engine never do: constrained rows (their mask after a proposal needs
the grammar advanced past it), rows that report alternatives (`top_logprobs`), and rows still under their
min_tokens ban."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

ACCEPTANCE_WINDOW = 8
"""Verified rows of a request that its recent acceptance rate is measured over."""
MIN_RECORDED = 4
"""Verified rows a request needs before its rate can pause it."""
PAUSE_PLANS = 32
"""Plans a request with a low acceptance rate proposes nothing for."""
RETRY_PLANS = 4
"""One-pass plans a warm request may ask for while its lookup finds nothing, before its plans take `decode_steps`
passes again."""
WARM_ACCEPTED = 2
"""Accepted proposals of a verified row that make its request warm. One is what a common pair of words gives in
free text (the open-ended story of benchmarks/speculative.py), where one-pass plans cost without paying."""


@dataclass(frozen=True)
class SpeculationPolicy:
    """`engine.speculative` as the scheduler applies it (the method is not none)."""

    method: str
    num_tokens: int
    ngram_max: int
    ngram_min: int
    max_rows: int
    min_acceptance: float

    @classmethod
    def from_config(cls, spec: Any) -> SpeculationPolicy | None:
        """The policy of an `engine.speculative` section, None when its method is none; ValueError naming the
        field for a value out of range."""
        if spec.method == "none":
            return None
        if spec.method not in ("ngram", "draft"):
            raise ValueError(f"engine.speculative.method {spec.method} is unknown: use ngram (prompt lookup), draft "
                             f"(a draft model) or none")
        if spec.method == "draft" and not spec.draft_checkpoint:
            raise ValueError("engine.speculative.method draft needs engine.speculative.draft_checkpoint (the draft "
                             "model's checkpoint)")
        if spec.num_tokens < 1:
            raise ValueError(f"engine.speculative.num_tokens {spec.num_tokens} must be >= 1")
        if not 1 <= spec.ngram_min <= spec.ngram_max:
            raise ValueError(f"engine.speculative: ngram_min {spec.ngram_min} and ngram_max {spec.ngram_max} need "
                             f"1 <= ngram_min <= ngram_max")
        if spec.max_rows < 1:
            raise ValueError(f"engine.speculative.max_rows {spec.max_rows} must be >= 1")
        if not 0.0 <= spec.min_acceptance <= 1.0:
            raise ValueError(f"engine.speculative.min_acceptance {spec.min_acceptance} is outside [0, 1]")
        return cls(spec.method, spec.num_tokens, spec.ngram_max, spec.ngram_min, spec.max_rows, spec.min_acceptance)


@dataclass
class Acceptance:
    """One request's recent verified rows (proposed, accepted) and the plan it may propose again from."""

    recent: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=ACCEPTANCE_WINDOW))
    paused_until: int = 0
    warm: int = 0
    """One-pass plans left to this request while its lookup finds nothing (`RETRY_PLANS` after a row with
    `WARM_ACCEPTED` accepted proposals)."""

    def allows(self, step_id: int) -> bool:
        return step_id >= self.paused_until

    def retry(self) -> bool:
        """Whether a plan in which this request found no proposal should run one pass (and use one of them)."""
        if self.warm <= 0:
            return False
        self.warm -= 1
        return True

    def note(self, proposed: int, accepted: int, step_id: int, min_acceptance: float) -> None:
        """Record a verified row; a low recent rate pauses the request for `PAUSE_PLANS` plans."""
        self.recent.append((proposed, accepted))
        self.warm = RETRY_PLANS if accepted >= WARM_ACCEPTED else 0
        if len(self.recent) < MIN_RECORDED:
            return
        total = sum(p for p, _ in self.recent)
        if total and sum(a for _, a in self.recent) / total < min_acceptance:
            self.paused_until = step_id + PAUSE_PLANS
            self.recent.clear()


@dataclass
class SpecCounters:
    """Monotonic counters of verified rows, in vLLM's terms: a draft is one row's proposals in one step."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    """accepted_per_pos[j]: drafts whose proposal j (0-based) was accepted."""
    backoff_steps: int = 0
    """Plans with speculating requests that did not speculate because a group held more than max_rows decode rows."""

    def note(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.extend([0] * (proposed - len(self.accepted_per_pos)))
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    def stats(self) -> dict[str, Any]:
        """The counters with the acceptance rate and the mean accepted length (tokens emitted per verified row:
        the accepted proposals and the one drawn after them), None before any draft."""
        return {"spec_decode_num_drafts": self.drafts, "spec_decode_num_draft_tokens": self.draft_tokens,
                "spec_decode_num_accepted_tokens": self.accepted_tokens,
                "spec_decode_accepted_per_pos": list(self.accepted_per_pos),
                "spec_decode_backoff_steps": self.backoff_steps,
                "spec_decode_acceptance_rate": (self.accepted_tokens / self.draft_tokens if self.draft_tokens
                                                else None),
                "spec_decode_mean_accepted_length": (1 + self.accepted_tokens / self.drafts if self.drafts
                                                     else None)}
