"""Per-slot token sampling, vectorised over slots, inside the engine's jitted programs.

The sampler reads the one sampling type, `SamplingParams` (`raydeploy.engine.step`), with one array per field
(a value per row, from each request's params): this module registers it as a pytree, so it passes through
`jit` and `shard_map` by its field names, and one compiled program serves any mix of greedy and sampled
requests. `RowSampling` is a step's sampling rows: those params, their logit-bias tables, each row's slot and
the position its token takes. Order follows vLLM's: the allowed-token mask, logit_bias, the repetition penalty,
OpenAI's frequency and presence penalties (over generated tokens, counted in each slot's token state:
`STATE_DTYPE`), temperature, then top-k, top-p and min_p. Randomness is a pure function of the request's 64-bit
seed and the token's position (`row_keys`: `fold_in(key(seed), position)`, the key threefry makes of a 64-bit
seed), so every host of a gang draws the same token and a request replays identically
whatever else shares the batch.
The reported logprob is the chosen token's log-probability under the raw model distribution
(temperature 1, no filters, no penalty, and no allowed-token mask).

A constrained row (structured outputs) carries its allowed tokens as packed bits (`SeqStep.allowed`'s layout);
`apply_allowed` sets every other token's logit to -inf before anything else, so the penalty, temperature, top-k,
top-p and the greedy argmax all choose among the allowed tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from raydeploy.engine.step import MAX_LOGIT_BIAS, SamplingParams

SEED_MODULUS = 2**64
"""Seeds are reduced modulo 2**64 and travel as two uint32 words (`seed_words`); any integer seed is accepted."""

ROW_DTYPES: dict[str, np.dtype[Any]] = {
    "temperature": np.dtype(np.float32), "top_p": np.dtype(np.float32), "top_k": np.dtype(np.int32),
    "repetition_penalty": np.dtype(np.float32), "seed": np.dtype(np.uint32),
    "presence_penalty": np.dtype(np.float32), "frequency_penalty": np.dtype(np.float32),
    "min_p": np.dtype(np.float32)}
"""Each scalar `SamplingParams` field's dtype as a per-row array (a new field adds its dtype here)."""
ROW_WIDTHS: dict[str, tuple[int, ...]] = {"seed": (2,)}
"""Trailing shape of a field's per-row array where it is not a scalar: the seed's (low, high) words."""
HOST_FIELDS = ("logit_bias", "min_tokens")
"""`SamplingParams` fields that are not one array per field inside the programs: logit_bias becomes each row's
`LogitBiasRows`, min_tokens a ban in the row's allowed-token bits (`raydeploy.engine.kv_cache.build_inputs`).
In the programs' pytree they are static fields that keep their neutral values."""
if set(ROW_DTYPES) | set(HOST_FIELDS) != {f.name for f in fields(SamplingParams)}:
    raise TypeError(f"ROW_DTYPES {sorted(ROW_DTYPES)} and HOST_FIELDS {HOST_FIELDS} must name every "
                    f"SamplingParams field once")

jax.tree_util.register_dataclass(SamplingParams, data_fields=list(ROW_DTYPES), meta_fields=list(HOST_FIELDS))

NEUTRAL = SamplingParams()
"""What a row that does not sample holds: greedy, no filter, no penalty."""


def seed_words(seed: int) -> np.ndarray:
    """A seed as the (low, high) uint32 words of its value modulo 2**64."""
    s = int(seed) % SEED_MODULUS
    return np.asarray([s & 0xFFFFFFFF, s >> 32], np.uint32)


def row_value(params: SamplingParams, name: str) -> Any:
    """One field of a request's params as its row holds it (the seed as its two words)."""
    value = getattr(params, name)
    return seed_words(value) if name == "seed" else value


BIAS_PAD = np.iinfo(np.int32).max
"""The token id of an unused table entry: past any vocabulary, so its scatter is dropped."""
BAN = -100.0
"""A logit_bias value that bans its token exactly (-inf), as OpenAI's -100 does in practice."""


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LogitBiasRows:
    """Each row's logit_bias as a fixed-width table, [B, MAX_LOGIT_BIAS] token ids (int32; `BIAS_PAD` where
    unused) and values (float32; -inf for a ban), added to the logits before the penalties."""

    ids: jax.Array
    values: jax.Array


def bias_table(params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """One request's (ids, values) row of `LogitBiasRows` (-100 as -inf, unused entries padding)."""
    ids = np.full(MAX_LOGIT_BIAS, BIAS_PAD, np.int32)
    values = np.zeros(MAX_LOGIT_BIAS, np.float32)
    n = len(params.logit_bias)
    if n > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {n} entries, a row holds at most {MAX_LOGIT_BIAS}")
    if n:
        pairs = np.asarray(params.logit_bias, np.float64)
        ids[:n] = pairs[:, 0]
        values[:n] = np.where(pairs[:, 1] <= BAN, -np.inf, pairs[:, 1])
    return ids, values


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RowSampling:
    """A step's sampling rows, each field an array with one value per sequence row ([G*R], laid out by dp group
    as the step's rows): the global slot a row's token goes to (`max_slots` for a row that does not sample),
    the position that token takes (its randomness key), the request's `SamplingParams` and its logit-bias
    table."""

    slot: jax.Array
    position: jax.Array
    params: SamplingParams
    bias: LogitBiasRows


BITS = 32
"""Tokens per word of a packed allowed-token mask (uint32 words; token i is bit i % 32 of word i // 32)."""


def mask_words(vocab: int) -> int:
    """Words of a packed allowed-token mask over a vocabulary of `vocab` tokens."""
    return -(-vocab // BITS)


def apply_allowed(logits_bv: jax.Array, allowed_bw: jax.Array) -> jax.Array:
    """logits [B, V] with every token whose bit in `allowed_bw` (uint32 [B, ceil(V / 32)]) is clear set to -inf.

    The bits unpack by shifts of each word (no gather) and the select fuses into the sampler's first elementwise
    pass over the logits (no [B, V] mask of its own is kept); the logits keep their layout (a vocabulary
    sharded over devices stays sharded: no collective moves the mask)."""
    b, v = logits_bv.shape
    shifts = jnp.arange(BITS, dtype=jnp.uint32)
    bits = (allowed_bw.astype(jnp.uint32)[:, :, None] >> shifts[None, None, :]) & jnp.uint32(1)
    keep = bits.reshape(b, -1)[:, :v] != 0
    return jnp.where(keep, logits_bv, -jnp.inf)


STATE_DTYPE = jnp.uint8
"""The per-slot token state [slots, vocab]: bit 0 says the token is in the sequence (prompt or generated: the
repetition penalty's set), bits 1-7 count the times the request generated it (the frequency and presence
penalties'), saturating at `COUNT_MAX`. One byte per token as the bool set took before: 128 KiB a slot at a 128k
vocabulary, 32 MiB for 256 slots, nothing more for the counts. The saturation changes nothing that matters: at
the largest |frequency_penalty| of 2, 127 repeats already move a logit by 254."""
COUNT_MAX = 127


def token_state(state_bv: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(in the sequence [B, V] bool, generated count [B, V] float32) of a `STATE_DTYPE` state (a bool set: no
    counts)."""
    if state_bv.dtype == jnp.bool_:
        return state_bv, jnp.zeros(state_bv.shape, jnp.float32)
    return (state_bv & 1) != 0, (state_bv >> 1).astype(jnp.float32)


def note_in_sequence(state: jax.Array, slot: jax.Array, tokens: jax.Array) -> jax.Array:
    """State [slots, V] with `tokens` at `slot` marked as in the sequence (out of range slots dropped). A token
    with a count is marked already, so the byte is 0 or odd, and max(byte, 1) sets bit 0."""
    return state.at[slot, tokens].max(jnp.asarray(1, state.dtype), mode="drop")


def note_generated(state: jax.Array, slot: jax.Array, tokens: jax.Array) -> jax.Array:
    """State [slots, V] with each row's drawn token (one per slot, out of range slots dropped) in the sequence
    and counted once more (saturating at `COUNT_MAX`)."""
    old = state[jnp.minimum(slot, state.shape[0] - 1), tokens].astype(jnp.int32)
    new = jnp.minimum(old + 2, 2 * COUNT_MAX) | 1
    return state.at[slot, tokens].set(new.astype(state.dtype), mode="drop")


def apply_repetition_penalty(logits_bv: jax.Array, presence_bv: jax.Array, penalty_b: jax.Array) -> jax.Array:
    """CTRL-style penalty on tokens already in the sequence: positive logits / p, negative logits * p."""
    p = penalty_b[:, None]
    penalised = jnp.where(logits_bv > 0, logits_bv / p, logits_bv * p)
    return jnp.where(presence_bv, penalised, logits_bv)


def apply_logit_bias(logits_bv: jax.Array, bias: LogitBiasRows) -> jax.Array:
    """logits + each row's bias table (a scatter-add of [B, K]; padding ids are dropped, a ban is -inf)."""
    rows = jnp.broadcast_to(jnp.arange(logits_bv.shape[0])[:, None], bias.ids.shape)
    return logits_bv.at[rows, bias.ids].add(bias.values, mode="drop")


def apply_penalties(logits_bv: jax.Array, counts_bv: jax.Array, presence_b: jax.Array, frequency_b: jax.Array
                    ) -> jax.Array:
    """OpenAI's penalties over generated tokens: logit -= frequency * count + presence * (count > 0)."""
    return logits_bv - frequency_b[:, None] * counts_bv - presence_b[:, None] * (counts_bv > 0)


def min_p_mask(logits_bv: jax.Array, min_p_b: jax.Array) -> jax.Array:
    """Tokens whose probability is at least min_p times the row's largest (0 keeps all): in logits,
    logit >= max logit + log(min_p), no softmax needed (the ratio of two probabilities)."""
    top = jnp.max(logits_bv, axis=-1, keepdims=True)
    return logits_bv >= top + jnp.log(min_p_b)[:, None]


BISECTION_STEPS = 40
"""Halvings of a row's logit range when searching a threshold: 40 resolve any float32 gap that matters."""


def _bisect_threshold(lo_b: jax.Array, hi_b: jax.Array, enough: Any) -> jax.Array:
    """Largest t in [lo, hi] (per row) with enough(t) true, for a predicate that is true at lo and
    monotone (true below some point, false above): a fixed number of halvings inside one loop."""

    def step(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = (lo + hi) / 2
        ok = enough(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, BISECTION_STEPS, step, (lo_b, hi_b))
    return lo


TOP_K_CANDIDATES = 128
"""Candidates taken from each row with `lax.top_k`: top-k values up to this, and top-p without top-k whenever
these candidates hold at least p of the row's mass (nearly always, for a trained model), get their thresholds
from the candidates alone; larger top-k values, and top-p over a flatter distribution, search thresholds by
bisection (`_bisection_mask`)."""


def top_k_top_p_mask(logits_bv: jax.Array, top_k_b: jax.Array, top_p_b: jax.Array,
                     vocab_chunks: int = 1, any_filtered: jax.Array | None = None,
                     min_p_b: jax.Array | None = None) -> jax.Array:
    """Boolean mask of the tokens kept by top-k (0 = off) then top-p (1 = off), per row: top-k keeps the
    logits at or above the k-th largest, top-p the smallest prefix of the renormalised top-k distribution
    whose mass reaches p (as in Hugging Face). Ties at a threshold are all kept.

    Never a sort of the vocabulary, and nothing at all when no row filters. Otherwise the `TOP_K_CANDIDATES`
    largest logits of each row (`lax.top_k`; over `vocab_chunks` chunks first when the vocabulary is sharded,
    `_top_values`) give the thresholds when every filtering row has a top-k of at most that many, or no top-k
    and a top-p those candidates reach; else a bisection over the row's logit range with reductions only. A
    full-vocabulary sort cost most of a TPU program's compile time (Llama-3-8B decode on v5e: 25.7 s with the
    sort, 3.2 s without) and is slow to run there. `any_filtered` (scalar bool): whether some row filters, when
    the caller knows it from replicated inputs (as `sample`'s `any_sampled`).

    `min_p_b` (0 = off) keeps, besides, only tokens at least min_p times as likely as the row's top one
    (`min_p_mask`), in vLLM's (V0) order: top-k, top-p, then min_p. min_p's set depends only on each token's
    ratio to the top token, the same before or after top-k / top-p renormalise, so the three masks intersect;
    top-p's mass is the distribution's before min_p. It runs under the same `lax.cond` (`any_filtered` counts a
    min_p row).
    """
    v = logits_bv.shape[-1]
    x = logits_bv.astype(jnp.float32)
    k = jnp.where((top_k_b <= 0) | (top_k_b > v), v, top_k_b).astype(jnp.int32)
    c = min(TOP_K_CANDIDATES, v)

    def filtered() -> jax.Array:
        vals = _top_values(x, c, vocab_chunks)  # [B, c], descending
        lse = jax.nn.logsumexp(x, axis=-1)
        mass = jnp.sum(jnp.exp(vals - lse[:, None]), axis=-1)  # the candidates' share of the whole row
        from_candidates = jnp.all((k <= c) | ((k >= v) & ((top_p_b >= 1.0) | (mass >= top_p_b))))
        mask = jax.lax.cond(from_candidates, lambda: _candidate_mask(x, k, top_p_b, vals, lse),
                            lambda: _bisection_mask(x, k, top_p_b))
        return mask if min_p_b is None else mask & min_p_mask(x, min_p_b)

    some = jnp.any((k < v) | (top_p_b < 1.0) | (False if min_p_b is None else jnp.any(min_p_b > 0))
                   ) if any_filtered is None else any_filtered
    return jax.lax.cond(some, filtered, lambda: jnp.ones(x.shape, bool))


def _candidate_mask(x: jax.Array, k: jax.Array, top_p_b: jax.Array, vals: jax.Array, lse: jax.Array
                    ) -> jax.Array:
    """Thresholds from each row's c largest logits `vals` (descending) and log-sum-exp `lse`: rows with
    c < k < v must not filter, rows without top-k (k = v) must reach their top-p within the candidates."""
    v = x.shape[-1]
    c = vals.shape[-1]
    kk = jnp.minimum(k, c)
    idx = jnp.arange(c)[None, :]
    kth = jnp.take_along_axis(vals, (kk - 1)[:, None], axis=-1)[:, 0]
    kth = jnp.where(k >= v, -jnp.inf, kth)
    in_k = idx < kk[:, None]
    # top-p's distribution: the renormalised top-k one, or without top-k the whole row's
    probs = jnp.where((k >= v)[:, None], jnp.exp(vals - lse[:, None]),
                      jax.nn.softmax(jnp.where(in_k, vals, -jnp.inf), axis=-1))
    before = jnp.cumsum(probs, axis=-1) - probs
    n = jnp.maximum(jnp.sum((before < top_p_b[:, None]) & in_k, axis=-1), 1)
    pth = jnp.take_along_axis(vals, (n - 1)[:, None], axis=-1)[:, 0]
    pth = jnp.where(top_p_b >= 1.0, -jnp.inf, pth)
    return x >= jnp.maximum(kth, pth)[:, None]


TOP_K_CHUNKS = 16
"""Chunks of a sharded vocabulary for `lax.top_k`: each chunk's candidates first, then the best of those, so a
vocabulary sharded over tensor parallelism (any shard count dividing it) exchanges only chunks x candidates per
row, never the logits themselves (the logits keep the LM head's vocabulary sharding). An unsharded vocabulary
takes one `lax.top_k` (5x faster on XLA CPU)."""


def chunks_for_shards(vocab_shards: int) -> int:
    """How many chunks `_top_values` cuts a vocabulary of `vocab_shards` shards into."""
    return 1 if vocab_shards <= 1 else TOP_K_CHUNKS


def _top_values(x: jax.Array, c: int, chunks: int = 1) -> jax.Array:
    """The c largest values of each row of x [B, V], descending (over `chunks` chunks first)."""
    b, v = x.shape
    n = chunks
    if n <= 1 or v < n * c:
        return jax.lax.top_k(x, c)[0]
    pad = (-v) % n
    xp = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else x
    per_chunk = jax.lax.top_k(xp.reshape(b, n, (v + pad) // n), c)[0]  # [B, n, c]
    return jax.lax.top_k(per_chunk.reshape(b, n * c), c)[0]


def _bisection_mask(x: jax.Array, k: jax.Array, top_p_b: jax.Array) -> jax.Array:
    """Thresholds by bisection: the top-k threshold is the largest value with at least k logits at or above
    it; the top-p threshold the largest with at least p of the top-k distribution's mass at or above it."""
    v = x.shape[-1]
    hi = jnp.max(x, axis=-1)
    lo = jnp.min(jnp.where(jnp.isfinite(x), x, hi[:, None]), axis=-1)  # masked-out tokens (-inf) bound nothing
    kth = _bisect_threshold(lo, hi, lambda t: jnp.sum(x >= t[:, None], axis=-1) >= k)
    kth = jnp.where(k >= v, lo, kth)
    in_top_k = x >= kth[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, x, -jnp.inf), axis=-1)
    # thresholds on probabilities of the top-k distribution, searched in logit space (same order)
    pth = _bisect_threshold(kth, hi, lambda t: jnp.sum(jnp.where(x >= t[:, None], probs, 0.0), axis=-1)
                            >= top_p_b * (1 - 1e-6))
    pth = jnp.where(top_p_b >= 1.0, kth, pth)
    return x >= jnp.maximum(kth, pth)[:, None]


def row_keys(seed_b2: jax.Array, position_b: jax.Array) -> jax.Array:
    """One PRNG key per row from (seed, position): no state, same on every host. The seed is its (low, high)
    uint32 words [B, 2] (`seed_words`), and its key is the one threefry makes of a 64-bit seed (what
    `jax.random.key(seed)` gives with 64-bit types: the words [high, low]), so a seed below 2**32 keeps the key
    it always had (`key(seed)` is [0, seed]) and seeds 2**32 apart differ, with no hashing beyond a 32-bit
    seed's (folding the high word in would cost a threefry hash per row)."""
    data = jnp.stack([seed_b2[:, 1], seed_b2[:, 0]], axis=-1).astype(jnp.uint32)
    keys = jax.random.wrap_key_data(data, impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, position_b)


def _sample_filtered(logits_bv: jax.Array, params: SamplingParams, position_b: jax.Array, vocab_chunks: int,
                     any_filtered: jax.Array | None) -> jax.Array:
    scaled = logits_bv / jnp.maximum(jnp.asarray(params.temperature), 1e-6)[:, None]
    mask = top_k_top_p_mask(scaled, jnp.asarray(params.top_k), jnp.asarray(params.top_p), vocab_chunks,
                            any_filtered, jnp.asarray(params.min_p))
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits_bv.shape[-1],), jnp.float32))(
        row_keys(jnp.asarray(params.seed), position_b))
    return _first_argmax(jnp.where(mask, scaled + gumbel, -jnp.inf))


def _first_argmax(x_bv: jax.Array) -> jax.Array:
    """`jnp.argmax` over the last axis (the first index of the largest value) as two plain reductions: XLA CPU
    fuses the Gumbel noise's logarithms into an argmax's paired (value, index) reduction and runs them
    unvectorised there (7 ms of a 10 ms sample of 8 rows over 49152 tokens, against 0.3 ms this way). Greedy rows
    too: a plain `jnp.argmax` of 8 rows over 49152 logits is a paired reduction (1.5 ms a pass in a per-op profile
    of one thread; end to end the one-thread 8-row decode gained ~1%, 146.8 -> 148.0 tok/s)."""
    v = x_bv.shape[-1]
    top = jnp.max(x_bv, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(x_bv >= top, jnp.arange(v, dtype=jnp.int32)[None, :], v), axis=-1)
    return jnp.minimum(first, v - 1).astype(jnp.int32)


def sample(logits_bv: jax.Array, presence_bv: jax.Array, params: SamplingParams, position_b: jax.Array, *,
           any_sampled: jax.Array | None = None, any_filtered: jax.Array | None = None, vocab_chunks: int = 1,
           allowed_bw: jax.Array | None = None, bias: LogitBiasRows | None = None,
           any_adjusted: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Next token [B] int32 and its raw logprob [B] float32, for rows sampling with `params` (each field [B]) at
    `position_b` (the positions the tokens take). temperature 0 is greedy (argmax after penalty).

    The filters run only when some row samples (lax.cond), so all-greedy batches stay cheap.
    `any_sampled` (scalar bool) is that condition when the caller knows it from replicated inputs; computing
    it from rows that are sharded over devices would cost a cross-device reduction every step; `any_filtered`
    likewise says whether some sampling row has a top-k or top-p (the mask is skipped when none has).
    `vocab_chunks` (static): `chunks_for_shards(shards)` of a vocabulary sharded over devices, else 1.

    `allowed_bw` (uint32 [B, ceil(V / 32)], packed bits; None: every token) restricts each row's draw to its
    allowed tokens, applied first (`apply_allowed`), before the penalty, temperature, top-k, top-p and greedy;
    an unconstrained row holds all ones. It is applied always, not under a `lax.cond` on whether some row is
    constrained: fused into the penalty's pass it costs nothing measurable (XLA CPU, 8 rows x 49152: 0.28 ms a
    sample with or without it), while a cond's result is a [B, V] buffer of its own (Llama-3-8B on a v5e-16:
    +8.3 MB of temporaries per chip for 16 rows, against +0.9 MB peak without) and on a GPU a cond waits on its
    predicate. The logprob stays the raw model distribution's (the mask does not renormalise it), like the
    penalty and the filters.

    `presence_bv`: each row's slot state (`STATE_DTYPE`: in-sequence bit and generated counts; a bool set has no
    counts). After the mask come, in vLLM's order, the logit bias (`bias`, the rows' tables), the repetition
    penalty, then OpenAI's frequency and presence penalties over generated tokens; the bias and those penalties
    run under one `lax.cond` on `any_adjusted` (scalar bool, replicated: some row has a bias or a penalty), so
    rows without them pay nothing but the predicate. min_p filters with top-k and top-p (`top_k_top_p_mask`).
    """
    logits_bv = logits_bv.astype(jnp.float32)
    chosen_from = logits_bv
    if allowed_bw is not None:
        chosen_from = apply_allowed(logits_bv, allowed_bw)
    in_sequence, counts = token_state(presence_bv)
    repetition = jnp.asarray(params.repetition_penalty)
    presence_p, frequency_p = jnp.asarray(params.presence_penalty), jnp.asarray(params.frequency_penalty)

    def adjusted() -> jax.Array:
        x = chosen_from if bias is None else apply_logit_bias(chosen_from, bias)
        x = apply_repetition_penalty(x, in_sequence, repetition)
        return apply_penalties(x, counts, presence_p, frequency_p)

    if any_adjusted is None:
        any_adjusted = jnp.any((presence_p != 0) | (frequency_p != 0))
        if bias is not None:
            any_adjusted = any_adjusted | jnp.any(bias.ids != BIAS_PAD)
    penalised = jax.lax.cond(any_adjusted, adjusted,
                             lambda: apply_repetition_penalty(chosen_from, in_sequence, repetition))
    greedy = _first_argmax(penalised)
    sampling = jnp.asarray(params.temperature) > 0
    tokens = jax.lax.cond(
        jnp.any(sampling) if any_sampled is None else any_sampled,
        lambda: jnp.where(sampling, _sample_filtered(penalised, params, position_b, vocab_chunks, any_filtered),
                          greedy),
        lambda: greedy,
    )
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits_bv, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
