"""Placement: which dp group's slot and pages a queued request takes (no JAX)."""

from __future__ import annotations

from collections.abc import Sequence

from raydeploy.engine.pages import PagePool, SequencePages
from raydeploy.engine.scheduler.records import Paging, Queued, Running


def rows_per_group(slots: Sequence[Running | None], groups: int) -> list[int]:
    """Running requests in each dp group's slots."""
    per_group = len(slots) // groups
    return [sum(r is not None for r in slots[g * per_group:(g + 1) * per_group]) for g in range(groups)]


class Placement:
    """Chooses a slot and admits pages for queued requests, over the dp groups' page pools."""

    def __init__(self, paging: Paging, pools: Sequence[PagePool], slot_order: Sequence[int], max_seq_len: int) -> None:
        self.paging = paging
        self.pools = pools
        self.slot_order = list(slot_order)
        self.max_seq_len = max_seq_len

    def place(self, q: Queued, cap: int, slots: Sequence[Running | None],
              budget: list[int]) -> tuple[int, SequencePages] | None:
        """A slot and pages (`cap` positions reserved) for a queued request, or None if no dp group has both now.
        Among the groups with a free slot and room for its pages, the one where it costs least, in tokens of a
        step (a decode row counts one): how much longer it makes this step (a step costs its largest group's
        tokens; the prompt computes its tokens here, its cached prefix pages excluded) plus how much longer every
        decode pass after it, for as many passes as its max_tokens allows (the groups run in lockstep, so a pass
        costs its largest group's rows: a request that makes its group hold more rows than any group holds now
        adds a row to each). Ties go to the group with the most step budget left, then the fewest running
        requests. So a cached prefix draws a prompt to its group only while computing it elsewhere costs more
        than the step and the passes it unbalances: a burst does not pile into the one group that served the last
        request while the others idle; streams whose short prompts were cached in one group split evenly
        (7 chat streams of 1536 tokens went 5 / 2 when only this step counted); a long shared system prompt
        keeps short requests on the group that caches it."""
        p, req = self.paging, q.req
        per_group = len(slots) // p.groups
        if q.keys is None:
            # prompt logprobs need every prompt place computed (cached pages hold no logits): no reuse then
            reuse = p.prefix_caching and req.prompt_logprobs is None
            q.keys = SequencePages.prompt_keys(req.prompt_token_ids, p.page_size, req.adapter_key) if reuse else []
        n = len(req.prompt_token_ids)
        rows = rows_per_group(slots, p.groups)
        most_rows, least_budget = max(rows), min(budget)
        passes = max(0, min(req.max_tokens, self.max_seq_len - n) - 1)  # after the pass of its first token
        best: tuple[tuple[int, int, int, int], int, int] | None = None
        for slot in self.slot_order:
            g = slot // per_group
            if slots[slot] is not None or (best is not None and best[1] == g):
                continue
            hit, fits = SequencePages.fits(self.pools[g], q.keys, cap)
            if not fits:
                continue
            tokens = min(n - hit * p.page_size, max(budget[g], 0))  # what it computes here this step
            # how much longer this step gets (its largest group's tokens) and every pass after it
            cost = (max(0, tokens - (budget[g] - least_budget)) + max(0, rows[g] + 1 - most_rows) * passes)
            rank = (-cost, budget[g] - tokens, -rows[g], -self.slot_order.index(slot))
            if best is None or rank > best[0]:
                best = (rank, g, slot)
        if best is None:
            return None
        _, g, slot = best
        pages = SequencePages.admit(self.pools[g], req.prompt_token_ids, cap, q.keys, req.adapter_key)
        assert pages is not None  # `fits` said so, under the same lock
        return slot, pages
