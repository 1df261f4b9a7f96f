"""Continuous batching, host-agnostic: requests -> slots -> `StepPlan`s, and `StepResult`s -> `TokenEvent`s.

No JAX here. The local runner and the gang's coordinator (on rank 0) both drive the same loop:

    plan = scheduler.next_plan()        # None when idle
    result = <every host runs Engine.step(plan)>
    scheduler.on_result(plan, result)   # emits TokenEvents to each request's sink, frees finished slots

New requests join free slots between decode steps. A request's events: one per generated token
(`token_id` set, `index` 0, 1, ...); the last event carries `finish_reason`:
- "length": max_tokens or max_seq_len reached; that event still carries the last token.
- "stop": an eos / stop token was sampled; that event has `token_id=None` (stop tokens are not output). Or a
  constrained request's grammar ended: that event carries the grammar's last token.
- "abort" (after `abort`) and "error" (after `fail_all`, `step_failed` or `fail_step`, with `error` and
  `retriable`): `token_id=None`.
`submit`, `abort` and `fail_all` may be called from other threads; sinks are called outside the lock and must
not block (put into a queue).

One mixed step per plan over the engine's KV pages (`Paging`). Each dp group has a page pool
(`raydeploy.engine.pages`); a request gets a slot (a page-table row) in one group and is prefilled only there.
Every plan carries the decode rows of all running streams plus prompt chunks up to the group's token budget
(`max_step_tokens`, or the smaller `mixed_step_tokens` while streams decode), in arrival order, so a long prompt
never stalls running streams and many arriving prompts prefill together. A prompt whose full pages are in the
group's prefix cache starts after them with those pages shared in its table. Admission reserves every page a
request may need (prompt + max_tokens within max_seq_len), so a running request never runs out of pages: a
request waits in the queue (first come, first served) until its pages fit, and one that could never fit a whole
pool is refused at submit. Page-table changes travel in the plan (`StepPlan.pages`), so every host holds the
same tables. See docs/scheduling.md.

The parts: `records` (Paging, and what is kept per queued and running request), `admission` (what a request may
ask, its page reservation, QueueFullError), `placement` (which group's slot and pages a request takes), `pacing`
(the decode pace, the chunk hold-back and the burst wait, from measured step times, with injected clocks),
`constrained` (constrained requests' matchers and masks), `failures` (`fail_all`, `step_failed`, `fail_step`: a
mixin of `Scheduler`), `logprobs` (the prompt logprobs, alternatives and first-event extras that events carry) and
`planner` (`Scheduler`: the request lifecycle and the plans, over the others).

Structured outputs: a request with a constraint gets a matcher at submit (`raydeploy.constraints`, compiled by
the scheduler's `GrammarEngine` outside its lock; no engine, or a constraint that does not compile: `RequestFailed`,
invalid). Each of its sampling rows (its last prompt chunk, its decode rows) carries the packed allowed tokens of
its next draw (`SeqStep.allowed`), and a plan with such a row runs one pass (the next mask needs this token). The
matcher advances only when a token is emitted, so undoing a failed step leaves it where it was. A grammar that
allows no next token, or an emitted token it does not allow, ends the request with an error naming it.

Failures (docs/gang.md, "A step that fails for one request"): a request whose prompt holds a token id past the
model's vocabulary (`vocab_size`) is refused at submit with `RequestFailed`. A step whose engine raised
`RequestFailed` before any device work is undone with `step_failed`: the requests it names end with a
non-retriable error, every other request of the step is planned again exactly as it was (its chunk again, its
page-table row whole, its sampling again if that was its first chunk; the step's slot releases again), so it
produces the tokens it would have without the failed one. `fail_step` ends every request of a step the loop
could not attribute (non-retriable: it is not sent again).
"""

from raydeploy.engine.scheduler.admission import Admission, QueueFullError
from raydeploy.engine.scheduler.pacing import BURST_MAX_PASSES, DECODE_PASS_WINDOW, MAX_HOLD_PASSES, Pacing
from raydeploy.engine.scheduler.placement import Placement
from raydeploy.engine.scheduler.planner import Scheduler
from raydeploy.engine.scheduler.records import Paging, Sink

__all__ = ["BURST_MAX_PASSES", "DECODE_PASS_WINDOW", "MAX_HOLD_PASSES", "Admission", "Pacing", "Paging", "Placement",
           "QueueFullError", "Scheduler", "Sink"]
