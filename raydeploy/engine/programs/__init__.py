"""The one description of every jitted program an engine runs, from shapes and shardings alone.

`ProgramSet` holds the model's graph, the shardings of every input, and the jitted bodies of the paged
engine's programs:
- `step_{T}x{P}`: one mixed ragged step. For every dp group, the new tokens of that group's sequences in one flat
  batch of T places (prefill chunks of several tokens and decode rows of one token, at explicit positions).
  The pool is carried through the layer scan: per layer, each group writes this step's new K/V into its
  pages in place and calls the attention backend (`raydeploy.engine.attention`, jax's ragged paged attention
  signature) on the whole pool with the rows' page ids offset to that layer, inside `jax.shard_map`
  (sequences and pages over dp, heads over tp). Nothing of the cache is sliced or copied per layer (XLA
  updates the donated, carried pool in place). Logits only at each
  sequence's last token of the step; sampling fused. T is a token bucket (`default_token_buckets`: powers
  of four up to the slots of a group for decode steps; for steps with prompt chunks `engine.prefill_chunk`, a
  quarter of it, and on CPU every power of two between), P the page table's width:
  max_seq_len's pages, or page buckets (from 256 tokens up by 8x) for a backend whose work follows the
  table's width rather than the live tokens (`attention.work_follows_table`: the GPU one).
- `step_{T}x{P}_single`: the same step for a pass in which every live sequence carries one token (every decode
  pass), compiled only where the attention has a separate single-token path (`attention.Attention`: the GPU's
  Pallas decode kernel; the `step` programs there take the XLA path). The engine picks it on the host, so no
  program chooses on its data: on a GPU a `lax.cond` copies its predicate to the host and waits, and the
  choice made once around the layer scan instead made XLA copy the carried pool (measured on CPU).
- `presence_row`: sets one slot's repetition-penalty token set from the host (a request that starts on reused
  prefix pages).

The real `Engine` calls these bodies with real arrays; `abstract_args(shape)` gives the same calls' arguments
as `jax.ShapeDtypeStruct`s with the same shardings, so `raydeploy compile` lowers exactly the programs bring-up
will run (for any mesh, including the devices of a deviceless TPU topology) without allocating anything or
reading a weight. Neither can drift from the other: there is no second description.

The shapes are `raydeploy.engine.geometry.EngineGeometry`'s (token and page buckets among them). The parts:
`kernels` (`KernelChoice`: which matmul kernels and weight
layout the programs use), `bodies` (`StepBodies`: the jitted programs) and `program_set` (`ProgramSet`, which
composes them and lists the programs with their abstract arguments).
"""

from raydeploy.engine.geometry import (
    FINE_PROMPT_BUCKETS,
    MIN_FINE_PROMPT_BUCKET,
    MIN_PAGE_BUCKET_TOKENS,
    MIN_THREE_HALVES_BUCKET,
    MIXED_STEP_CAP_PLATFORMS,
    PAGE_BUCKET_FACTOR,
    default_decode_rows,
    default_page_buckets,
    default_token_buckets,
)
from raydeploy.engine.programs.bodies import AttentionFn, StepBodies, default_attention, pack
from raydeploy.engine.programs.kernels import (
    UNROLL_MAX_TOKENS,
    UNROLL_PLATFORMS,
    KernelChoice,
    choose_kernels,
    choose_layout,
    resolve_kernel_layout,
)
from raydeploy.engine.programs.program_set import ProgramSet, ProgramShape, layer_view

__all__ = [
    "FINE_PROMPT_BUCKETS", "MIN_FINE_PROMPT_BUCKET", "MIN_PAGE_BUCKET_TOKENS", "MIN_THREE_HALVES_BUCKET",
    "MIXED_STEP_CAP_PLATFORMS", "PAGE_BUCKET_FACTOR", "UNROLL_MAX_TOKENS", "UNROLL_PLATFORMS", "AttentionFn",
    "KernelChoice", "ProgramSet", "ProgramShape", "StepBodies", "choose_kernels", "choose_layout",
    "default_attention", "default_decode_rows", "default_page_buckets", "default_token_buckets", "layer_view", "pack",
    "resolve_kernel_layout",
]
