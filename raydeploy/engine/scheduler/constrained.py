"""The scheduler's constrained requests (structured outputs): a request's grammar compiled at submit, the allowed
tokens of each of its draws, and each emitted token checked against them.

Masks are the costly part (up to a few milliseconds a row at a 128k vocabulary), so none is computed under the
scheduler's lock, where `submit` and `abort` from other threads would wait on it:
- a request's first draw (the last chunk of its prompt, at the start of its grammar) gets its mask at submit,
  in the caller's thread, beside its compile (the matcher is not shared yet);
- the step loop fills the masks of the running constrained streams that draw next in one batch on llguidance's
  thread pool (`GrammarEngine.fill`), with the lock released, just before it plans (`Scheduler.next_plan`).
Planning then only reads `Running.allowed`. Only the step loop's thread touches a running request's matcher
(filling, accepting); other threads only take requests out, so a request aborted while its mask is filled is
simply not planned. A mask stays valid until its request emits a token (`accept` drops it), so a step that fails
and is planned again carries the same mask. No JAX here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from raydeploy.constraints.grammar import ConstraintError
from raydeploy.constraints.matcher import GrammarEngine, Matcher, words_for
from raydeploy.engine.request import GenerationRequest, RequestFailed
from raydeploy.engine.scheduler.records import Running


class ConstrainedDraws:
    """Compiles constrained requests and keeps their masks for `grammar` (None: a constrained request is
    refused). Counts the masks filled and the time spent filling them, whichever thread filled them."""

    def __init__(self, grammar: GrammarEngine | None) -> None:
        self.grammar = grammar
        self.masks = 0
        """Allowed-token masks computed (one per draw of a constrained request)."""
        self.mask_s = 0.0
        """Seconds spent computing them (at submit in callers' threads, then before each plan in the step loop's,
        never under the scheduler's lock)."""
        self.shared_passes = False
        """Whether a decode plan that mixes constrained and unconstrained rows runs `decode_steps` passes, its
        constrained rows drawing in the first pass only (`SeqStep.first_pass_only`), instead of one pass for all.
        Off: measured on CPU, a pass costs what its rows cost, so the later passes (of the same program, the
        constrained rows' places padding) cost as much as full ones while the constrained rows wait a whole plan
        for each token (docs/structured-outputs.md, benchmarks/structured_decode.py). A deployment whose
        per-plan costs (the plan's broadcast, the tokens' readback) outweigh a pass gains from it."""
        self._counts = threading.Lock()

    def compile(self, req: GenerationRequest) -> tuple[Matcher, np.ndarray]:
        """`req`'s matcher at the start of its grammar and the mask of its first draw, in the caller's thread;
        `RequestFailed` (invalid: HTTP 400) when the constraint does not compile or there is no grammar engine."""
        c = req.constraint
        assert c is not None
        rid = req.request_id
        if self.grammar is None:
            raise RequestFailed(f"request {rid}: structured output ({c.kind} constraint) is not available: this "
                                f"engine has no grammar engine", request_ids=(rid,), invalid=True)
        try:
            matcher = self.grammar.matcher(c)
        except ConstraintError as e:
            raise RequestFailed(f"request {rid}: {e}", request_ids=(rid,), invalid=True) from None
        t0 = time.perf_counter()
        first = matcher.mask()
        self._count(1, time.perf_counter() - t0)
        return matcher, first

    def fill(self, runs: Sequence[Running]) -> None:
        """Set `allowed` of each run that has a matcher and no mask yet, all in one batch. The step loop's thread
        only, without the scheduler's lock (the runs' matchers are the loop's alone)."""
        runs = [r for r in runs if r.matcher is not None and r.allowed is None]
        if not runs:
            return
        assert self.grammar is not None  # a matcher comes from it
        t0 = time.perf_counter()
        words = np.empty((len(runs), words_for(self.grammar.vocab_size)), np.uint32)
        self.grammar.fill([r.matcher for r in runs if r.matcher is not None], words)
        for run, row in zip(runs, words, strict=True):
            run.allowed = row
        self._count(len(runs), time.perf_counter() - t0)

    def refusal(self, run: Running) -> tuple[str, bool] | None:
        """Why constrained `run` cannot draw next (its grammar allows no token: the error message and whether the
        request is at fault), or None when it can (`run.allowed` holds its mask). A run whose mask was not filled
        ahead gets it here, under the caller's lock (planning met a draw `fill` was not given: not expected)."""
        assert run.matcher is not None
        if run.allowed is None:
            self.fill([run])
        assert run.allowed is not None
        if run.allowed.any():
            return None
        kind = run.req.constraint.kind if run.req.constraint is not None else "grammar"
        why = run.matcher.error or "no token of the vocabulary can continue the output"
        return (f"its {kind} constraint allows no next token after {run.generated} generated: {why}",
                run.matcher.error is None)

    @staticmethod
    def accept(run: Running, token: int) -> str | None:
        """Advance constrained `run`'s matcher past emitted `token` (its mask is spent); the error message when
        its grammar does not allow the token (an engine that ignored the mask: not the request's fault)."""
        assert run.matcher is not None
        run.allowed = None
        if run.matcher.accept(token):
            return None
        kind = run.req.constraint.kind if run.req.constraint is not None else "grammar"
        return (f"token {token} (output position {run.generated}) is not allowed by its {kind} constraint: "
                f"{run.matcher.error}")

    @staticmethod
    def ended(run: Running) -> bool:
        """Whether `run`'s grammar has ended (its last token was just accepted)."""
        return run.matcher is not None and run.matcher.done

    def _count(self, masks: int, seconds: float) -> None:
        with self._counts:
            self.masks += masks
            self.mask_s += seconds
