"""Paged plans for engine checks and benchmarks that drive an `Engine` directly, without a scheduler: each prompt
prefilled into its slot on a fixed run of its dp group's pages, then decode passes in one plan.

The run of slot s is pages [r * max_pages_per_seq, (r + 1) * max_pages_per_seq) of its group's pool, r its index
in the group, so every slot can reach max_seq_len; prompts longer than a step's token budget are cut into
chunks, and chunks of several prompts share steps. No JAX here: the engine does the device work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from raydeploy.engine.step import PageUpdate, SamplingParams, SeqStep, StepPlan


def prefill_and_decode(engine: Any, prompts: Sequence[tuple[int, Sequence[int] | np.ndarray, SamplingParams]],
                       passes: int, step_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Run `prompts` (slot, prompt ids, sampling) then `passes` decode passes of all of them in one plan; tokens
    and logprobs [1 + passes, len(prompts)] (row 0: each prompt's first token). Plans are numbered from
    `step_id`. Release the slots (`StepPlan(.., release=...)`) before using them again."""
    per_slot, per_group = engine.max_pages_per_seq, engine.slots_per_group
    if engine.pages_per_group < per_group * per_slot:
        raise ValueError(f"fixed page runs need {per_group * per_slot} pages per dp group (every slot at "
                         f"max_seq_len); engine.num_pages gives {engine.pages_per_group}")
    tokens = [np.asarray(t, np.int32).reshape(-1) for _, t, _ in prompts]
    pages = tuple(PageUpdate(slot, 0, np.arange((slot % per_group) * per_slot, (slot % per_group + 1) * per_slot,
                                                dtype=np.int32)) for slot, _, _ in prompts)
    first_tok = np.zeros((1, len(prompts)), np.int32)
    first_lp = np.zeros((1, len(prompts)), np.float32)
    done = [0] * len(prompts)
    while any(d < len(t) for d, t in zip(done, tokens, strict=True)):
        budget = [engine.max_step_tokens] * engine.groups
        seqs, which = [], []
        for i, (slot, _, sampling) in enumerate(prompts):
            g = slot // per_group
            n = min(len(tokens[i]) - done[i], budget[g])
            if n <= 0:
                continue
            budget[g] -= n
            last = done[i] + n == len(tokens[i])
            seqs.append(SeqStep(slot, tokens[i][done[i]:done[i] + n], done[i], last,
                                sampling if done[i] == 0 else None))
            which.append((i, last))
            done[i] += n
        res = engine.step(StepPlan(step_id, seqs=tuple(seqs), pages=pages))
        pages, step_id = (), step_id + 1
        for j, (i, last) in enumerate(which):
            if last:
                first_tok[0, i], first_lp[0, i] = res.tokens[0, j], res.logprobs[0, j]
    if not passes:
        return first_tok, first_lp
    rows = tuple(SeqStep(slot, np.zeros(0, np.int32), len(tokens[i]), True) for i, (slot, _, _) in enumerate(prompts))
    res = engine.step(StepPlan(step_id, decode_steps=passes, seqs=rows))
    return np.concatenate([first_tok, res.tokens]), np.concatenate([first_lp, res.logprobs])
