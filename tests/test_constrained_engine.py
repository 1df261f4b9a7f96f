"""The allowed-token mask of constrained rows (structured outputs) in the jitted sampler, on the real demo model.

- a sampling row with a mask draws only allowed tokens, greedy and at temperature 1 with top-k/top-p and a
  repetition penalty, over many steps and seeds; a mask of one bit forces that token; the reported logprob stays
  the raw model distribution's;
- an unconstrained row beside a constrained one gets the tokens it gets alone;
- the same plans with masks give the same tokens on one device, dp=2 and fsdp x tp (virtual CPU devices);
- a mask of the wrong length fails just its request (`RequestFailed` naming the slot) before any device work; a
  masked row in a multi-pass plan draws in its first pass only (tests/test_constrained_passes.py);
- a step without a constrained row moves no mask: it takes the engine's device-resident all-ones array.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_engine_paged import PlanDriver, _build_engine

from raydeploy.engine.request import RequestFailed
from raydeploy.engine.sampling import mask_words
from raydeploy.engine.step import PageUpdate, SamplingParams, SeqStep, StepPlan

pytestmark = pytest.mark.model


def pack_bits(allowed: np.ndarray | list[int], vocab: int) -> np.ndarray:
    """Packed uint32 words of a set of token ids (the `SeqStep.allowed` layout), written independently of the
    engine: bit i % 32 of word i // 32."""
    words = np.zeros(mask_words(vocab), np.uint32)
    for t in np.asarray(allowed).reshape(-1):
        words[int(t) // 32] |= np.uint32(1) << np.uint32(int(t) % 32)
    return words


class MaskedDriver(PlanDriver):
    """`PlanDriver` whose plans give the rows of `masks` (request name -> function of the tokens so far -> set of
    token ids) their allowed-token bits, running one pass per plan while any such row decodes (as the scheduler
    does)."""

    def __init__(self, engine, masks, **kw) -> None:
        super().__init__(engine, **kw)
        self.masks = masks
        self.vocab = engine.vocab_size

    def plan(self):
        saved = self.decode_steps
        if any(r["name"] in self.masks for r in self.live.values()):
            self.decode_steps = 1
        plan = super().plan()
        self.decode_steps = saved
        seqs = []
        for q in plan.seqs:
            r = self.live.get(q.slot)
            if q.sample and r is not None and r["name"] in self.masks:
                allowed = pack_bits(sorted(self.masks[r["name"]](r["out"])), self.vocab)
                q = SeqStep(q.slot, q.tokens, q.start, q.sample, q.sampling, q.prefix_tokens, allowed)
            seqs.append(q)
        return StepPlan(plan.step_id, plan.release, plan.shutdown, plan.decode_steps, tuple(seqs), plan.pages)


@pytest.fixture(scope="module")
def engine(demo_checkpoint):
    return _build_engine(demo_checkpoint, {"dp": 1})


def _allowed_sets(vocab: int, seed: int, size: int):
    """A fresh random set of `size` token ids per step (from the tokens so far), the same on every call."""

    def sets(out: list[int]) -> set[int]:
        rng = np.random.default_rng([seed, len(out)])
        return set(rng.choice(vocab, size, replace=False).tolist())

    return sets


def test_masked_rows_draw_only_allowed_tokens_greedy_and_sampled(engine, prompt_ids):
    """Greedy and temperature-1 rows (with top-k, top-p and a penalty, over several seeds) draw only what their
    mask allows at every step; greedy takes the allowed token of largest logit (checked against a one-bit mask
    of it: the unconstrained greedy choice lies outside nearly every set); the logprob is the raw model's."""
    vocab = engine.vocab_size
    samplings = {"g": None, **{f"s{seed}": SamplingParams(temperature=1.0, top_k=50, top_p=0.95,
                                                          repetition_penalty=1.2, seed=seed) for seed in range(4)},
                 "t": SamplingParams(temperature=1.0, seed=7)}
    masks = {name: _allowed_sets(vocab, i, 16) for i, name in enumerate(samplings)}
    requests = [(name, prompt_ids[i % len(prompt_ids)], 24, sp) for i, (name, sp) in enumerate(samplings.items())]
    done = MaskedDriver(engine, masks).run(requests[:4])
    done.update(MaskedDriver(engine, masks).run(requests[4:]))
    for name, r in done.items():
        assert len(r["out"]) == 24
        for k, tok in enumerate(r["out"]):
            assert tok in masks[name](r["out"][:k]), f"{name} step {k}: token {tok} is not allowed"
        assert all(lp <= 0 for lp in r["logprobs"])
    # the random sets exclude the model's free choice: the raw logprob of a masked token is low, not renormalised
    assert np.mean(done["g"]["logprobs"]) < -3
    sampled = [t for n in done if n.startswith("s") for t in done[n]["out"]]
    assert len(set(sampled)) > 20  # sampling really varies within the sets


def test_a_one_bit_mask_forces_its_token_and_neighbours_keep_their_tokens(engine, prompt_ids):
    """A mask of one bit forces that token, greedy and sampled; an unconstrained row in the same plans gets the
    tokens it gets alone (greedy and sampled), though its plans now run one pass each."""
    vocab = engine.vocab_size
    forced = [5, 17, vocab - 1, 32, 31, 4000, 12345, 49151 % vocab] * 2
    masks = {"forced": lambda out: {forced[len(out)]},
             "forced_sampled": lambda out: {forced[-1 - len(out)]}}
    hot = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    free = [("free", prompt_ids[1], 16, None), ("free_sampled", prompt_ids[2], 16, hot)]
    alone = PlanDriver(engine).run(free)
    together = MaskedDriver(engine, masks).run(
        [("forced", prompt_ids[0], 16, None), ("forced_sampled", prompt_ids[0], 16, hot)] + free)
    assert together["forced"]["out"] == forced
    assert together["forced_sampled"]["out"] == forced[::-1]
    for name in ("free", "free_sampled"):
        assert together[name]["out"] == alone[name]["out"], name
        np.testing.assert_allclose(together[name]["logprobs"], alone[name]["logprobs"], atol=1e-4)
    assert together["free"]["out"] != forced  # the neighbour's tokens are its own


def test_an_unconstrained_step_moves_no_mask(engine, prompt_ids):
    """Without a constrained row, `build_inputs` leaves the mask out and the step takes the engine's cached all-ones
    array (the same device array each time)."""
    from raydeploy.engine.kv_cache import ALLOWED_FIELD, build_inputs

    ps = engine.programs_set
    seqs = [SeqStep(0, np.asarray(prompt_ids[0][:8], np.int32), 0, True, SamplingParams())]
    host = build_inputs(seqs, engine.tables, ps.page_size, 16, ps.rows_for(16), ps.page_buckets[0],
                        vocab=engine.vocab_size)
    assert ALLOWED_FIELD not in host.arrays
    rows = ps.groups * ps.rows_for(16)
    a, b = engine._device_inputs(host.arrays, rows), engine._device_inputs(host.arrays, rows)
    assert a.allowed is b.allowed and a.allowed.shape == (rows, mask_words(engine.vocab_size))
    assert (np.asarray(a.allowed) == np.uint32(0xFFFFFFFF)).all()
    masked = [SeqStep(0, seqs[0].tokens, 0, True, SamplingParams(), allowed=pack_bits([3, 40], engine.vocab_size))]
    host = build_inputs(masked, engine.tables, ps.page_size, 16, ps.rows_for(16), ps.page_buckets[0],
                        vocab=engine.vocab_size)
    assert host.arrays[ALLOWED_FIELD][0, :2].tolist() == [1 << 3, 1 << 8]
    assert (host.arrays[ALLOWED_FIELD][1:] == np.uint32(0xFFFFFFFF)).all()


def test_bad_masks_are_refused_naming_the_slot_before_any_device_work(engine, prompt_ids):
    vocab = engine.vocab_size
    words = mask_words(vocab)
    prompt = np.asarray(prompt_ids[0], np.int32)
    pages = PageUpdate(0, 0, np.arange(-(-(prompt.size + 1) // engine.page_size), dtype=np.int32))
    pool_before = np.asarray(engine.pool[0]).copy()
    short = SeqStep(0, prompt, 0, True, SamplingParams(), allowed=np.ones(words - 1, np.uint32))
    with pytest.raises(RequestFailed, match=rf"slot 0: its allowed-token mask has {words - 1} words, the model's "
                       rf"vocabulary of {vocab} tokens takes {words}") as err:
        engine.step(StepPlan(900, seqs=(short,), pages=(pages,)))
    assert err.value.slots == (0,)
    np.testing.assert_array_equal(np.asarray(engine.pool[0]), pool_before)  # nothing ran
    ok = SeqStep(0, prompt, 0, True, SamplingParams())
    engine.step(StepPlan(901, seqs=(ok,), pages=(pages,)))
    decode = SeqStep(0, np.zeros(0, np.int32), prompt.size, True, allowed=pack_bits([1], vocab))
    got = engine.step(StepPlan(902, seqs=(decode,), decode_steps=4))  # drawn in the first pass only
    assert got.tokens.tolist() == [[1], [0], [0], [0]]
    got = engine.step(StepPlan(903, seqs=(decode,), decode_steps=1))
    assert got.tokens.tolist() == [[1]]
    engine.step(StepPlan(904, release=(0,)))


def _mesh_run(engine, prompt_ids):
    vocab = engine.vocab_size
    masks = {"g": _allowed_sets(vocab, 11, 64), "s": _allowed_sets(vocab, 12, 256)}
    hot = SamplingParams(temperature=1.0, top_k=40, repetition_penalty=1.1, seed=5)
    requests = [("g", prompt_ids[0], 12, None), ("s", prompt_ids[1], 12, hot), ("free", prompt_ids[2], 12, hot)]
    done = MaskedDriver(engine, masks).run(requests, stagger=[0, 1, 2])
    return {n: r["out"] for n, r in done.items()}


@pytest.mark.slow
def test_every_mesh_applies_the_same_masks(engine, demo_checkpoint, prompt_ids):
    """The same plans with masks (staggered, mixed with an unconstrained row) give identical tokens on one device,
    dp=2 and fsdp x tp (the vocabulary sharded over tp: each shard unpacks its own words, no collective moves the
    mask)."""
    from raydeploy.compile import collectives

    want = _mesh_run(engine, prompt_ids)
    for name in ("g", "s"):
        masks_ok = {"g": _allowed_sets(engine.vocab_size, 11, 64), "s": _allowed_sets(engine.vocab_size, 12, 256)}
        assert all(t in masks_ok[name](want[name][:k]) for k, t in enumerate(want[name]))
    for shape in ({"dp": 2}, {"fsdp": 2, "tp": 2}):
        other = _build_engine(demo_checkpoint, shape)
        assert _mesh_run(other, prompt_ids) == want, shape
        if "tp" in shape:
            found, _ = collectives(other.step_hlo(2, other.programs_set.page_buckets[0]))
            shapes = [s for c in found.values() for s in c.shapes]
            # the mask moves between no devices: no collective of its words or bits, and no vocabulary-wide one
            # but the all-gather of the logits this mesh's step makes without masks too (measured: the same
            # collectives, count and shapes, as the step before masks existed)
            assert not any(s.startswith(("u32", "pred")) for s in shapes), shapes
            vocab = other.vocab_size
            wide = [(kind, s) for kind, c in found.items() for s in c.shapes if str(vocab) in s]
            assert wide == [("all-gather", f"f32[2,{vocab}]")], wide


def test_the_sampler_keeps_to_the_mask_on_every_filter_path():
    """On logits alone (a small vocabulary not a multiple of 32): greedy, top-k within the candidates, top-p, and
    top-k past the candidates (the bisection path, whose bounds must ignore the masked -inf logits) all draw
    allowed tokens only, within their filter, over many seeds; the logprob is the unmasked log-softmax's."""
    import jax
    import jax.numpy as jnp

    from raydeploy.engine.sampling import ROW_DTYPES, row_value, sample

    vocab, rows = 300, 4
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 3
    allowed = [5, 31, 32, 64, 150, 299]
    words = np.stack([pack_bits(allowed, vocab)] * rows)
    fn = jax.jit(sample)
    # the last row: 250 allowed tokens and a top-k of 150 at a high temperature, so its threshold comes from the
    # bisection and a draw past the 150 best allowed tokens is likely if that threshold were wrong
    wide = np.sort(rng.choice(vocab, 250, replace=False))
    words[-1] = pack_bits(wide, vocab)
    best_wide = set(wide[np.argsort(-logits[-1, wide])[:150]].tolist())
    drawn = []
    for seed in range(25):
        params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=50, seed=seed),
                  SamplingParams(temperature=1.5, top_p=0.99, seed=seed),
                  SamplingParams(temperature=5.0, top_k=150, seed=seed)]
        cols = SamplingParams(**{n: jnp.asarray(np.asarray([row_value(p, n) for p in params], dt))
                                 for n, dt in ROW_DTYPES.items()})
        tok, lp = fn(jnp.asarray(logits), jnp.zeros((rows, vocab), bool), cols, jnp.full(rows, seed, jnp.int32),
                     allowed_bw=jnp.asarray(words))
        tok = np.asarray(tok)
        assert set(tok[:3].tolist()) <= set(allowed), (seed, tok)
        assert tok[0] == allowed[int(np.argmax(logits[0, allowed]))]
        assert int(tok[3]) in best_wide, (seed, int(tok[3]))
        drawn.append(int(tok[3]))
        raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))[np.arange(rows), tok]
        np.testing.assert_allclose(np.asarray(lp), raw, rtol=1e-5, atol=1e-5)
    assert len(set(drawn)) > 10  # the hot row really spreads over its top-k


def test_the_toy_engine_honours_masks_as_the_real_one_refuses_them():
    """The toy engine (serve tests' stand-in) draws its natural token where the mask allows it, else the mask's
    next allowed id (`toy_allowed_token`), over masks of any vocabulary; it refuses a mask in a multi-pass plan
    and fails a request whose mask allows nothing, as the real engine's plan checks do."""
    import jax

    from raydeploy.model.sharding import build_mesh
    from raydeploy.testing.toy import ToyEngine, toy_allowed_token, toy_next_token

    toy = ToyEngine(build_mesh({"dp": 1}, jax.devices()[:1]), 4)
    vocab = 49152  # a tokenizer's vocabulary, wider than the toy's own
    prompt = np.asarray([10, 11], np.int32)
    natural = int(toy_next_token(11))
    free = SeqStep(1, prompt, 0, True)
    # the natural token allowed: kept; not allowed: the next allowed id above it, or wrapping to the smallest
    for allowed, want in (([natural, 3], natural), ([natural + 5, 3], natural + 5), ([3, 7], 3),
                          ([40000], 40000)):
        res = toy.step(StepPlan(1, seqs=(SeqStep(0, prompt, 0, True, allowed=pack_bits(allowed, vocab)), free)))
        assert res.tokens[0].tolist() == [want, natural], allowed
        assert toy_allowed_token(natural, pack_bits(allowed, vocab)) == want
    toy.step(StepPlan(2, seqs=(SeqStep(0, prompt, 0, True),)))
    decode = SeqStep(0, np.zeros(0, np.int32), 2, True, allowed=pack_bits([9], vocab))
    assert toy.step(StepPlan(3, seqs=(decode,))).tokens.tolist() == [[9]]
    with pytest.raises(ValueError, match=r"plan 4: slot 0 carries an allowed-token mask in a plan of decode_steps 2"):
        toy.step(StepPlan(4, seqs=(decode,), decode_steps=2))
    nothing = SeqStep(0, np.zeros(0, np.int32), 3, True, allowed=np.zeros(mask_words(vocab), np.uint32))
    with pytest.raises(RequestFailed, match=r"slot 0: its allowed-token mask allows no token") as err:
        toy.step(StepPlan(5, seqs=(nothing,)))
    assert err.value.slots == (0,)
