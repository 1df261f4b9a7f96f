"""The engine's program buckets, from shapes alone (no JAX): token places per dp group of the step programs and
the page-table widths they gather."""

from __future__ import annotations

from collections.abc import Sequence


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
