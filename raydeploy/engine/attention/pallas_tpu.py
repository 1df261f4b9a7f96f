"""TPU backend: jax's own Pallas ragged paged attention kernel, with its block sizes chosen here from shapes.

The kernel (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`) covers decode rows and prefill chunks in
one call (flash attention over blocks of pages, causal at each token's position, sliding window and soft cap)
and reads only the pages a sequence uses, so it also serves long prefill chunks: no separate splash or flash
attention program is needed for chunked prefill.

Block sizes are passed explicitly. Left to itself the kernel looks them up in its tuning table by the
generation of `jax.devices()[0]`, which fails where the program is compiled without a TPU (`raydeploy
compile`), and the table covers TPU v6 only (every other generation gets its defaults: 128 pages, 32 queries).
The choice below follows the table's entries: blocks of at most 16 pages (one DMA per page; the kernel's own
note says more spill scalar registers) and about 2048 tokens, 32 queries per block, and a VMEM limit from the
buffers those sizes need.

A quantized KV cache (`engine.kv_dtype: int8 | float8_e4m3fn`, per-token scales: `kv_quant`). jax 0.10.2's kernel
reads int8 and float8 pages, but with one scalar `k_scale` and `v_scale` for the whole cache; a scale per token
and head cannot be folded into it (a key's scale multiplies its score, a value's its softmax weight). So the
wrapper dequantizes the pages the step's table names into a compact pool in q's dtype and runs the kernel over
that (`dequantized_table`), as the GPU wrapper compacts its pages. The engine then buckets the table's width
by the live pages (`work_follows_table`). Per cached element the step reads 1 byte (+ 4 bytes of scale per
head_dim elements) and writes and reads back 2 bytes of bfloat16: ~5 bytes of HBM traffic against a bfloat16
pool's 2. The int8 cache halves the pool's memory (twice the slots or the context), not the decode pass's
attention reads: that needs a kernel that multiplies the scales where it loads each page (left to do). On TPU the
pool is stored in its TPU layout (`kv_quant.stored_shapes`: a head's tokens of a page form one tile); the copy
gathers the pages as stored and puts them in the kernel's [page_size, 2*Hkv, D] form itself, one layer's pages
at a time inside the layer loop, so the pool keeps its layout and is never copied whole.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp

from raydeploy.engine.attention import xla
from raydeploy.engine.attention.kv_quant import QuantizedPool, dequantize

MAX_KV_PAGES_PER_BLOCK = 16
KV_TOKENS_PER_BLOCK = 2048
QUERIES_PER_BLOCK = 32
MIB = 1 << 20
MIN_VMEM_LIMIT_BYTES = 32 * MIB
MAX_VMEM_LIMIT_BYTES = 96 * MIB  # v5e, v5p and v6e have 95-128 MiB of VMEM per core


def _kernel() -> Any:
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel

    return kernel


def heads_per_block(num_q_heads: int, num_kv_heads: int, q_dtype: Any, kv_dtype: Any) -> tuple[int, int]:
    """(q heads, combined kv heads) the kernel processes per block; ValueError when the kernel cannot tile the
    kv heads of one shard."""
    combined = 2 * num_kv_heads
    try:
        return _kernel().get_min_heads_per_blk(num_q_heads, combined, jnp.dtype(q_dtype), jnp.dtype(kv_dtype))
    except ValueError as e:
        packing = 4 // jnp.dtype(kv_dtype).itemsize
        raise ValueError(
            f"attention 'pallas' on TPU: jax's ragged paged attention kernel cannot tile {num_kv_heads} kv heads "
            f"per shard in {jnp.dtype(kv_dtype).name} (2 x kv heads / {packing} must be 1, 2, 4, 8 or a multiple "
            f"of 8); shard the kv heads over tensor parallelism so that a shard holds a count that tiles, or use "
            f"engine.attention: xla ({e})") from None


def block_sizes(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                pages_per_seq: int, q_dtype: Any, kv_dtype: Any) -> tuple[int, int, int]:
    """(num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes) for these per-shard shapes; ValueError
    for shapes the kernel does not take."""
    if head_dim % 128:
        raise ValueError(f"attention 'pallas' on TPU: jax's ragged paged attention kernel needs head_dim a multiple "
                         f"of 128 (its softmax statistics are 128 lanes wide), got {head_dim}; use "
                         "engine.attention: xla for this model")
    q_heads_blk, kv_combined_blk = heads_per_block(num_q_heads, num_kv_heads, q_dtype, kv_dtype)
    pages = max(1, min(pages_per_seq, MAX_KV_PAGES_PER_BLOCK, KV_TOKENS_PER_BLOCK // page_size))
    queries = max(1, min(num_tokens, QUERIES_PER_BLOCK))
    q_bytes, kv_bytes = jnp.dtype(q_dtype).itemsize, jnp.dtype(kv_dtype).itemsize
    group = num_q_heads // num_kv_heads
    kv_buffers = 2 * pages * page_size * kv_combined_blk * head_dim * kv_bytes        # double-buffered DMA
    q_out_blocks = 2 * 2 * queries * q_heads_blk * head_dim * q_bytes                 # pipelined q and out
    acc = queries * q_heads_blk * head_dim * 4
    l_m = 2 * (kv_combined_blk // 2) * queries * group * 128 * 4
    need = kv_buffers + q_out_blocks + acc + l_m
    if need > MAX_VMEM_LIMIT_BYTES // 2:
        raise ValueError(f"attention 'pallas' on TPU: blocks of {pages} pages x {page_size} tokens need "
                         f"{need / MIB:.1f} MiB of VMEM, over half the {MAX_VMEM_LIMIT_BYTES // MIB} MiB limit; "
                         "use a smaller page size")
    vmem = min(MAX_VMEM_LIMIT_BYTES, max(MIN_VMEM_LIMIT_BYTES, 2 * need))
    return pages, queries, vmem


def dequantized_table(pool: QuantizedPool, page_indices: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """The pages `page_indices` names, dequantized to `dtype` as a compact pool [S * pages_per_seq, page_size,
    2*Hkv, D], and the table that reads it (row s: pages s * pages_per_seq ...). jax's kernel takes one scale per
    K and V tensor, not one per token; this copy is how it reads a cache with per-token scales. From a pool in
    the TPU layout (`kv_quant.stored_shapes`) the pages are gathered as stored and turned into the kernel's
    [page_size, 2*Hkv, D] only in the copy, so the pool itself keeps its layout."""
    s, pps = page_indices.shape
    ids = jnp.clip(page_indices, 0, pool.shape[0] - 1).reshape(-1)
    table = jnp.arange(s * pps, dtype=jnp.int32).reshape(s, pps)
    r = pool.pages_per_row
    if not r:
        return dequantize(jnp.take(pool.values, ids, axis=0), jnp.take(pool.scales, ids, axis=0), dtype), table
    _, page_size, h2, _ = pool.shape
    values = jnp.take(pool.stored_values, ids, axis=0)[:, 0]  # [n, 2*Hkv, page_size, D]
    # whole 128-lane rows of scales, as stored, then each page's lanes of its row
    rows = jnp.take(pool.stored_scales, ids // r, axis=0)[:, 0, :, 0, :].reshape(-1, h2, r, page_size)
    scales = jnp.take_along_axis(rows, (ids % r)[:, None, None, None], axis=2)[:, :, 0]  # [n, 2*Hkv, page_size]
    compact = dequantize(values, scales[..., None], dtype)  # [n, 2*Hkv, page_size, D]
    return jnp.swapaxes(compact, 1, 2), table


def ragged_paged_attention(q: jax.Array, kv_pages: jax.Array | QuantizedPool, kv_lens: jax.Array, page_indices: jax.Array,
                           cu_q_lens: jax.Array, num_seqs: jax.Array, *, sm_scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           num_queries_per_block: int | None = None, num_kv_pages_per_block: int | None = None,
                           interpret: bool = False) -> jax.Array:
    """The TPU kernel on the contract's arguments (see the package docstring). The block sizes default to
    `block_sizes`; `interpret=True` runs the kernel in Pallas TPU interpret mode (on CPU; tests)."""
    xla.check_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    xla.check_options(sliding_window, soft_cap)
    if isinstance(kv_pages, QuantizedPool):
        kv_pages, page_indices = dequantized_table(kv_pages, page_indices, q.dtype)
    t, hq, d = q.shape
    _, page_size, kv2, _ = kv_pages.shape
    pages, queries, vmem = block_sizes(t, hq, kv2 // 2, d, page_size, page_indices.shape[1], q.dtype,
                                       kv_pages.dtype)
    pages = num_kv_pages_per_block or pages
    queries = num_queries_per_block or queries
    if interpret:
        from jax.experimental.pallas import tpu as pltpu

        mode: Any = pltpu.force_tpu_interpret_mode(pltpu.InterpretParams())
    else:
        mode = contextlib.nullcontext()
    with mode:
        out = _kernel().ragged_paged_attention(
            q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
            sliding_window=sliding_window, soft_cap=soft_cap, num_kv_pages_per_block=pages,
            num_queries_per_block=queries, vmem_limit_bytes=vmem)
    # The kernel leaves the rows of tokens past the live sequences unwritten (uninitialised VMEM): zero them,
    # so a padding token's hidden state and the K/V the engine may write for it stay finite.
    live_tokens = cu_q_lens[jnp.clip(num_seqs[0], 0, page_indices.shape[0])]
    return jnp.where((jnp.arange(t) < live_tokens)[:, None, None], out, jnp.zeros((), out.dtype))
