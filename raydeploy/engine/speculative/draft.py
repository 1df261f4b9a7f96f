"""The `draft` method: a small model of the same tokenizer proposes k tokens per speculating row
(`Drafter`), on the same mesh as the target, inside the engine's step on every host.

The draft is a second paged engine (`raydeploy.engine.engine.Engine`: its own weights, placed by the same rules,
its own KV pool, its own programs) whose page table IS the target's (`PageTables.table`, one array): a token's
position maps to the same page and offset in both pools. So the scheduler's page bookkeeping serves both models
unchanged: rollback (`SequencePages.shrink`) gives back a page of both pools at once, and a page the prefix cache
hands to another request is a page of both pools.

What the draft has not seen is caught up lazily, when a row next speculates. The engine tells the `Drafter`
every token it computes or draws (`observe`: prompt chunks, the prefix a first chunk reuses, sampled and emitted
tokens), and the `Drafter` keeps, per slot, the sequence's tokens and how many positions its own pool holds
(`seen`). A speculating row's proposals (`propose`) are then:
1. catch-up: the positions from `seen` through the row's last token, as prompt chunks of the draft engine (chunks
   of at most `engine.prefill_chunk` tokens per dp group: a long prompt takes several draft steps, each program
   of the target's token buckets), the last chunk drawing p_1 greedily;
2. k - 1 greedy single-token passes of the draft engine (one multi-pass plan, no host round trip between them),
   p_2 .. p_k.
A request starting in a slot starts its draft over from position 0, so the draft rewrites its K/V of the prefix
pages it reuses (pages another request cached: that request may never have speculated, so the draft's pool may
not hold that prefix). After verification the draft's K/V stay valid through the accepted proposals it wrote.

The proposals never decide an output token (every emitted token is the target's own draw, `verify`): the
draft's K/V only decide how many proposals are accepted. Greedy proposals are deterministic given the sequence, so
the acceptance rule of the ngram method holds as it is (docs/speculative.md).

Every host runs the same draft programs over the same host state (the plans are the same), and reads their
replicated results, so every host verifies the same proposals: the plan from rank 0 carries a placeholder
(`DRAFT_PLACEHOLDER`) for each proposal, replaced on every host before the verify program runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from raydeploy.engine.step import SamplingParams, SeqStep, StepPlan, StepResult

DRAFT_PLACEHOLDER = 0
"""What a speculating row of a plan carries in place of each proposal under the draft method (a valid token id,
so the plan passes the engine's checks): every host's engine replaces it with the draft's proposal."""

GREEDY = SamplingParams()
"""The draft's sampling: greedy (temperature 0), no penalty."""


def check_vocab(target_vocab: int, draft_vocab: int, draft_checkpoint: str) -> None:
    """ValueError naming both sizes when the draft's vocabulary is not the target's (its proposals would be ids of
    another tokenizer)."""
    if int(target_vocab) != int(draft_vocab):
        raise ValueError(f"engine.speculative.draft_checkpoint {draft_checkpoint}: the draft model's vocab_size "
                         f"{draft_vocab} differs from the target model's vocab_size {target_vocab}; a draft must "
                         f"share the target's tokenizer and vocabulary")


def draft_engine_config(engine_cfg: Any) -> Any:
    """The draft engine's `EngineConfig`: the target's (same slots, pages, page size, token buckets: the same page
    table serves both pools) without speculation, with the k - 1 proposal passes as its decode steps."""
    spec = engine_cfg.speculative
    return dataclasses.replace(engine_cfg, decode_steps=max(1, spec.num_tokens - 1),
                               speculative=dataclasses.replace(spec, method="none"))


class Drafter:
    """The draft model of one engine: per slot the sequence's tokens and the positions the draft's pool holds, and
    the draft engine that proposes from them."""

    def __init__(self, engine: Any, table: np.ndarray, k: int, target_vocab: int, source: str = "draft") -> None:
        """`engine`: the draft's paged engine, built with `draft_engine_config`; `table`: the target's page table
        (`PageTables.table`), which the draft engine then shares; `k`: proposals per row."""
        check_vocab(target_vocab, engine.vocab_size, source)
        own = engine.tables.table
        if own.shape != table.shape:
            raise ValueError(f"the draft engine's page table is {own.shape} (slots, pages per sequence), the "
                             f"target's {table.shape}: both need the same engine settings and max_seq_len")
        engine.tables.table = table  # one page table, two pools
        self.engine = engine
        self.k = k
        self.source = source
        slots = table.shape[0]
        self.history: list[list[int]] = [[] for _ in range(slots)]
        """Per slot, the tokens of its sequence at positions 0.. as far as the engine computed or drew them."""
        self.seen = np.zeros(slots, np.int64)
        """Per slot, positions whose K/V the draft's pool holds for the slot's current sequence."""
        self._written = np.zeros(slots, np.int64)
        """Per slot, proposals whose K/V the last proposal wrote past the row's last token (valid if accepted)."""
        self.draft_steps = 0
        """Draft engine steps run (catch-up chunks and proposal passes)."""
        self.unknown = 0
        """Speculating rows left with their placeholders because the draft did not know their tokens."""

    # -- what the target engine did
    def observe(self, seqs: Sequence[SeqStep], result: StepResult, steps: int) -> None:
        """Record the tokens of a target step: each chunk's tokens (a first chunk starts the slot's sequence over,
        with the prefix it reuses), each sampled token, each speculating row's emitted tokens."""
        tokens = result.tokens
        for i, q in enumerate(seqs):
            slot = q.slot
            h = self.history[slot]
            toks = np.asarray(q.tokens, np.int64).reshape(-1)
            if q.sampling is not None:  # a request starts in the slot
                prefix = [] if q.prefix_tokens is None else [int(t) for t in np.asarray(q.prefix_tokens).reshape(-1)]
                h[:] = prefix
                self.seen[slot] = 0
            if q.spec:
                assert result.spec_tokens is not None
                emitted = [int(t) for t in result.spec_tokens[i] if t >= 0]
                del h[q.start + 1:]
                h.extend(emitted)
                accepted = max(len(emitted) - 1, 0)
                # `propose` left seen at the row's last token + 1; the accepted proposals it wrote are valid too
                self.seen[slot] = min(int(self.seen[slot]) + min(accepted, int(self._written[slot])), len(h))
                continue
            if toks.size:
                del h[q.start:]
                h.extend(int(t) for t in toks)
                if q.sample and tokens is not None:
                    h.append(int(tokens[0, i]))
            elif tokens is not None:  # a decode row: its draws take positions start + 1 ..
                del h[q.start + 1:]
                h.extend(int(t) for t in tokens[:1 if q.first_pass_only else steps, i])
            self.seen[slot] = min(self.seen[slot], len(h))

    # -- the proposals
    def propose(self, seqs: Sequence[SeqStep], step_id: int) -> list[SeqStep]:
        """`seqs` with each speculating row's placeholders replaced by the draft's greedy proposals (the same on
        every host: the same draft programs over the same state). Rows that do not speculate are unchanged, and so
        is a row whose tokens the draft was not told (`unknown`; it cannot happen through `observe`): its
        placeholders are verified as they are, which changes no output token."""
        rows = [q for q in seqs if q.spec and len(self.history[q.slot]) >= q.start]
        self.unknown += sum(1 for q in seqs if q.spec) - len(rows)
        if not rows:
            return list(seqs)
        ends: dict[int, int] = {}
        for q in rows:
            h = self.history[q.slot]
            del h[q.start:]
            h.append(int(np.asarray(q.tokens).reshape(-1)[0]))
            ends[q.slot] = q.start + 1
            self.seen[q.slot] = min(self.seen[q.slot], q.start)
        first = self._catch_up(ends, step_id)
        proposals = {slot: [tok] for slot, tok in first.items()}
        by_count: dict[int, list[SeqStep]] = {}
        for q in rows:
            if q.spec > 1:
                by_count.setdefault(int(q.spec), []).append(q)
        for n, group in sorted(by_count.items()):
            decode = [SeqStep(q.slot, np.zeros(0, np.int32), q.start + 1, True) for q in group]
            result = self._step(StepPlan(step_id, decode_steps=n - 1, seqs=tuple(decode)))
            assert result.tokens is not None
            for j, q in enumerate(group):
                proposals[q.slot].extend(int(t) for t in result.tokens[: n - 1, j])
        out = []
        for q in seqs:
            if q.slot not in proposals:
                out.append(q)
                continue
            props = proposals[q.slot][: q.spec]
            self.seen[q.slot] = q.start + 1
            self._written[q.slot] = q.spec - 1
            tokens = np.asarray([int(np.asarray(q.tokens).reshape(-1)[0]), *props], np.int32)
            out.append(dataclasses.replace(q, tokens=tokens))
        return out

    def _catch_up(self, ends: dict[int, int], step_id: int) -> dict[int, int]:
        """Write the draft's K/V of every position from `seen` up to each slot's end (its last token's position
        + 1), in prompt chunks within a dp group's step budget; the chunk that reaches the end draws the slot's
        first proposal (returned by slot)."""
        e = self.engine
        per_group = e.slots_per_group
        first: dict[int, int] = {}
        while len(first) < len(ends):
            budget = [e.max_step_tokens] * e.groups
            chunks: list[SeqStep] = []
            for slot, end in ends.items():
                if slot in first:
                    continue
                start = int(self.seen[slot])
                n = min(end - start, budget[slot // per_group])
                if n <= 0:
                    continue
                budget[slot // per_group] -= n
                toks = np.asarray(self.history[slot][start:start + n], np.int32)
                chunks.append(SeqStep(slot, toks, start, start + n == end, GREEDY if start == 0 else None))
            result = self._step(StepPlan(step_id, seqs=tuple(chunks)))
            assert result.tokens is not None
            for j, q in enumerate(chunks):
                self.seen[q.slot] = q.start + int(q.tokens.shape[0])
                if q.sample:
                    first[q.slot] = int(result.tokens[0, j])
        return first

    def _step(self, plan: StepPlan) -> StepResult:
        self.draft_steps += 1
        return self.engine.step(plan)
