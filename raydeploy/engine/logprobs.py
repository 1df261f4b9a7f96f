"""Log-probabilities beyond the sampled token's, computed inside the step program: the most likely alternatives of
each sampled token, and the logprob of every prompt token (prompt logprobs, `echo`).

Which distribution: the raw model's, temperature 1, before any penalty, logit bias, filter or allowed-token mask,
the one the sampled token's own logprob is reported under (`raydeploy.engine.sampling.sample`), as vLLM reports
by default. So the alternatives of a greedy row start with the token it drew, and a sampled, penalised or
constrained row's alternatives are the model's opinion, not what it could draw.

Cost: both are skipped on a replicated flag of the step (`any_top_logprobs`, `any_prompt_logprobs`): a `lax.cond`,
or for the places on an accelerator a loop of zero blocks (`place_logprobs`), so a step where no row asks computes
nothing and returns zeros of a fixed, small shape (the host reads them only when a row asked). Alternatives are a `lax.top_k` of the rows' logits (over chunks of a vocabulary sharded over
devices, as the sampler's candidates: `raydeploy.engine.sampling.chunks_for_shards`). Prompt logprobs need the LM
head at every token place of the step, not only at each row's last: it runs over blocks of places (a `lax.map`;
`place_block`: 128 places on CPU, 16 on accelerators), so the [places, vocab] logits never exist whole (a
1024-place chunk of a 128k vocabulary would be 512 MB in float32); each block leaves [block, 2 + 2K] numbers. A
step of no more places than a block calls the LM head once, without the loop.

Results are packed as float32 rows (token ids as their int32 bits, as the step's tokens are), laid out like the
step's other results: `[2K, G*R]` per pass for the rows' alternatives (K ids then K logprobs), `[2 + 2K, G*T]`
for the places (logprob of the next token, its rank, K ids, K logprobs).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from raydeploy.engine.step import MAX_TOP_LOGPROBS

PLACE_BLOCK = 128
"""Token places whose logits one block of the prompt-logprob scan holds at once ([block, vocab] float32), on CPU."""

ACCELERATOR_PLACE_BLOCK = 16
"""The same on a TPU or GPU, where the block's logits are temporaries of every step program with prompt chunks:
Llama-3-8B on a v5e-16 (dp 4, vocabulary over tp 4) took +390 MB of temporaries per chip in its 256-place step
with blocks of 128 (the block's logits gathered whole on each chip, float32 copies around them)."""


def place_block(platform: str) -> int:
    """Places per block of `place_logprobs` on `platform` (jax's platform name)."""
    return PLACE_BLOCK if platform == "cpu" else ACCELERATOR_PLACE_BLOCK

PLACE_COLUMNS = 2 + 2 * MAX_TOP_LOGPROBS
"""Rows of the per-place result: next token's logprob, its rank, K ids, K logprobs."""

ROW_COLUMNS = 2 * MAX_TOP_LOGPROBS
"""Rows of the per-row result: K ids, K logprobs."""


def top_k_chunked(x_bv: jax.Array, k: int, chunks: int = 1) -> tuple[jax.Array, jax.Array]:
    """The k largest values of each row of x [B, V] and their indices, descending (ties: the lower index first);
    over `chunks` chunks of the vocabulary first when it is sharded, so only chunks x k candidates per row move."""
    b, v = x_bv.shape
    if chunks <= 1 or v < chunks * k:
        return jax.lax.top_k(x_bv, k)
    pad = (-v) % chunks
    xp = jnp.pad(x_bv, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else x_bv
    width = (v + pad) // chunks
    vals, idx = jax.lax.top_k(xp.reshape(b, chunks, width), k)  # [B, chunks, k]
    # the candidates' ids travel as float32 bits beside their values: when the chunks lie on different devices
    # only float32 candidates cross between them (no int32 collective)
    idx = _bits(idx + (jnp.arange(chunks, dtype=idx.dtype) * width)[None, :, None])
    best, where = jax.lax.top_k(vals.reshape(b, chunks * k), k)
    ids = jnp.take_along_axis(idx.reshape(b, chunks * k), where, axis=-1)
    return best, jax.lax.bitcast_convert_type(ids, jnp.int32)


def _bits(ids: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(ids.astype(jnp.int32), jnp.float32)


def row_alternatives(logits_bv: jax.Array, k: int = MAX_TOP_LOGPROBS, chunks: int = 1) -> jax.Array:
    """[B, 2k] float32: each row's k most likely tokens (int32 bits) then their logprobs, under the raw
    distribution of `logits_bv`, most likely first."""
    x = logits_bv.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=-1)
    vals, ids = top_k_chunked(x, k, chunks)
    return jnp.concatenate([_bits(ids), vals - lse[:, None]], axis=-1)


def place_logprobs(h_gtd: jax.Array, targets_gt: jax.Array, logits_fn: Callable[[jax.Array], jax.Array], *,
                   k: int = MAX_TOP_LOGPROBS, chunks: int = 1, block: int = PLACE_BLOCK,
                   active: jax.Array | None = None,
                   rowwise: Callable[[Callable[..., jax.Array]], Callable[..., jax.Array]] | None = None) -> jax.Array:
    """[2 + 2k, G*T] float32 for hidden states h [G, T, D] (G dp groups of T places) and each place's target (the
    token after it; any id where none): the target's logprob, its rank (1 + the tokens of larger logit) as
    float32, the k most likely tokens (int32 bits) and their logprobs. The LM head (`logits_fn`: [N, D] ->
    float32 [N, V]) runs over blocks of `block` places of every group at once (a `lax.map`): only [G * block, V]
    logits at a time, and the groups' rows stay on their devices. `active` (a scalar bool; None: true): when false
    the loop runs no block and the result is zeros. That is how a step on an accelerator without prompt logprobs
    skips them: a `lax.cond` around the LM head instead passed its weight into the conditional, which XLA TPU
    copied (+262 MB of temporaries per chip, Llama-3-8B on a v5e-16); a loop of zero iterations holds it as a loop
    operand, uncopied, as a `lax.map` does. (On XLA CPU the cond is free and the loop form is not: the step body
    chooses by platform.)"""
    g, t, d = h_gtd.shape
    b = min(block, t)
    n = -(-t // b)
    pad = n * b - t
    if pad:
        h_gtd = jnp.pad(h_gtd, ((0, 0), (0, pad), (0, 0)))
        targets_gt = jnp.pad(targets_gt, ((0, 0), (0, pad)))
    hb = h_gtd.reshape(g, n, b, d).transpose(1, 0, 2, 3)  # [n, G, b, D]
    tb = targets_gt.reshape(g, n, b).transpose(1, 0, 2)

    def stats(x: jax.Array, target: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)  # [N, V]
        lse = jax.nn.logsumexp(x, axis=-1)
        # the target's logit as a masked sum, not a gather: over a vocabulary sharded across devices it is a
        # reduction of [N] numbers, where a gather would bring the block's logits together
        hit = jnp.arange(x.shape[-1], dtype=jnp.int32)[None, :] == target[:, None]
        chosen = jnp.sum(jnp.where(hit, x, 0.0), axis=-1)
        rank = 1 + jnp.sum(x > chosen[:, None], axis=-1)
        vals, ids = top_k_chunked(x, k, chunks)
        return jnp.concatenate([(chosen - lse)[:, None], rank.astype(jnp.float32)[:, None], _bits(ids),
                                vals - lse[:, None]], axis=-1)

    # `rowwise` wraps the per-row statistics (the step: once per dp group, so no group's logits cross to another)
    per_rows = stats if rowwise is None else rowwise(stats)

    def one(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        h, target = args
        out = per_rows(logits_fn(h.reshape(g * b, d)), target.reshape(-1))  # the LM head: [G*b, V]
        return out.reshape(g, b, 2 + 2 * k)

    if active is None:
        out = jax.lax.map(one, (hb, tb))  # [n, G, b, C]
    else:
        def body(i: jax.Array, acc: jax.Array) -> jax.Array:
            return jax.lax.dynamic_update_index_in_dim(acc, one((hb[i], tb[i])), i, 0)

        out = jax.lax.fori_loop(0, jnp.where(active, n, 0), body,
                                jnp.zeros((n, g, b, 2 + 2 * k), jnp.float32))
    out = out.transpose(1, 0, 2, 3).reshape(g, n * b, 2 + 2 * k)[:, :t]
    return out.reshape(g * t, 2 + 2 * k).T


def prompt_targets(tokens_t: jax.Array, logit_index_r: jax.Array, next_token_r: jax.Array) -> jax.Array:
    """One group's target per place: the token at the next place, and at each row's last place the prompt token
    after its chunk (`next_token`; rows without one, -1, keep whatever follows: the host drops that place)."""
    t = tokens_t.shape[0]
    out = jnp.roll(tokens_t, -1)
    idx = jnp.where(next_token_r >= 0, logit_index_r, t)
    return out.at[idx].set(next_token_r, mode="drop")
