"""OpenAI's sampling controls in the engine: presence and frequency penalties over generated tokens, logit_bias,
min_p, min_tokens.

- the sampler functions on fixed arrays against reference implementations written here from the definitions
  (OpenAI's penalty formula on a known history, a -100 bias as a ban, min_p's threshold);
- the real demo engine: counts in the slot's state follow the generated tokens across multi-pass plans and start
  over with each request; logit_bias bans and forces; min_tokens holds eos off through the real scheduler;
  a step without any of these moves no bias table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raydeploy.engine.sampling import (
    BIAS_PAD,
    COUNT_MAX,
    MAX_LOGIT_BIAS,
    ROW_DTYPES,
    STATE_DTYPE,
    LogitBiasRows,
    apply_penalties,
    bias_table,
    min_p_mask,
    note_generated,
    note_in_sequence,
    row_value,
    sample,
    token_state,
)
from raydeploy.engine.step import SamplingParams

V = 64


def _rows(params: list[SamplingParams]) -> tuple[SamplingParams, LogitBiasRows]:
    """The rows' params (one array per field) and logit-bias tables, as a step lays them out."""
    rows = SamplingParams(**{n: jnp.asarray(np.asarray([row_value(p, n) for p in params], dt))
                             for n, dt in ROW_DTYPES.items()})
    tables = [bias_table(p) for p in params]
    bias = LogitBiasRows(ids=jnp.asarray(np.stack([t[0] for t in tables])),
                         values=jnp.asarray(np.stack([t[1] for t in tables])))
    return rows, bias


def _draw(logits: np.ndarray, params: list[SamplingParams], positions, state=None) -> np.ndarray:
    rows, bias = _rows(params)
    st = jnp.zeros(logits.shape, STATE_DTYPE) if state is None else jnp.asarray(state)
    tok, _ = jax.jit(sample)(jnp.asarray(logits), st, rows, jnp.asarray(positions, jnp.int32), bias=bias)
    return np.asarray(tok)


def _state_of(prompt: list[int], generated: list[int], vocab: int) -> np.ndarray:
    """One slot's state after its prompt and generated tokens, built by the engine's own update functions."""
    state = jnp.zeros((1, vocab), STATE_DTYPE)
    state = note_in_sequence(state, jnp.zeros(len(prompt), jnp.int32), jnp.asarray(prompt, jnp.int32))
    for t in generated:
        state = note_generated(state, jnp.zeros(1, jnp.int32), jnp.asarray([t], jnp.int32))
    return np.asarray(state)


def openai_penalised(logits: np.ndarray, generated: list[int], presence: float, frequency: float) -> np.ndarray:
    """OpenAI's definition: mu[j] -= c[j] * alpha_frequency + float(c[j] > 0) * alpha_presence, c[j] the times
    token j was generated so far (the prompt not counted)."""
    c = np.bincount(np.asarray(generated, np.int64), minlength=logits.shape[-1]).astype(np.float64)
    return logits - c * frequency - (c > 0) * presence


def test_counts_follow_generated_tokens_only_and_saturate():
    prompt, generated = [1, 2, 3, 3], [3, 5, 5, 5, 7]
    present, counts = (np.asarray(x) for x in token_state(jnp.asarray(_state_of(prompt, generated, V))))
    assert np.nonzero(present[0])[0].tolist() == [1, 2, 3, 5, 7]
    want = np.bincount(generated, minlength=V)
    np.testing.assert_array_equal(counts[0], want)
    many = _state_of([], [9] * (COUNT_MAX + 20), 16)
    assert np.asarray(token_state(jnp.asarray(many))[1])[0, 9] == COUNT_MAX


@pytest.mark.parametrize("seed", range(4))
def test_penalties_match_openai_formula_on_a_fixed_history(seed):
    """The penalised logits of a known history equal the reference formula; greedy rows pick the reference's
    argmax (the history's tokens are made the favourites, so the penalties change the choice)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, V, 12).tolist()
    generated = rng.choice(8, 20).tolist()  # repeats of a few tokens
    logits = rng.normal(size=(1, V)).astype(np.float32)
    logits[0, :8] += 3.0
    state = _state_of(prompt, generated, V)
    _, counts = token_state(jnp.asarray(state))
    for presence, frequency in ((0.0, 0.0), (0.7, 0.0), (0.0, 0.4), (1.5, 0.9), (-1.0, -0.5), (2.0, 2.0)):
        got = np.asarray(apply_penalties(jnp.asarray(logits), counts, jnp.asarray([presence], jnp.float32),
                                         jnp.asarray([frequency], jnp.float32)))
        want = openai_penalised(logits, generated, presence, frequency)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
        tok = _draw(logits, [SamplingParams(presence_penalty=presence, frequency_penalty=frequency)], [40], state)
        assert tok[0] == int(np.argmax(want[0])), (presence, frequency)
    # the choice really moves: the unpenalised favourite is generated, the penalised one is not
    strong = openai_penalised(logits, generated, 2.0, 2.0)
    assert np.argmax(logits[0]) != np.argmax(strong[0])


def test_prompt_tokens_are_not_penalised_by_presence_or_frequency():
    logits = np.zeros((1, V), np.float32)
    logits[0, 4], logits[0, 9] = 1.0, 0.5
    state = _state_of([4, 4, 4], [], V)
    assert _draw(logits, [SamplingParams(presence_penalty=2.0, frequency_penalty=2.0)], [3], state)[0] == 4
    assert _draw(logits, [SamplingParams(repetition_penalty=3.0)], [3], state)[0] != 4  # the prompt's penalty


def test_logit_bias_minus_100_bans_and_plus_100_forces():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, V)).astype(np.float32) * 2
    top = logits.argmax(axis=-1)
    ban = [SamplingParams(logit_bias={int(top[r]): -100}) for r in range(3)]
    got = _draw(logits, ban, [0, 0, 0])
    for r in range(3):
        assert got[r] != top[r] and got[r] == np.argsort(-logits[r])[1]
    # a ban is exact (-inf): even a token 150 logits ahead of the rest is never drawn, greedy or sampled
    hot = logits.copy()
    hot[:, 11] = 150.0
    draws = {int(_draw(hot[:1], [SamplingParams(temperature=1.0, seed=s, logit_bias={11: -100})], [s])[0])
             for s in range(40)}
    assert 11 not in draws
    weakest = np.argsort(logits, axis=-1)[:, 0]
    force = [SamplingParams(logit_bias={int(weakest[r]): 100, 1: 0.5}) for r in range(3)]
    np.testing.assert_array_equal(_draw(logits, force, [0, 0, 0]), weakest)
    # a row without a bias beside them keeps its own choice
    mixed = _draw(logits, [SamplingParams(), force[1], SamplingParams()], [0, 0, 0])
    assert mixed[0] == top[0] and mixed[1] == weakest[1] and mixed[2] == top[2]


def test_bias_table_layout():
    ids, values = bias_table(SamplingParams(logit_bias={7: -100, 2: 3.5}))
    assert ids.shape == values.shape == (MAX_LOGIT_BIAS,)
    assert ids[:2].tolist() == [2, 7] and values[0] == 3.5 and values[1] == -np.inf
    assert (ids[2:] == BIAS_PAD).all() and (values[2:] == 0).all()


def test_min_p_mask_is_its_definition():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(4, V)).astype(np.float32) * 2
    for min_p in (0.0, 0.05, 0.3, 1.0):
        got = np.asarray(min_p_mask(jnp.asarray(logits), jnp.full((4,), min_p, jnp.float32)))
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        want = probs >= min_p * probs.max(-1, keepdims=True) * (1 - 1e-6)
        np.testing.assert_array_equal(got, want, err_msg=f"min_p {min_p}")


def test_min_p_sampled_draws_never_fall_below_the_threshold():
    """Over many seeds at temperature 1.5, every draw's probability (after temperature) is at least min_p times
    the top one's; without min_p some draws fall below it."""
    rng = np.random.default_rng(7)
    logits = (rng.normal(size=(1, V)) * 2).astype(np.float32)
    temperature, min_p = 1.5, 0.2
    scaled = logits[0] / temperature
    probs = np.exp(scaled - scaled.max())
    floor = min_p * probs.max()
    with_min_p = [int(_draw(logits, [SamplingParams(temperature=temperature, min_p=min_p, seed=s)], [s])[0])
                  for s in range(150)]
    without = [int(_draw(logits, [SamplingParams(temperature=temperature, seed=s)], [s])[0]) for s in range(150)]
    assert all(probs[t] >= floor for t in with_min_p)
    assert any(probs[t] < floor for t in without)
    assert len(set(with_min_p)) >= 2  # still sampling


# -- the real demo engine


@pytest.fixture(scope="module")
def engine(demo_checkpoint):
    from test_engine_paged import _build_engine

    return _build_engine(demo_checkpoint, {"dp": 1}, decode_steps=4)


@pytest.mark.model
def test_counts_follow_generated_tokens_across_multi_pass_plans_and_reset_per_request(engine, prompt_ids):
    """After a greedy request with a frequency penalty (plans of 4 passes), its slot's state counts exactly its
    generated tokens and marks its prompt; the next request in the slot starts over from its own tokens; the
    penalty changed the tokens (the same request without it repeats more)."""
    from test_engine_paged import PlanDriver

    slot = engine.slot_order[0]
    penalised = SamplingParams(frequency_penalty=1.5, presence_penalty=0.5)
    a = PlanDriver(engine).run([("a", prompt_ids[0], 23, penalised)])["a"]
    present, counts = (np.asarray(x)[slot] for x in token_state(engine.presence))
    np.testing.assert_array_equal(counts, np.bincount(a["out"], minlength=engine.vocab_size))
    assert set(np.nonzero(present)[0].tolist()) == set(prompt_ids[0]) | set(a["out"])
    b = PlanDriver(engine).run([("b", prompt_ids[1], 9, None)])["b"]
    present, counts = (np.asarray(x)[slot] for x in token_state(engine.presence))
    np.testing.assert_array_equal(counts, np.bincount(b["out"], minlength=engine.vocab_size))
    assert set(np.nonzero(present)[0].tolist()) == set(prompt_ids[1]) | set(b["out"])
    plain = PlanDriver(engine).run([("p", prompt_ids[0], 23, None)])["p"]
    assert plain["out"] != a["out"]
    assert len(set(a["out"])) >= len(set(plain["out"]))


@pytest.mark.model
def test_logit_bias_bans_and_forces_on_the_engine_and_neighbours_keep_their_tokens(engine, prompt_ids):
    from test_engine_paged import PlanDriver

    alone = PlanDriver(engine).run([("free", prompt_ids[1], 12, None)])["free"]["out"]
    first = PlanDriver(engine).run([("g", prompt_ids[0], 1, None)])["g"]["out"][0]
    done = PlanDriver(engine).run([
        ("ban", prompt_ids[0], 12, SamplingParams(logit_bias={first: -100})),
        ("force", prompt_ids[0], 12, SamplingParams(temperature=1.0, seed=3, logit_bias={4321: 100})),
        ("free", prompt_ids[1], 12, None)])
    assert done["ban"]["out"][0] != first and first not in done["ban"]["out"]
    assert done["force"]["out"] == [4321] * 12
    assert done["free"]["out"] == alone


@pytest.mark.model
def test_a_step_without_bias_moves_no_table(engine, prompt_ids):
    from raydeploy.engine.kv_cache import BIAS_FIELDS, BIAS_IDS, build_inputs
    from raydeploy.engine.step import SeqStep

    ps = engine.programs_set
    seqs = [SeqStep(0, np.asarray(prompt_ids[0][:8], np.int32), 0, True, SamplingParams())]
    engine.tables.start(seqs[0], engine.vocab_size)
    host = build_inputs(seqs, engine.tables, ps.page_size, 16, ps.rows_for(16), ps.page_buckets[0],
                        vocab=engine.vocab_size)
    assert not set(BIAS_FIELDS) & set(host.arrays) and not host.arrays["any_adjusted"]
    rows = ps.groups * ps.rows_for(16)
    a, b = engine._device_inputs(host.arrays, rows), engine._device_inputs(host.arrays, rows)
    assert a.sampling.bias.ids is b.sampling.bias.ids and (np.asarray(a.sampling.bias.ids) == BIAS_PAD).all()
    biased = SeqStep(0, seqs[0].tokens, 0, True, SamplingParams(logit_bias={5: 1.0}))
    engine.tables.start(biased, engine.vocab_size)
    host = build_inputs([biased], engine.tables, ps.page_size, 16, ps.rows_for(16), ps.page_buckets[0],
                        vocab=engine.vocab_size)
    assert host.arrays[BIAS_IDS][0, 0] == 5 and host.arrays["any_adjusted"]


def _runner(engine):
    from raydeploy.config import load_config
    from raydeploy.engine.local import LocalRunner
    from raydeploy.engine.scheduler import Scheduler

    cfg = load_config(None, overrides=["engine.decode_steps=4", "engine.burst_wait=0"])
    return LocalRunner(engine, Scheduler.for_engine(engine, cfg))


@pytest.mark.model
def test_min_tokens_holds_the_stop_tokens_off_exactly_through_the_scheduler(engine, prompt_ids):
    """A prompt whose greedy continuation is eos at once: alone it stops with no token; with min_tokens m it
    generates m tokens first. With eos also pushed by logit_bias +100 it stops right after m tokens, for m
    landing anywhere in a 4-pass plan (the ban is per pass); a request's own stop ids are held off too."""
    from raydeploy.engine.request import GenerationRequest

    runner = _runner(engine)
    eos = sorted(engine.eos_ids)
    stopped = None
    for i, p in enumerate(prompt_ids):
        out = runner.generate([GenerationRequest(f"probe{i}", tuple(p), 64, SamplingParams())])[0]
        if out.finish_reason == "stop":
            stopped = tuple(p) + tuple(out.token_ids)
            break
    assert stopped is not None, "no demo prompt ends with eos within 64 tokens"
    at_once = runner.generate([GenerationRequest("eos", stopped, 8, SamplingParams())])[0]
    assert (at_once.token_ids, at_once.finish_reason) == ([], "stop")
    held = runner.generate([GenerationRequest("held", stopped, 16, SamplingParams(min_tokens=5))])[0]
    assert len(held.token_ids) >= 5 and not set(held.token_ids) & set(eos)
    for m in (1, 2, 5, 6, 9):
        push = SamplingParams(min_tokens=m, logit_bias={e: 100 for e in eos})
        out = runner.generate([GenerationRequest(f"m{m}", stopped, 32, push)])[0]
        assert (len(out.token_ids), out.finish_reason) == (m, "stop"), (m, out.token_ids)
    own = held.token_ids[0]
    out = runner.generate([GenerationRequest("own", stopped, 16, SamplingParams(min_tokens=3),
                                             stop_token_ids=(own,))])[0]
    assert len(out.token_ids) >= 3 and out.token_ids[0] != own and own not in out.token_ids[:3]
