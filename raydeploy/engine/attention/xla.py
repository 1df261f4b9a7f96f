"""Ragged paged attention in plain XLA: the CPU backend and the reference the Pallas backends are tested against.

Same signature and semantics as jax's TPU kernel (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`):
the tokens of all sequences are concatenated in `q`; sequence s owns tokens [cu_q_lens[s], cu_q_lens[s+1]),
has kv_lens[s] tokens in the cache (this step's included) in the pages page_indices[s], and its token i sits
at position kv_lens[s] - q_len[s] + i, attending to the positions <= its own (and > its own - sliding_window).
kv_pages holds K and V interleaved on the head axis: [P, page_size, 2*Hkv, D] with K head h at 2h, V at 2h+1.

How it is computed. The live (sequence, query block) pairs are "work items" of `block_q` consecutive tokens
of one sequence; there are at most min(T, (T + S*(block_q - 1)) // block_q) of them, a static bound, and each
gathers the pages of its own sequence once. `block_q` is chosen from the static shapes (`choose_block_q`):
1 for decode-shaped steps (one item per token, the scores are matrix-vector shaped and computed as a
broadcast-multiply-reduce, which XLA CPU streams over the keys once), larger when steps carry prefill chunks
(the scores become small matmuls, and the keys of a chunk are gathered once per block, not once per token).
Work is proportional to the pages in `page_indices`: the caller may cut the table to a page-count bucket.

Padding (rows >= num_seqs, tokens past cu_q_lens[num_seqs], page slots past a sequence's kv_len) never reaches
a live token: scores are masked with a finite value before the softmax and masked values are zeroed, so even
NaN in unused cache memory stays out. Tokens that belong to no live sequence get zeros.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, as the TPU kernel's: a fully masked row stays finite
BLOCK_Q_CHOICES = (1, 2, 4, 8, 16, 32, 64)
# Relative cost of gathering one item's keys and values against computing one query row over them; picks
# block_q (`choose_block_q`). Measured order of magnitude on XLA CPU; the choice is flat around it.
_ITEM_COST_ROWS = 16


def work_items(num_tokens: int, max_seqs: int, block_q: int) -> int:
    """Static bound on the (sequence, query block) work items of a step with `num_tokens` tokens over at most
    `max_seqs` live sequences (each live sequence has at least one token)."""
    live = min(max_seqs, num_tokens)
    return max(1, min(num_tokens, (num_tokens + live * (block_q - 1)) // block_q))


def choose_block_q(num_tokens: int, max_seqs: int) -> int:
    """The query block that minimises (items x (item cost + rows)) for these static shapes: 1 when every
    sequence can have only one token (a decode step), larger as the tokens per sequence grow."""
    def cost(b: int) -> int:
        return work_items(num_tokens, max_seqs, b) * (_ITEM_COST_ROWS + b)

    return min((b for b in BLOCK_Q_CHOICES if b <= max(1, num_tokens)), key=cost)


def check_inputs(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array, page_indices: jax.Array,
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


def ragged_paged_attention(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array, page_indices: jax.Array,
                           cu_q_lens: jax.Array, num_seqs: jax.Array, *, sm_scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           block_q: int | None = None) -> jax.Array:
    """q [T, Hq, D], kv_pages [P, page_size, 2*Hkv, D], kv_lens i32[S], page_indices i32[S, pages_per_seq],
    cu_q_lens i32[S+1] (cu_q_lens[0] = 0), num_seqs i32[1] -> out [T, Hq, D] in q's dtype.

    `block_q` overrides the static query-block choice (tests; measurements)."""
    check_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    check_options(sliding_window, soft_cap)
    t, hq, d = q.shape
    num_pages, page_size, kv2, _ = kv_pages.shape
    hkv = kv2 // 2
    g = hq // hkv
    s, pps = page_indices.shape
    span = pps * page_size
    b = choose_block_q(t, s) if block_q is None else block_q
    if b not in BLOCK_Q_CHOICES:
        raise ValueError(f"ragged_paged_attention: block_q must be one of {BLOCK_Q_CHOICES}, got {b}")
    w = work_items(t, s, b)

    # -- the ragged layout, sanitised: rows >= num_seqs have no tokens and no keys
    live = jnp.arange(s, dtype=jnp.int32) < num_seqs[0]
    total = cu_q_lens[jnp.clip(num_seqs[0], 0, s)]
    starts = jnp.where(live, cu_q_lens[:-1], total)
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    lens = jnp.where(live, kv_lens, 0)
    items_per_seq = (q_lens + b - 1) // b
    item_end = jnp.cumsum(items_per_seq)
    item_start = item_end - items_per_seq

    # -- work items: sequence, first query row, which of its rows are live
    wid = jnp.arange(w, dtype=jnp.int32)
    seq_w = jnp.minimum(jnp.sum(item_end[None, :] <= wid[:, None], axis=1, dtype=jnp.int32), s - 1)
    valid_w = wid < item_end[-1]
    row0_w = (wid - item_start[seq_w]) * b                                     # first row within its sequence
    rows_wb = row0_w[:, None] + jnp.arange(b, dtype=jnp.int32)[None, :]        # [W, b]
    row_ok_wb = valid_w[:, None] & (rows_wb < q_lens[seq_w][:, None])
    tok_wb = jnp.clip(starts[seq_w][:, None] + rows_wb, 0, t - 1)
    qpos_wb = lens[seq_w][:, None] - q_lens[seq_w][:, None] + rows_wb          # cache position of each row

    # -- keys: the item's sequence pages, gathered once per item; masks from positions
    pages_w = jnp.clip(page_indices[seq_w], 0, num_pages - 1)                # [W, pps]
    kv = jnp.take(kv_pages, pages_w.reshape(-1), axis=0, mode="clip")
    kv = kv.reshape(w, span, hkv, 2, d)
    k_wlkd, v_wlkd = kv[:, :, :, 0], kv[:, :, :, 1]
    kpos = jnp.arange(span, dtype=jnp.int32)
    mask_wbl = (kpos[None, None, :] <= qpos_wb[:, :, None]) & row_ok_wb[:, :, None]
    if sliding_window is not None:
        mask_wbl &= kpos[None, None, :] > qpos_wb[:, :, None] - sliding_window
    key_ok_wl = kpos[None, :] < lens[seq_w][:, None]                         # zero values never written

    q_wbkgd = jnp.take(q, tok_wb.reshape(-1), axis=0).reshape(w, b, hkv, g, d).astype(jnp.float32)
    if b == 1:
        out_wbkgd = _attend_rows(q_wbkgd[:, 0], k_wlkd, v_wlkd, mask_wbl[:, 0], key_ok_wl, sm_scale,
                                 soft_cap)[:, None]
    else:
        out_wbkgd = _attend_blocks(q_wbkgd, k_wlkd, v_wlkd, mask_wbl, key_ok_wl, sm_scale, soft_cap)

    # -- back to token order: each live token lives in exactly one item row
    tid = jnp.arange(t, dtype=jnp.int32)
    seq_t = jnp.minimum(jnp.sum((starts + q_lens)[None, :] <= tid[:, None], axis=1, dtype=jnp.int32), s - 1)
    valid_t = tid < total
    off_t = tid - starts[seq_t]
    item_t = jnp.clip(item_start[seq_t] + off_t // b, 0, w - 1)
    flat = out_wbkgd.reshape(w * b, hq, d)
    out = jnp.take(flat, item_t * b + off_t % b, axis=0, mode="clip")
    return jnp.where(valid_t[:, None, None], out, 0.0).astype(q.dtype)


def _cap(scores: jax.Array, sm_scale: float, soft_cap: float | None) -> jax.Array:
    scores = scores * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    return scores


def _attend_rows(q_wkgd: jax.Array, k_wlkd: jax.Array, v_wlkd: jax.Array, mask_wl: jax.Array,
                 key_ok_wl: jax.Array, sm_scale: float, soft_cap: float | None) -> jax.Array:
    """One query row per item: broadcast-multiply-reduce (matrix-vector shaped; XLA CPU streams k and v once
    and reduces along their minor axis) -> [W, Hkv, G, D] float32."""
    k = k_wlkd.astype(jnp.float32)[:, :, :, None, :]                         # [W, L, K, 1, D]
    scores = _cap(jnp.sum(q_wkgd[:, None] * k, axis=-1), sm_scale, soft_cap)  # [W, L, K, G]
    scores = jnp.where(mask_wl[:, :, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=1)
    v = jnp.where(key_ok_wl[:, :, None, None], v_wlkd.astype(jnp.float32), 0.0)
    return jnp.sum(probs[..., None] * v[:, :, :, None, :], axis=1)           # [W, K, G, D]


def _attend_blocks(q_wbkgd: jax.Array, k_wlkd: jax.Array, v_wlkd: jax.Array, mask_wbl: jax.Array,
                   key_ok_wl: jax.Array, sm_scale: float, soft_cap: float | None) -> jax.Array:
    """A block of query rows per item: two batched matmuls per (item, kv head) -> [W, b, Hkv, G, D] float32."""
    k = k_wlkd.astype(jnp.float32)
    scores = _cap(jnp.einsum("wbkgd,wlkd->wkgbl", q_wbkgd, k), sm_scale, soft_cap)
    scores = jnp.where(mask_wbl[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    v = jnp.where(key_ok_wl[:, :, None, None], v_wlkd.astype(jnp.float32), 0.0)
    return jnp.einsum("wkgbl,wlkd->wbkgd", probs, v)


def dense_reference(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array, page_indices: jax.Array,
                    cu_q_lens: jax.Array, num_seqs: int, *, sm_scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None) -> jax.Array:
    """The plain definition, one sequence at a time in Python (concrete inputs only; tests): -> [T, Hq, D]
    float32, zeros for tokens of no live sequence."""
    t, hq, d = q.shape
    hkv = kv_pages.shape[2] // 2
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
