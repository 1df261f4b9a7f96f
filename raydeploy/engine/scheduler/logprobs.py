"""What a request's events carry of logprobs, from a step's result: a prompt chunk's prompt logprobs gathered
over its chunks (`add_prompt_logprobs`), the first event's extras (`first_event`: cached prompt tokens, the prompt
logprobs) and a drawn token's alternatives (`alternatives`). Functions over a request's `Running` record, called
by `Scheduler` (`planner`) under its lock; no JAX here."""

from __future__ import annotations

import dataclasses

from raydeploy.engine.request import PromptTokenLogprob, TokenEvent
from raydeploy.engine.scheduler.records import Running
from raydeploy.engine.step import PromptLogprobs, SeqStep, StepResult


def add_prompt_logprobs(run: Running, seq: SeqStep, got: PromptLogprobs | None) -> str | None:
    """Add a computed chunk's prompt logprobs to `run`'s (each entry is the token after a place of the chunk);
    what went wrong if the engine returned none for it."""
    if run.prompt_logprobs is None or not seq.prompt_logprobs:
        return None
    if got is None:
        return f"its prompt chunk at position {seq.start} asked for prompt logprobs and the engine returned none"
    k = run.req.prompt_logprobs or 0
    prompt = run.req.prompt_token_ids
    for j in range(len(got.logprob)):
        tops = tuple((int(t), float(v)) for t, v in zip(got.top_ids[j, :k], got.top_logprobs[j, :k], strict=True))
        run.prompt_logprobs.append(PromptTokenLogprob(int(prompt[seq.start + j + 1]), float(got.logprob[j]),
                                                      int(got.rank[j]), tops))
    return None


def first_event(run: Running, event: TokenEvent) -> TokenEvent:
    """`event` with what a request's first event carries (cached prompt tokens, prompt logprobs), if it is
    the first."""
    if run.reported:
        return event
    run.reported = True
    return dataclasses.replace(event, cached_tokens=run.cached_tokens,
                               prompt_logprobs=None if run.prompt_logprobs is None else tuple(run.prompt_logprobs))


def alternatives(run: Running, result: StepResult, k: int, i: int) -> tuple[tuple[int, float], ...] | None:
    """Pass `k`'s alternatives of plan sequence `i`, cut to what `run` asked for (None when it asked for none)."""
    n = run.req.top_logprobs
    if not n or result.top_ids is None or result.top_logprobs is None:
        return None
    return tuple((int(t), float(v)) for t, v in zip(result.top_ids[k, i, :n], result.top_logprobs[k, i, :n],
                                                     strict=True))
