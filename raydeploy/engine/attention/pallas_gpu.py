"""GPU backend: jax's Pallas GPU paged attention for decode steps, the XLA path for steps with prefill rows.

jax's GPU kernel (`jax.experimental.pallas.ops.gpu.paged_attention`, Triton) is decode-only: one query token
per sequence attending to all of its `lengths` cached tokens, with soft cap but without a sliding window. A
step whose live sequences all carry one token (every decode step) runs it: a sequence's single token sits at
position kv_len - 1, so "all cached tokens" is exactly its causal window. A step with a prefill chunk in it
(any live sequence with more than one token) runs `xla.ragged_paged_attention` instead. `ragged_paged_attention` chooses with a `lax.cond` on the step's
data, so one function serves any step. The engine does not call it: on a GPU a `lax.cond` reads its predicate
back to the host, and inside the layer scan that was a host-device synchronisation per layer. The engine takes
`single_token_attention` and the XLA path apart (`attention.get_attention`) into programs of their own and picks
one per pass on the host. A
sliding window always takes the XLA path, and so does a page table too small for one compute block of 16
tokens (Triton's dot needs 16 on each side).

Layout. The kernel wants K and V apart and head-major, [Hkv, pages, page_size, D], and reads pages through
its own block tables; the pool is [P, page_size, 2*Hkv, D] with K and V interleaved. The wrapper gathers the
pages named in `page_indices` (only those: the engine may cut the table to a page-count bucket), splits K and
V, zeroes the positions past each sequence's length (the kernel masks their scores but still multiplies
their values by zero weights, so NaN in unwritten memory would leak), and hands the kernel that compact pool
with block tables 0..S*pages_per_seq-1. The copy is the size of what the kernel then reads.

A quantized KV cache (`engine.kv_dtype: int8 | float8_e4m3fn`, `kv_quant.QuantizedPool`): jax's kernel takes
per-token scales ([Hkv, pages, page_size] for K and for V) and dequantizes inside: it converts a block of int8
keys to q's dtype for the dot and multiplies the keys' scales into the scores, the values' into the softmax
weights. The wrapper compacts the int8 pages and their scales as above, so the copy and the kernel's reads are
1 byte a value (+ 4 bytes of scale per token and head) instead of 2.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from raydeploy.engine.attention import xla
from raydeploy.engine.attention.kv_quant import QuantizedPool

BLOCK_H = 16                  # query heads per kernel block (the kernel requires a multiple of 16)
MAX_K_SPLITS = 16             # partitions of a sequence's pages computed in parallel, merged after
MAX_PAGES_PER_COMPUTE_BLOCK = 8


MIN_BLOCK_K = 16              # cached tokens per compute block: Triton's dot needs every dimension >= 16


def split_sizes(pages_per_seq: int, page_size: int) -> tuple[int, int] | None:
    """(k_splits, pages_per_compute_block) for a page table `pages_per_seq` wide, or None when no compute block
    of at least MIN_BLOCK_K tokens fits (the step then takes the XLA path). The kernel needs k_splits |
    pages_per_seq and pages_per_compute_block | pages_per_seq / k_splits; the most splits that leave such a
    block win (they run in parallel), then the largest block up to MAX_PAGES_PER_COMPUTE_BLOCK pages."""
    min_pages = -(-MIN_BLOCK_K // page_size)
    for k_splits in range(min(pages_per_seq, MAX_K_SPLITS), 0, -1):
        if pages_per_seq % k_splits:
            continue
        per_partition = pages_per_seq // k_splits
        blocks = [b for b in range(min_pages, min(per_partition, max(MAX_PAGES_PER_COMPUTE_BLOCK, min_pages)) + 1)
                  if per_partition % b == 0]
        if blocks:
            return k_splits, blocks[-1]
    return None


def decode_attention(q: jax.Array, kv_pages: jax.Array | QuantizedPool, kv_lens: jax.Array, page_indices: jax.Array,
                     cu_q_lens: jax.Array, num_seqs: jax.Array, *, sm_scale: float, soft_cap: float | None = None,
                     interpret: bool = False) -> jax.Array:
    """The kernel on a step whose live sequences carry at most one token each (their last token is taken) ->
    [T, Hq, D], zeros for tokens of no live sequence."""
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged

    t, hq, d = q.shape
    num_pages, page_size, kv2, _ = kv_pages.shape
    hkv = kv2 // 2
    s, pps = page_indices.shape
    live = (jnp.arange(s, dtype=jnp.int32) < num_seqs[0]) & (cu_q_lens[1:] > cu_q_lens[:-1])
    tok = jnp.clip(cu_q_lens[1:] - 1, 0, t - 1)                               # each sequence's last token
    lens = jnp.where(live, kv_lens, 0)                                        # 0: the kernel skips the row
    pages = jnp.clip(page_indices, 0, num_pages - 1).reshape(-1)
    # Positions past a sequence's length are masked out of the scores, but the kernel still multiplies their
    # values by a zero weight: zero them in the copy, so unwritten cache memory (even NaN) never reaches a row.
    written = jnp.arange(pps * page_size, dtype=jnp.int32)[None, :] < lens[:, None]

    def compact(pool: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
        """The table's pages of `pool`, K and V apart, head-major: [Hkv, S*pps, page_size, width] each."""
        kv = jnp.take(pool, pages, axis=0, mode="clip").reshape(s, pps * page_size, hkv, 2, width)
        kv = jnp.where(written[:, :, None, None, None], kv, jnp.zeros((), kv.dtype))
        kv = kv.reshape(s * pps, page_size, hkv, 2, width)
        return kv[:, :, :, 0].transpose(2, 0, 1, 3), kv[:, :, :, 1].transpose(2, 0, 1, 3)

    scales: dict[str, jax.Array] = {}
    if isinstance(kv_pages, QuantizedPool):
        # int8 / float8 pages and their per-token scales: the kernel converts each page block to q's dtype and
        # multiplies a key's scale into its score and a value's into its softmax weight
        k_pages, v_pages = compact(kv_pages.values, d)
        k_scales, v_scales = compact(kv_pages.scales, 1)
        scales = {"k_scales_pages": k_scales[..., 0], "v_scales_pages": v_scales[..., 0]}
    else:
        k_pages, v_pages = compact(kv_pages, d)                               # [Hkv, S*pps, page_size, D]
    tables = jnp.arange(s * pps, dtype=jnp.int32).reshape(s, pps)
    sizes = split_sizes(pps, page_size)
    if sizes is None:
        raise ValueError(f"pallas GPU decode attention: a {pps}-page table of {page_size}-token pages holds no "
                         f"compute block of {MIN_BLOCK_K} tokens; use the XLA path")
    k_splits, per_block = sizes
    q_s = (jnp.take(q, tok, axis=0).astype(jnp.float32) * sm_scale).astype(q.dtype)
    o = gpu_paged.paged_attention(q_s, k_pages, v_pages, tables, lens, block_h=BLOCK_H,
                                  pages_per_compute_block=per_block, k_splits=k_splits, interpret=interpret,
                                  attn_logits_soft_cap=soft_cap, **scales)
    dest = jnp.where(live, tok, t)                                            # t: dropped
    return jnp.zeros_like(q).at[dest].set(o.astype(q.dtype), mode="drop")


def ragged_paged_attention(q: jax.Array, kv_pages: jax.Array | QuantizedPool, kv_lens: jax.Array, page_indices: jax.Array,
                           cu_q_lens: jax.Array, num_seqs: jax.Array, *, sm_scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           interpret: bool = False) -> jax.Array:
    """The contract's attention (see the package docstring) on GPU: Pallas paged attention when every live
    sequence has one token, XLA otherwise. `interpret=True` runs the kernel in Pallas interpret mode (tests)."""
    xla.check_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    xla.check_options(sliding_window, soft_cap)
    args = (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)

    def mixed(*a: Any) -> jax.Array:
        return xla.ragged_paged_attention(*a, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)

    if not kernel_applies(kv_pages, page_indices, sliding_window):
        return mixed(*args)

    def decode(*a: Any) -> jax.Array:
        return decode_attention(*a, sm_scale=sm_scale, soft_cap=soft_cap, interpret=interpret)

    s = page_indices.shape[0]
    live = jnp.arange(s, dtype=jnp.int32) < num_seqs[0]
    longest = jnp.max(jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0))
    return jax.lax.cond(longest <= 1, decode, mixed, *args)


def single_token_attention(q: jax.Array, kv_pages: jax.Array | QuantizedPool, kv_lens: jax.Array, page_indices: jax.Array,
                           cu_q_lens: jax.Array, num_seqs: jax.Array, *, sm_scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           interpret: bool = False) -> jax.Array:
    """The contract's attention for a step whose every live sequence carries one token, the caller's promise
    (the engine runs it only in its single-token step programs): the kernel, with no choice on the step's data, or the XLA path
    where the kernel does not apply (a sliding window, a table too small for one compute block)."""
    xla.check_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    xla.check_options(sliding_window, soft_cap)
    if not kernel_applies(kv_pages, page_indices, sliding_window):
        return xla.ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                          sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    return decode_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                            soft_cap=soft_cap, interpret=interpret)


def kernel_applies(kv_pages: jax.Array | QuantizedPool, page_indices: jax.Array, sliding_window: int | None) -> bool:
    """Whether the kernel can serve these static shapes: no sliding window, and a table wide enough for one
    compute block (`split_sizes`)."""
    return sliding_window is None and split_sizes(page_indices.shape[1], kv_pages.shape[1]) is not None
