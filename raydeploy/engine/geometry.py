"""`EngineGeometry`: the one description of an engine's shapes, computed once from the config, the model, the
mesh and the platform, with no JAX: dp groups, slots per group, pages, token and page buckets, the KV dtype, the
step's token budgets and what one engine admits.

`ProgramSet` compiles its programs from it, `raydeploy plan` lists its `problems()` before anything starts, the
scheduler sizes its groups and page pools by it, the serve limits and `predict` read its admission limits, and
the gang's bring-up fingerprint includes it. The one divisibility rule of the slots (`slots_problem`) is the
config's own (raydeploy.config.slots, below everything that reads a config): the config's load, the plan and the
engine ask it, and the geometry lists it among its `problems()`.

Imports no JAX.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from raydeploy.config.slots import DEFAULT_SLOT_RULE, SLOT_AXIS, slot_axes, slot_groups, slots_problem
from raydeploy.model.spec import pages_per_seq, resolve_num_pages

__all__ = ["DEFAULT_SLOT_RULE", "SLOT_AXIS", "AdmissionLimits", "EngineGeometry", "slot_axes", "slot_groups",
           "slots_problem"]

def default_decode_rows(slots_per_group: int, min_rows: int = 1) -> list[int]:
    """Decode row buckets per slot group: powers of four from `min_rows` below the group size, and the size.

    Powers of four, not two: each bucket is one more compiled program per window, and a decode step's cost
    grows slowly with rows (the weights are read once per step whatever the rows), so a step padded to up to
    4x its occupied rows costs little more than an exact one."""
    out, r = [], min(min_rows, slots_per_group)
    while r < slots_per_group:
        out.append(r)
        r *= 4
    return out + [slots_per_group]


FINE_PROMPT_BUCKETS = ("cpu",)
"""Platforms whose prompt steps get a bucket at every power of two between the group's slots and the chunk (and
from `MIN_THREE_HALVES_BUCKET` at 3/2 of each too).
On CPU a step's cost grows with its tokens (the demo model: a 64-token step costs ~3 decode passes, a 256-token
one ~8), so padding 140 tokens to 256 nearly doubles the step. On TPU and GPU a step of a few hundred tokens
costs about one weight read whatever its tokens, and fewer programs compile faster: there the prompt steps are
the chunk and a quarter chunk."""
MIXED_STEP_CAP_PLATFORMS = ("cpu",)
"""Platforms where a step beside running streams carries at most the quarter chunk (`Engine.mixed_step_tokens`):
on CPU a step costs what its tokens compute, so a whole chunk beside the streams slows them several times over.
On TPU and GPU a chunk step costs about one weight read, as a decode pass does; there prompts that arrive while
streams decode go in whole chunks (the quarter bucket stays, for short prompts), and `engine.max_decode_slowdown`
still holds a long prompt's chunks back by measured step times. Measured on one H100 (a Llama-3.2-1B shape,
bfloat16, 64 prompts of 32-64 tokens at once, `benchmarks/gpu_decode.py`): capped at the quarter, the last first
token came after 1.73 s, 47 steps of 64 tokens."""
MIN_FINE_PROMPT_BUCKET = 16
"""The smallest of those buckets: a step of fewer tokens costs about a decode pass on CPU too."""
MIN_THREE_HALVES_BUCKET = 64
"""From here the CPU ladder also has 3/2 of each power of two (96, 192, ...): a step's cost is nearly its tokens'
there, and 8 short prompts arriving together (~92 new tokens per group of the embedded default) would pay for 128."""


def default_token_buckets(decode_rows: Sequence[int], slots_per_group: int, max_step_tokens: int,
                          platform: str) -> list[int]:
    """Token places per dp group of the step programs: the decode row buckets, the chunk (`max_step_tokens`),
    the quarter chunk (the engine's `mixed_step_tokens`, the step beside running streams) and, on a platform
    in `FINE_PROMPT_BUCKETS`, every power of two from twice the group's slots (at least
    `MIN_FINE_PROMPT_BUCKET`) up to the chunk, with 3/2 of each from `MIN_THREE_HALVES_BUCKET`."""
    out = set(decode_rows) | {max_step_tokens}
    quarter = max_step_tokens // 4
    if quarter > slots_per_group:
        out.add(quarter)
    if platform in FINE_PROMPT_BUCKETS:
        t = max(MIN_FINE_PROMPT_BUCKET, 1 << (2 * slots_per_group - 1).bit_length())
        while t < max_step_tokens:
            out.add(t)
            if t >= MIN_THREE_HALVES_BUCKET and t + t // 2 < max_step_tokens:
                out.add(t + t // 2)
            t *= 2
    return sorted(out)


MIN_PAGE_BUCKET_TOKENS = 256
"""Smallest page bucket, in tokens: below it the gathered pages are a few percent of a step's weight read."""
PAGE_BUCKET_FACTOR = 8
"""Each page bucket holds this many times the previous one's pages (fewer programs; at most 8x the pages read)."""


def default_page_buckets(max_pages: int, page_size: int) -> list[int]:
    """Pages gathered per sequence: from `MIN_PAGE_BUCKET_TOKENS` up by `PAGE_BUCKET_FACTOR`, capped by the
    pages of max_seq_len."""
    p = max(1, -(-MIN_PAGE_BUCKET_TOKENS // page_size))
    out = []
    while p < max_pages:
        out.append(p)
        p *= PAGE_BUCKET_FACTOR
    return out + [max_pages]


@dataclass(frozen=True)
class AdmissionLimits:
    """What one engine admits: prompt and output together within `max_seq_len`, at most `max_new_tokens` new
    tokens (the operator's cap; None: only the context bounds them), `max_slots` sequences at once. From the config
    alone (`from_config`)."""

    max_seq_len: int
    max_new_tokens: int | None
    max_slots: int

    @classmethod
    def from_config(cls, cfg: Any) -> AdmissionLimits:
        return cls(max_seq_len=cfg.model.max_seq_len, max_new_tokens=cfg.engine.max_new_tokens,
                   max_slots=cfg.engine.max_slots)


@dataclass(frozen=True)
class EngineGeometry:
    """An engine's shapes. Build it with `create`; `problems()` lists what makes it impossible (the engine raises
    on the first, `raydeploy plan` lists them all)."""

    platform: str
    groups: int
    """dp groups: shards of the slot axis; slot s belongs to group s // slots_per_group."""
    max_slots: int
    slots_per_group: int
    """Slots of one group (0 when max_slots does not divide over the groups: see `problems`)."""
    max_seq_len: int
    page_size: int
    max_pages_per_seq: int
    """Pages of one sequence at max_seq_len: the page table's width."""
    pages_per_group: int
    """Pages of the paged KV pool each dp group owns (`engine.num_pages`, auto resolved)."""
    max_step_tokens: int
    """Most tokens one step computes per group: the prefill chunk, or one per slot of the group if more."""
    mixed_step_tokens: int | None
    """Token budget of a step that carries decode rows beside a prompt (a quarter chunk) on a platform in
    `MIXED_STEP_CAP_PLATFORMS`, or None (the whole chunk)."""
    token_buckets: tuple[int, ...]
    """Token places per group of the step programs."""
    page_buckets: tuple[int, ...]
    """Page-table widths of the step programs."""
    kv_dtype: str
    """The KV pools' dtype (`engine.kv_dtype` resolved)."""
    admission: AdmissionLimits
    slot_axes: tuple[str, ...]
    """The mesh axes of the slot axis (`mesh.rules.cache_batch`, axes of size 1 dropped)."""
    slot_mesh: tuple[tuple[str, int], ...]
    """Those axes with their sizes."""

    @classmethod
    def create(cls, engine_cfg: Any, model_cfg: Any, mesh_shape: Mapping[str, int], rules: Mapping[str, Any],
               platform: str, kv_dtype: str, table_follows_work: bool) -> EngineGeometry:
        """From `engine.*` and `model.*`, the mesh's axis sizes, the sharding rules (the family's merged with the
        configured), the platform, the resolved KV dtype, and whether the attention's work follows the page
        table's width (`raydeploy.engine.attention.work_follows_table`: then the table is bucketed)."""
        mesh_shape = dict(mesh_shape)
        axes = slot_axes(rules, mesh_shape)
        groups = math.prod(mesh_shape[a] for a in axes)
        max_slots = engine_cfg.max_slots
        spg = max_slots // groups if max_slots % groups == 0 else 0
        max_seq_len, page_size = model_cfg.max_seq_len, engine_cfg.page_size
        max_pages = pages_per_seq(max_seq_len, page_size)
        pages = resolve_num_pages(engine_cfg.num_pages, max(spg, 1), max_seq_len, page_size)
        step = max(engine_cfg.prefill_chunk, max_slots // groups)
        slow_single_row = model_cfg.param_dtype == "bfloat16" and platform == "cpu"
        decode = default_decode_rows(max(spg, 1), 2 if slow_single_row else 1)
        tokens = tuple(default_token_buckets(decode, max(spg, 1), step, platform))
        quarter = step // 4
        mixed = quarter if platform in MIXED_STEP_CAP_PLATFORMS and quarter in tokens else None
        page_buckets = tuple(default_page_buckets(max_pages, page_size) if table_follows_work else [max_pages])
        admission = AdmissionLimits(max_seq_len=max_seq_len, max_new_tokens=engine_cfg.max_new_tokens, max_slots=max_slots)
        return cls(platform=platform, groups=groups, max_slots=max_slots, slots_per_group=spg,
                   max_seq_len=max_seq_len, page_size=page_size, max_pages_per_seq=max_pages, pages_per_group=pages,
                   max_step_tokens=step, mixed_step_tokens=mixed, token_buckets=tokens, page_buckets=page_buckets,
                   kv_dtype=kv_dtype, admission=admission, slot_axes=axes,
                   slot_mesh=tuple((a, mesh_shape[a]) for a in axes))

    @property
    def total_pages(self) -> int:
        return self.pages_per_group * self.groups

    def group_of(self, slot: int) -> int:
        """The dp group that holds `slot`."""
        return slot // self.slots_per_group

    def problems(self) -> list[str]:
        """What makes this geometry impossible, each naming the setting; empty when it is sound."""
        out = []
        slots = slots_problem(self.max_slots, {SLOT_AXIS: self.slot_axes}, dict(self.slot_mesh))
        if slots is not None:
            out.append(slots)
        if self.pages_per_group < self.max_pages_per_seq:
            out.append(f"engine.num_pages {self.pages_per_group} per dp group is fewer than one sequence of "
                       f"model.max_seq_len {self.max_seq_len} needs ({self.max_pages_per_seq} pages of "
                       f"engine.page_size {self.page_size})")
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the bring-up fingerprint hashes it)."""
        return asdict(self)

