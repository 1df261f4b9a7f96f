"""Ragged paged attention in plain XLA: the CPU backend and the reference the Pallas backends are tested against.

Same signature and semantics as jax's TPU kernel (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`):
the tokens of all sequences are concatenated in `q`; sequence s owns tokens [cu_q_lens[s], cu_q_lens[s+1]),
has kv_lens[s] tokens in the cache (this step's included) in the pages page_indices[s], and its token i sits
at position kv_lens[s] - q_len[s] + i, attending to the positions <= its own (and > its own - sliding_window).
kv_pages holds K and V interleaved on the head axis: [P, page_size, 2*Hkv, D] with K head h at 2h, V at 2h+1.
A quantized pool (`kv_quant.QuantizedPool`, int8 or float8 values with a float32 scale per token and head) is
dequantized in the page gathers below, so both loops read it one byte a value and compute as for a float pool.

How it is computed, in two parts whose work follows the live tokens rather than the static shapes:
- sequences with one token (decode rows): in an engine that runs the native CPU kernels (`decode_rows`, handed
  in by the engine: `raydeploy.engine.matmul.cpu_native.decode_attention`: float32, CPU,
  `engine.cpu_matmul: auto`), a C++ kernel that reads
  each row's keys and values where they lie in the pool; otherwise all sequence rows at once, in a loop over blocks of pages that
  stops at the longest such row (a wide page table costs nothing past it), with an online softmax; within a
  block K and V are gathered apart, head-major ([rows, kv_heads, tokens, head_dim], the transpose inside the
  gather), and the scores and outputs are two batched matmuls over (row, kv head) (measured on 2 AVX2 cores,
  30 layers, 8 rows x 1024 tokens: 60 ms, against 85 ms for a broadcast-multiply-reduce over one gather of the
  interleaved pages);
- sequences with more tokens (prefill chunks): a loop over their blocks of query rows (chunks of at most half a
  block, as short prompts arriving together give, in a loop of their own over half blocks), as many as there are,
  each over only the key blocks its causal window reaches, with an online softmax and two small matmuls per
  block, so a chunk's keys are read once per block of rows and nothing is computed for padding.

Padding (rows >= num_seqs, tokens past cu_q_lens[num_seqs], page slots past a sequence's kv_len) never reaches
a live token: scores are masked with a finite value before the softmax and masked values are zeroed, so even
NaN in unused cache memory stays out. Tokens that belong to no live sequence get zeros.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from raydeploy.engine.attention.kv_quant import QuantizedPool, dequantize

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, as the TPU kernel's: a fully masked row stays finite
CHUNK_BLOCK_Q = 64        # query rows of a multi-token sequence per step of the chunk loop
SHORT_CHUNK_BLOCK_Q = 32  # query rows per step for chunks of at most this many tokens. Measured on this backend
# alone (one thread, the demo's 30 layers): 8 chunks of 23 tokens 35.8 ms in blocks of 64, 22.7 in blocks of 32,
# 25.7 split so; one chunk of 256 tokens over 1280 keys 271 ms in blocks of 64, 302 in blocks of 32
KV_BLOCK_TOKENS = 64     # keys per step of the key-block loops (rounded to whole pages). Measured (2 AVX2
# cores, 30 layers, benchmarks/attention_cpu.py): 64 against 256, 16 rows x 64 / 256 / 1024 cached tokens:
# 9 / 30 / 122 ms against 73 / 67 / 200 ms; a block is computed whole, so big blocks pay for every row's
# masked tail (the demo engine's decode pass at 16 rows: 125 -> 70 ms)


def check_inputs(q: jax.Array, kv_pages: jax.Array | QuantizedPool, kv_lens: jax.Array, page_indices: jax.Array,
                 cu_q_lens: jax.Array, num_seqs: jax.Array) -> None:
    """Static (shape and dtype) checks with messages that name the argument; raise ValueError."""
    if q.ndim != 3:
        raise ValueError(f"ragged_paged_attention: q must be [tokens, q_heads, head_dim], got shape {q.shape}")
    if kv_pages.ndim != 4 or kv_pages.shape[2] % 2:
        raise ValueError("ragged_paged_attention: kv_pages must be [pages, page_size, 2*kv_heads, head_dim] "
                         f"(K and V interleaved on the head axis), got shape {kv_pages.shape}")
    if kv_pages.shape[3] != q.shape[2]:
        raise ValueError(f"ragged_paged_attention: head_dim of q ({q.shape[2]}) and kv_pages "
                         f"({kv_pages.shape[3]}) differ")
    kv_heads = kv_pages.shape[2] // 2
    if q.shape[1] % kv_heads:
        raise ValueError(f"ragged_paged_attention: q heads ({q.shape[1]}) must be a multiple of the kv heads "
                         f"({kv_heads} = kv_pages.shape[2] // 2)")
    if page_indices.ndim != 2:
        raise ValueError(f"ragged_paged_attention: page_indices must be [seqs, pages_per_seq], got shape "
                         f"{page_indices.shape}")
    seqs = page_indices.shape[0]
    for name, arr, shape in (("kv_lens", kv_lens, (seqs,)), ("cu_q_lens", cu_q_lens, (seqs + 1,)),
                             ("num_seqs", num_seqs, (1,))):
        if tuple(arr.shape) != shape:
            raise ValueError(f"ragged_paged_attention: {name} must have shape {shape} for {seqs} sequence "
                             f"rows (page_indices.shape[0]), got {tuple(arr.shape)}")
    for name, arr in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens),
                      ("num_seqs", num_seqs)):
        if arr.dtype != jnp.int32:
            raise ValueError(f"ragged_paged_attention: {name} must be int32, got {arr.dtype}")


def check_options(sliding_window: int | None, soft_cap: float | None) -> None:
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"ragged_paged_attention: sliding_window must be positive or None, got {sliding_window}")
    if soft_cap is not None and soft_cap == 0.0:
        raise ValueError("ragged_paged_attention: soft_cap must be non-zero or None, got 0.0")


def ragged_paged_attention(q: jax.Array, kv_pages: jax.Array | QuantizedPool, kv_lens: jax.Array, page_indices: jax.Array,
                           cu_q_lens: jax.Array, num_seqs: jax.Array, *, sm_scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           block_q: int | None = None, kv_block_pages: int | None = None,
                           decode_rows: Callable[..., jax.Array | None] | None = None) -> jax.Array:
    """q [T, Hq, D], kv_pages [P, page_size, 2*Hkv, D], kv_lens i32[S], page_indices i32[S, pages_per_seq],
    cu_q_lens i32[S+1] (cu_q_lens[0] = 0), num_seqs i32[1] -> out [T, Hq, D] in q's dtype.

    `decode_rows`: a kernel for every row's first token against its pages (the signature of
    `raydeploy.engine.matmul.cpu_native.decode_attention`; None where it does not apply), asked first.

    `block_q` (query rows of the chunk loop) and `kv_block_pages` (pages per key block of both loops) override
    the block sizes (tests; measurements)."""
    check_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    check_options(sliding_window, soft_cap)
    t, hq, d = q.shape
    s = page_indices.shape[0]
    # the ragged layout, sanitised: rows >= num_seqs have no tokens and no keys
    live = jnp.arange(s, dtype=jnp.int32) < num_seqs[0]
    total = cu_q_lens[jnp.clip(num_seqs[0], 0, s)]
    starts = jnp.where(live, cu_q_lens[:-1], total)
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    lens = jnp.where(live, kv_lens, 0)
    single = q_lens == 1

    pages = KV_BLOCK_TOKENS // kv_pages.shape[1] if kv_block_pages is None else kv_block_pages
    pages = max(1, min(pages, page_indices.shape[1]))
    out_single = None if decode_rows is None else decode_rows(
        jnp.take(q, jnp.clip(starts, 0, t - 1), axis=0), kv_pages, jnp.where(single, lens, 0), page_indices,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if out_single is None:  # no kernel handed in, or it does not apply
        out_single = _single_tokens(q, kv_pages, lens, page_indices, starts, single, pages, sm_scale,
                                    sliding_window, soft_cap)                    # [S, Hq, D] float32
    tid = jnp.arange(t, dtype=jnp.int32)
    seq_t = jnp.minimum(jnp.sum((starts + q_lens)[None, :] <= tid[:, None], axis=1, dtype=jnp.int32), s - 1)
    out = jnp.take(out_single, seq_t, axis=0)
    if t > 1:  # a sequence with two or more tokens fits
        b = min(CHUNK_BLOCK_Q, t) if block_q is None else block_q
        parts = [(q_lens, b)]
        if block_q is None and b // 2 >= SHORT_CHUNK_BLOCK_Q:
            # chunks of at most half a block (short prompts arriving together) in blocks of half the rows, so
            # a block computes fewer padding rows; longer ones in whole blocks (fewer blocks over their keys).
            # Each loop leaves the other's rows zero.
            is_short = q_lens <= b // 2
            parts = [(jnp.where(is_short, q_lens, 0), b // 2), (jnp.where(is_short, 0, q_lens), b)]
        out_chunks = sum(_chunked_sequences(q, kv_pages, lens, page_indices, starts, lens_q, rows, pages, sm_scale,
                                            sliding_window, soft_cap) for lens_q, rows in parts)
        out = jnp.where(single[seq_t][:, None, None], out, out_chunks)
    return jnp.where((tid < total)[:, None, None], out, 0.0).astype(q.dtype)


def _single_tokens(q: jax.Array, kv_pages: jax.Array | QuantizedPool, lens: jax.Array, page_indices: jax.Array,
                   starts: jax.Array, single: jax.Array, block_pages: int, sm_scale: float,
                   sliding_window: int | None, soft_cap: float | None) -> jax.Array:
    """Every sequence row as one decode token (its first token; meaningful where `single`), all rows at once
    -> [S, Hq, D] float32.

    A loop over blocks of `block_pages` pages of every row, as many as the longest single-token row needs (a
    dynamic trip count: a wide page table costs nothing past the live tokens), with an online softmax. Within a
    block K and V are gathered head-major and the scores and outputs are batched matmuls over (row, kv head);
    the block's gathered pages are a small buffer reused by every iteration rather than a copy of every row's
    whole cache."""
    t, hq, d = q.shape
    num_pages, page_size, kv2, _ = kv_pages.shape
    hkv, g = kv2 // 2, hq // (kv2 // 2)
    s, pps = page_indices.shape
    padded_pps = -(-pps // block_pages) * block_pages
    table = jnp.pad(jnp.clip(page_indices, 0, num_pages - 1), ((0, 0), (0, padded_pps - pps)))
    q_skgd = jnp.take(q, jnp.clip(starts, 0, t - 1), axis=0).reshape(s, hkv, g, d).astype(jnp.float32)
    kv_tokens = block_pages * page_size
    qpos = lens - 1

    def kv_block(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        m, denom, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(table, j * block_pages, block_pages, axis=1).reshape(-1)
        k, v = _gather_block(kv_pages, ids)                                   # [S*bp, ps, K, D] each
        k = k.reshape(s, kv_tokens, hkv, d).transpose(0, 2, 1, 3).astype(jnp.float32)  # [S,K,L,D]
        kpos = j * kv_tokens + jnp.arange(kv_tokens, dtype=jnp.int32)[None, :]
        key_ok = kpos <= qpos[:, None]                                         # causal: written positions
        mask = (key_ok & single[:, None])[:, None, None, :]                     # [S, 1, 1, L]
        if sliding_window is not None:
            mask &= (kpos > qpos[:, None] - sliding_window)[:, None, None, :]
        scores = _cap(jnp.einsum("skgd,skld->skgl", q_skgd, k), sm_scale, soft_cap)  # [S, K, G, L]
        scores = jnp.where(mask, scores, MASK_VALUE)
        m_next = jnp.maximum(m, jnp.max(scores, axis=-1))
        p = jnp.where(mask, jnp.exp(scores - m_next[..., None]), 0.0)
        corr = jnp.exp(m - m_next)
        v = v.reshape(s, kv_tokens, hkv, d)
        v = jnp.where(key_ok[:, :, None, None], v, 0.0).transpose(0, 2, 1, 3).astype(jnp.float32)  # [S,K,L,D]
        acc = acc * corr[..., None] + jnp.einsum("skgl,skld->skgd", p, v)
        return m_next, denom * corr + jnp.sum(p, axis=-1), acc

    init = (jnp.full((s, hkv, g), MASK_VALUE, jnp.float32), jnp.zeros((s, hkv, g), jnp.float32),
            jnp.zeros((s, hkv, g, d), jnp.float32))
    if padded_pps == block_pages:  # one block covers the table: no loop (its overhead shows at small batches)
        _, denom, acc = kv_block(jnp.zeros((), jnp.int32), init)
    else:
        longest = jnp.max(jnp.where(single, lens, 0))
        _, denom, acc = jax.lax.fori_loop(0, (longest + kv_tokens - 1) // kv_tokens, kv_block, init)
    return (acc / jnp.where(denom == 0.0, 1.0, denom)[..., None]).reshape(s, hq, d)


def _chunked_sequences(q: jax.Array, kv_pages: jax.Array | QuantizedPool, lens: jax.Array, page_indices: jax.Array,
                       starts: jax.Array, q_lens: jax.Array, block_q: int, block_pages: int, sm_scale: float,
                       sliding_window: int | None, soft_cap: float | None) -> jax.Array:
    """The sequences with two or more tokens (prefill chunks) -> [T, Hq, D] float32 (other rows zero).

    A loop over their blocks of `block_q` query rows, as many as there are (a dynamic trip count, so padding
    costs nothing), each over only the key blocks its causal (and sliding) window reaches, with an online
    softmax: the work is that of the live chunks, not of the step's static shapes."""
    t, hq, d = q.shape
    num_pages, page_size, kv2, _ = kv_pages.shape
    hkv, g = kv2 // 2, hq // (kv2 // 2)
    s, pps = page_indices.shape
    b, kv_tokens = block_q, block_pages * page_size
    items_per_seq = jnp.where(q_lens >= 2, (q_lens + b - 1) // b, 0)
    item_end = jnp.cumsum(items_per_seq)
    padded_pps = -(-pps // block_pages) * block_pages
    table = jnp.pad(jnp.clip(page_indices, 0, num_pages - 1), ((0, 0), (0, padded_pps - pps)))
    q_pad = jnp.pad(q, ((0, b), (0, 0), (0, 0)))     # blocks never run past the end (no clamped slices)

    def item(i: jax.Array, out: jax.Array) -> jax.Array:
        seq = jnp.minimum(jnp.sum(item_end <= i, dtype=jnp.int32), s - 1)
        r0 = (i - item_end[seq] + items_per_seq[seq]) * b
        first = starts[seq] + r0
        rows = r0 + jnp.arange(b, dtype=jnp.int32)
        row_ok = rows < q_lens[seq]
        qpos = lens[seq] - q_lens[seq] + rows
        # [K, G*B, D]: a kv head's query heads and rows as one matrix, so each key block is two batched
        # matmuls over the kv heads with G*B rows
        q_kmd = (jax.lax.dynamic_slice_in_dim(q_pad, first, b).reshape(b, hkv, g, d).transpose(1, 2, 0, 3)
                 .reshape(hkv, g * b, d).astype(jnp.float32))
        qpos_m = jnp.tile(qpos, g)                                               # [G*B], row m = (g, b)
        row_ok_m = jnp.tile(row_ok, g)
        hi = lens[seq] - q_lens[seq] + jnp.minimum(r0 + b, q_lens[seq])        # keys [lo, hi) are reached
        lo = 0 if sliding_window is None else jnp.maximum(0, qpos[0] - sliding_window + 1)

        def kv_block(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            m, denom, acc = carry
            ids = jax.lax.dynamic_slice_in_dim(table[seq], j * block_pages, block_pages)
            k, v = _gather_block(kv_pages, ids)
            k = k.reshape(kv_tokens, hkv, d).transpose(1, 0, 2).astype(jnp.float32)               # [K, L, D]
            kpos = j * kv_tokens + jnp.arange(kv_tokens, dtype=jnp.int32)
            key_ok = kpos < lens[seq]
            mask = (kpos[None, :] <= qpos_m[:, None]) & row_ok_m[:, None] & key_ok[None, :]   # [G*B, L]
            if sliding_window is not None:
                mask &= kpos[None, :] > qpos_m[:, None] - sliding_window
            scores = _cap(jnp.einsum("kmd,kld->kml", q_kmd, k), sm_scale, soft_cap)            # [K, G*B, L]
            scores = jnp.where(mask[None], scores, MASK_VALUE)
            m_next = jnp.maximum(m, jnp.max(scores, axis=-1))
            p = jnp.where(mask[None], jnp.exp(scores - m_next[..., None]), 0.0)
            corr = jnp.exp(m - m_next)
            v = v.reshape(kv_tokens, hkv, d)
            v = jnp.where(key_ok[:, None, None], v, 0.0).transpose(1, 0, 2).astype(jnp.float32)   # [K, L, D]
            acc = acc * corr[..., None] + jnp.einsum("kml,kld->kmd", p, v)
            return m_next, denom * corr + jnp.sum(p, axis=-1), acc

        init = (jnp.full((hkv, g * b), MASK_VALUE, jnp.float32), jnp.zeros((hkv, g * b), jnp.float32),
                jnp.zeros((hkv, g * b, d), jnp.float32))
        _, denom, acc = jax.lax.fori_loop(lo // kv_tokens, (hi + kv_tokens - 1) // kv_tokens, kv_block, init)
        res = ((acc / jnp.where(denom == 0.0, 1.0, denom)[..., None]).reshape(hkv, g, b, d).transpose(2, 0, 1, 3)
               .reshape(b, hq, d))
        cur = jax.lax.dynamic_slice_in_dim(out, first, b)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(row_ok[:, None, None], res, cur), first, 0)

    out = jnp.zeros((t + b, hq, d), jnp.float32)
    return jax.lax.fori_loop(0, item_end[-1], item, out)[:t]


def _gather_block(kv_pages: jax.Array | QuantizedPool, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """K and V of the pages `ids` ([n, page_size, Hkv, D] each) from the pool as it lies ([P, page_size, 2*Hkv,
    D], K and V interleaved on the head axis): one gather each, picking its heads. The pool is never reshaped:
    a reshaped pool ([P, page_size, Hkv, 2, D]) closed over by a loop made XLA CPU give the reshape another
    layout and copy the whole pool into the loop, once per query block and layer (an 805 MB pool: a 4-token
    step took seconds). A quantized pool's scales are gathered with the same indices and the block is
    dequantized as it is gathered (float32): the loop reads int8 (or float8) from the pool, one byte a value."""
    heads = 2 * jnp.arange(kv_pages.shape[2] // 2, dtype=jnp.int32)[None, :]
    if isinstance(kv_pages, QuantizedPool):
        k = dequantize(kv_pages.values[ids[:, None], :, heads], kv_pages.scales[ids[:, None], :, heads])
        v = dequantize(kv_pages.values[ids[:, None], :, heads + 1], kv_pages.scales[ids[:, None], :, heads + 1])
    else:
        k = kv_pages[ids[:, None], :, heads]
        v = kv_pages[ids[:, None], :, heads + 1]
    return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _cap(scores: jax.Array, sm_scale: float, soft_cap: float | None) -> jax.Array:
    scores = scores * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    return scores


def dense_reference(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array, page_indices: jax.Array,
                    cu_q_lens: jax.Array, num_seqs: int, *, sm_scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None) -> jax.Array:
    """The plain definition, one sequence at a time in Python (concrete inputs only; tests): -> [T, Hq, D]
    float32, zeros for tokens of no live sequence."""
    t, hq, d = q.shape
    hkv = kv_pages.shape[2] // 2
    if isinstance(kv_pages, QuantizedPool):
        kv_pages = kv_pages.dequantized()
    out = jnp.zeros((t, hq, d), jnp.float32)
    for i in range(int(num_seqs)):
        start, end, n = int(cu_q_lens[i]), int(cu_q_lens[i + 1]), int(kv_lens[i])
        kv = kv_pages[page_indices[i]].reshape(-1, 2 * hkv, d)[:n].astype(jnp.float32)
        k = jnp.repeat(kv[:, 0::2], hq // hkv, axis=1)
        v = jnp.repeat(kv[:, 1::2], hq // hkv, axis=1)
        qs = q[start:end].astype(jnp.float32)
        scores = jnp.einsum("qhd,khd->hqk", qs, k) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        qpos = n - (end - start) + jnp.arange(end - start)[:, None]
        kpos = jnp.arange(n)[None, :]
        allowed = kpos <= qpos
        if sliding_window is not None:
            allowed &= kpos > qpos - sliding_window
        scores = jnp.where(allowed[None], scores, -math.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        out = out.at[start:end].set(jnp.einsum("hqk,khd->qhd", probs, v))
    return out
