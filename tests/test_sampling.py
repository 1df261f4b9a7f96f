"""Per-slot sampling: filters, repetition penalty, greedy, seed determinism (small vocab, one device)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raydeploy.engine.sampling import (
    ROW_DTYPES,
    apply_repetition_penalty,
    row_value,
    sample,
    top_k_top_p_mask,
)
from raydeploy.engine.step import SamplingParams

V = 16


def _logits(rows: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, V)).astype(np.float32) * 3


def test_top_k_keeps_exactly_k_per_row_and_zero_disables():
    lg = _logits(3)
    mask = np.asarray(top_k_top_p_mask(jnp.asarray(lg), jnp.asarray([1, 5, 0]), jnp.ones(3)))
    assert mask.sum(axis=1).tolist() == [1, 5, V]
    assert mask[0, lg[0].argmax()]
    assert set(np.nonzero(mask[1])[0]) == set(np.argsort(-lg[1])[:5])


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    lg = np.log(np.asarray([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)], np.float32))
    for p, kept in ((0.4, 1), (0.5, 1), (0.6, 2), (0.8, 2), (0.81, 3), (0.96, 4), (1.0, V)):
        mask = np.asarray(top_k_top_p_mask(jnp.asarray(lg), jnp.asarray([0]), jnp.asarray([p])))
        assert mask.sum() == kept, (p, mask.sum())


def test_top_k_then_top_p_combine():
    lg = np.log(np.asarray([[0.4, 0.3, 0.2, 0.1] + [1e-9] * (V - 4)], np.float32))
    # top-k 2 renormalises to 0.57 / 0.43; top-p 0.5 then keeps only the first
    mask = np.asarray(top_k_top_p_mask(jnp.asarray(lg), jnp.asarray([2]), jnp.asarray([0.5])))
    assert np.nonzero(mask[0])[0].tolist() == [0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    lg = jnp.asarray([[2.0, -2.0, 1.0, 0.5]])
    seen = jnp.asarray([[True, True, False, False]])
    out = np.asarray(apply_repetition_penalty(lg, seen, jnp.asarray([2.0])))
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]


def _sample(lg: np.ndarray, params: list[SamplingParams], positions: list[int], presence=None):
    """The sampler over rows taking `params` (one SamplingParams of per-row arrays, as a step's rows hold them)."""
    pres = jnp.zeros(lg.shape, bool) if presence is None else jnp.asarray(presence)
    rows = SamplingParams(**{n: jnp.asarray(np.asarray([row_value(p, n) for p in params], dt))
                             for n, dt in ROW_DTYPES.items()})
    tok, lp = jax.jit(sample)(jnp.asarray(lg), pres, rows, jnp.asarray(positions, jnp.int32))
    return np.asarray(tok), np.asarray(lp)


def test_greedy_rows_take_argmax_and_logprob_is_raw_log_softmax():
    lg = _logits(4)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams(), SamplingParams()]
    tok, lp = _sample(lg, params, [5, 5, 5, 5])
    for r in (0, 2, 3):
        assert tok[r] == lg[r].argmax()
    ref = jax.nn.log_softmax(jnp.asarray(lg), axis=-1)
    np.testing.assert_allclose(lp, np.asarray(ref)[np.arange(4), tok], rtol=1e-5, atol=1e-6)


def test_greedy_ties_take_the_first_index_in_both_programs():
    """Greedy is two plain reductions (max, then the first index at it), with or without sampling rows beside:
    a tie resolves to the lowest token id, as numpy's argmax."""
    lg = _logits(3)
    lg[0, 3] = lg[0, 12] = lg[0].max() + 1.0  # a tie for the top
    lg[1, :] = 0.5  # every token tied
    lg[2, 5] = lg[2, 4] = lg[2].max() + 2.0
    for params in ([SamplingParams()] * 3, [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0)]):
        tok, _ = _sample(lg, params, [0, 0, 0])
        assert tok[0] == 3 and tok[1] == 0
        if params[2].temperature == 0:
            assert tok[2] == 4


def test_greedy_with_repetition_penalty_avoids_a_seen_token():
    lg = np.zeros((1, V), np.float32)
    lg[0, 3], lg[0, 7] = 2.0, 1.5
    seen = np.zeros((1, V), bool)
    seen[0, 3] = True
    tok, _ = _sample(lg, [SamplingParams(repetition_penalty=1.5)], [0], seen)
    assert tok[0] == 7
    tok, _ = _sample(lg, [SamplingParams(repetition_penalty=1.0)], [0], seen)
    assert tok[0] == 3


def test_seeded_sampling_is_a_function_of_seed_and_position_only():
    lg = np.tile(_logits(1), (4, 1)) / 3  # flat enough that draws vary
    p = SamplingParams(temperature=1.0, seed=42)
    a, _ = _sample(lg, [p, p, SamplingParams(temperature=1.0, seed=43), SamplingParams()], [7, 7, 7, 7])
    b, _ = _sample(lg, [SamplingParams(), p, p, p], [7, 7, 7, 7])
    assert a[0] == a[1] == b[1] == b[2] == b[3]  # same seed + position: same token in any row, any batch
    draws = {int(_sample(lg[:1], [p], [pos])[0][0]) for pos in range(40)}
    assert len(draws) > 3  # different positions draw differently
    seeds = {int(_sample(lg[:1], [SamplingParams(temperature=1.0, seed=s)], [7])[0][0]) for s in range(40)}
    assert len(seeds) > 3


def test_sampling_respects_top_k_over_many_draws():
    lg = _logits(1)
    allowed = set(np.argsort(-lg[0])[:3].tolist())
    got = {int(_sample(lg, [SamplingParams(temperature=5.0, top_k=3, seed=s)], [0])[0][0]) for s in range(60)}
    assert got <= allowed and len(got) >= 2


@pytest.mark.parametrize("seed", [0, 2**32 + 5, 2**40, 2**64 - 1, 2**64 + 7, -1])
def test_large_seeds_travel_as_two_words(seed):
    """A step's rows take the request's seed modulo 2**64 as its (low, high) uint32 words."""
    from raydeploy.engine.kv_cache import PageTables, build_inputs
    from raydeploy.engine.step import SeqStep

    tables = PageTables(2, 1, 4, 8)
    tables.sampling[1] = SamplingParams(temperature=1.0, seed=seed)
    host = build_inputs([SeqStep(1, np.arange(3, dtype=np.int32), 0, True)], tables, 4, 4, 2, 4)
    seeds = host.arrays["sampling.params.seed"]
    lo, hi = (int(w) for w in seeds[host.rows[0]])
    assert seeds.dtype == np.uint32 and seeds.shape == (2, 2)
    assert lo + (hi << 32) == seed % 2**64


def test_seeds_below_2_32_keep_their_keys_and_seeds_2_32_apart_differ():
    """A seed below 2**32 keys its draws as before the high word existed (fold_in(key(seed), position)); seeds
    2**32 apart (2**40 and 2**40 + 2**32 share a low word) draw differently."""
    from raydeploy.engine.sampling import row_keys, seed_words

    positions = jnp.arange(6, dtype=jnp.int32)
    for seed in (0, 7, 2**31 + 3, 2**32 - 1):
        words = jnp.asarray(np.stack([seed_words(seed)] * 6))
        got = jax.random.key_data(row_keys(words, positions))
        want = jax.random.key_data(jax.vmap(lambda p, s=seed: jax.random.fold_in(
            jax.random.key(jnp.uint32(s)), p))(positions))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"seed {seed}")
    lg = np.tile(_logits(1), (1, 1)) / 3
    a = [int(_sample(lg, [SamplingParams(temperature=1.0, seed=2**40)], [p])[0][0]) for p in range(30)]
    b = [int(_sample(lg, [SamplingParams(temperature=1.0, seed=2**40 + 2**32)], [p])[0][0]) for p in range(30)]
    c = [int(_sample(lg, [SamplingParams(temperature=1.0, seed=2**40)], [p])[0][0]) for p in range(30)]
    assert a == c and a != b


def test_step_inputs_say_whether_any_row_samples_or_filters():
    """The sampling branch and the top-k/top-p mask run on flags the host sets from the rows' parameters
    (replicated inputs), never on a reduction over rows that may sit on other devices."""
    from raydeploy.engine.kv_cache import PageTables, build_inputs
    from raydeploy.engine.step import SeqStep

    cases = [([SamplingParams(), SamplingParams(top_p=0.5)], (False, False)),  # greedy rows never filter
             ([SamplingParams(), SamplingParams(temperature=0.7)], (True, False)),
             ([SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_p=0.95)], (True, True)),
             ([SamplingParams(temperature=1.0, top_k=40), SamplingParams()], (True, True))]
    for params, want in cases:
        tables = PageTables(2, 1, 4, 8)
        for slot, sp in enumerate(params):
            tables.sampling[slot] = sp
        host = build_inputs([SeqStep(s, np.arange(3, dtype=np.int32), 0, True) for s in range(2)], tables, 8, 8, 2, 4)
        got = (bool(host.arrays["any_sampled"]), bool(host.arrays["any_filtered"]))
        assert got == want, (params, got)


def _sorted_reference_mask(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Hugging Face's order with a full sort: top-k, then the smallest prefix of the renormalised top-k
    distribution whose mass reaches top_p (ties at either threshold kept)."""
    v = logits.shape[-1]
    order = np.sort(logits)[::-1]
    k = v if top_k <= 0 or top_k > v else top_k
    kth = order[k - 1]
    kept = order[:k].astype(np.float64)
    probs = np.exp(kept - kept.max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    n = max(int(np.sum(before < top_p)), 1) if top_p < 1 else k
    return logits >= max(kth, order[n - 1])


@pytest.mark.parametrize("seed", range(6))
def test_threshold_search_equals_a_full_sort(seed):
    """The sort-free top-k / top-p thresholds keep exactly the tokens a full sort keeps, ties included."""
    rng = np.random.default_rng(seed)
    v = 5000
    lg = (rng.normal(size=(6, v)) * rng.uniform(0.5, 4)).astype(np.float32)
    lg[1, :50] = lg[1, 0]  # a tie across the top-k boundary
    lg[2] = np.round(lg[2], 1)  # many ties
    ks = np.asarray([0, 10, 1, 50, v + 3, 300], np.int32)
    ps = np.asarray([0.9, 1.0, 0.5, 0.3, 0.99, 0.05], np.float32)
    got = np.asarray(top_k_top_p_mask(jnp.asarray(lg), jnp.asarray(ks), jnp.asarray(ps)))
    for i in range(6):
        want = _sorted_reference_mask(lg[i], int(ks[i]), float(ps[i]))
        assert want.sum() >= 1
        np.testing.assert_array_equal(got[i], want, err_msg=f"row {i}: top_k={ks[i]} top_p={ps[i]}")


@pytest.mark.parametrize("seed", range(4))
def test_top_k_candidates_equal_a_full_sort(seed):
    """Every row with top-k <= TOP_K_CANDIDATES (or no filter): thresholds from lax.top_k candidates, equal to
    a full sort's, ties included; the same rows through the bisection give the same mask."""
    from raydeploy.engine.sampling import TOP_K_CANDIDATES, _bisection_mask, _candidate_mask

    rng = np.random.default_rng(seed)
    v = 5000
    lg = (rng.normal(size=(5, v)) * rng.uniform(0.5, 4)).astype(np.float32)
    lg[1, :50] = lg[1, 0]  # a tie across the top-k boundary
    lg[2] = np.round(lg[2], 1)  # many ties
    ks = np.asarray([40, 10, 1, TOP_K_CANDIDATES, 0], np.int32)
    ps = np.asarray([0.9, 1.0, 0.5, 0.3, 1.0], np.float32)
    got = np.asarray(top_k_top_p_mask(jnp.asarray(lg), jnp.asarray(ks), jnp.asarray(ps)))
    k = jnp.asarray(np.where(ks <= 0, v, ks))
    x = jnp.asarray(lg)
    cand = np.asarray(_candidate_mask(x, k, jnp.asarray(ps), jax.lax.top_k(x, TOP_K_CANDIDATES)[0],
                                      jax.nn.logsumexp(x, axis=-1)))
    bis = np.asarray(_bisection_mask(jnp.asarray(lg), k, jnp.asarray(ps)))
    for i in range(5):
        want = _sorted_reference_mask(lg[i], int(ks[i]), float(ps[i]))
        np.testing.assert_array_equal(got[i], want, err_msg=f"row {i}: top_k={ks[i]} top_p={ps[i]}")
        np.testing.assert_array_equal(cand[i], want, err_msg=f"candidates, row {i}")
        np.testing.assert_array_equal(bis[i], want, err_msg=f"bisection, row {i}")


def _peaked_rows(rng: np.random.Generator, rows: int, v: int) -> np.ndarray:
    """Rows shaped like a trained model's logits: a few dozen plausible tokens, a long flat tail."""
    lg = rng.normal(size=(rows, v)).astype(np.float32)
    for r in range(rows):
        top = rng.choice(v, size=40, replace=False)
        lg[r, top] += rng.uniform(10, 14, size=40).astype(np.float32)
    return lg


@pytest.mark.parametrize("seed", range(4))
def test_top_p_without_top_k_from_candidates_equals_a_full_sort(seed):
    """Top-p with no top-k (the embedded default's sampling) over a 49152-token vocabulary: when the
    candidates hold p of a row's mass the thresholds come from them alone, and equal a full sort's over the
    whole row; a flat row whose candidates do not reach p sends the batch through the bisection, still equal."""
    from raydeploy.engine.sampling import TOP_K_CANDIDATES, _candidate_mask

    rng = np.random.default_rng(seed)
    v = 49152
    lg = _peaked_rows(rng, 4, v)
    lg[2, :12] = lg[2].max()  # ties at the top
    ps = np.asarray([0.95, 0.5, 0.9, 0.98], np.float32)
    x = jnp.asarray(lg)
    vals, lse = jax.lax.top_k(x, TOP_K_CANDIDATES)[0], jax.nn.logsumexp(x, axis=-1)
    mass = np.asarray(jnp.sum(jnp.exp(vals - lse[:, None]), axis=-1))
    assert (mass >= ps).all(), mass  # the candidate route is the one under test
    k = jnp.full((4,), v, jnp.int32)
    cand = np.asarray(_candidate_mask(x, k, jnp.asarray(ps), vals, lse))
    got = np.asarray(top_k_top_p_mask(x, jnp.zeros(4, jnp.int32), jnp.asarray(ps)))
    for i in range(4):
        want = _sorted_reference_mask(lg[i], 0, float(ps[i]))
        np.testing.assert_array_equal(cand[i], want, err_msg=f"candidates, row {i}: top_p={ps[i]}")
        np.testing.assert_array_equal(got[i], want, err_msg=f"row {i}: top_p={ps[i]}")
    flat = lg.copy()
    flat[3] = rng.normal(size=v).astype(np.float32) * 0.5  # top 128 of 49152 hold ~0.5% of the mass
    got = np.asarray(top_k_top_p_mask(jnp.asarray(flat), jnp.zeros(4, jnp.int32), jnp.asarray(ps)))
    for i in range(4):
        want = _sorted_reference_mask(flat[i], 0, float(ps[i]))
        assert i != 3 or want.sum() > TOP_K_CANDIDATES
        np.testing.assert_array_equal(got[i], want, err_msg=f"with a flat row, row {i}: top_p={ps[i]}")


def test_top_values_over_chunks_equal_one_top_k():
    """A sharded vocabulary's chunked candidates are the same values as one `lax.top_k` over the row."""
    from raydeploy.engine.sampling import TOP_K_CHUNKS, _top_values, chunks_for_shards

    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 49152 + 5)).astype(np.float32))
    one = np.asarray(_top_values(x, 128, chunks_for_shards(1)))
    chunked = np.asarray(_top_values(x, 128, chunks_for_shards(4)))
    np.testing.assert_array_equal(chunked, one)
    np.testing.assert_array_equal(one, np.sort(np.asarray(x), axis=-1)[:, ::-1][:, :128])
    assert chunks_for_shards(1) == 1 and chunks_for_shards(2) == TOP_K_CHUNKS


def test_greedy_and_top_k_programs_sort_nothing():
    """The compiled sampling has no sort of the vocabulary: top-k goes through lax.top_k."""
    lg = jnp.zeros((4, 5000), jnp.float32)
    params = SamplingParams(temperature=jnp.ones(4), top_p=jnp.ones(4), top_k=jnp.full((4,), 40, jnp.int32),
                            repetition_penalty=jnp.ones(4), seed=jnp.zeros((4, 2), jnp.uint32),
                            presence_penalty=jnp.zeros(4), frequency_penalty=jnp.zeros(4), min_p=jnp.zeros(4))
    args = (lg, jnp.zeros((4, 5000), bool), params, jnp.zeros(4, jnp.int32))
    hlo = jax.jit(sample).lower(*args).as_text()
    assert "topk" in hlo.replace("_", "").lower()
    assert " sort(" not in hlo and "stablehlo.sort" not in hlo
