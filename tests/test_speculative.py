"""Speculative decoding (`raydeploy.engine.speculative`): proposals verified in the ragged step, outputs exactly
those of the model alone.

Real engines over tiny models of every family (transformers' seeded random weights, converted by our converter),
driven by the real scheduler and step loop, with and without `engine.speculative.method: ngram`:
- greedy tokens and logprobs equal token for token, on one device and with dp=2, with chunked prefill and
  prefix-cache hits; a seeded sampled request emits the same tokens too (each draw keeps its position's key);
- proposals that are always wrong (a proposer patched to propose the wrong token) change nothing: the same tokens,
  and at the end the same free pages and the same prefix-cache content as without speculation;
- the sampled rule keeps the distribution: token frequencies over many seeds with and without speculation pass a
  chi-square test at significance 0.001, and the same test fails when the acceptance rule is broken on purpose
  (every proposal accepted);
- a stop token, max_tokens and max_seq_len falling inside an accepted run end the request at that token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
scipy_stats = pytest.importorskip("scipy.stats")

from raydeploy.config import load_config  # noqa: E402
from raydeploy.config.schema import SpeculativeConfig  # noqa: E402
from raydeploy.engine.local import LocalRunner  # noqa: E402
from raydeploy.engine.pages import PagePool, SequencePages  # noqa: E402
from raydeploy.engine.request import GenerationRequest  # noqa: E402
from raydeploy.engine.scheduler import Scheduler  # noqa: E402
from raydeploy.engine.speculative import ngram, verify  # noqa: E402
from raydeploy.engine.speculative.policy import (  # noqa: E402
    PAUSE_PLANS,
    RETRY_PLANS,
    WARM_ACCEPTED,
    Acceptance,
    SpecCounters,
)
from raydeploy.engine.step import SamplingParams, SeqStep, StepPlan  # noqa: E402
from tests.test_engine_families import CASES, MAX_SEQ_LEN  # noqa: E402

SIGNIFICANCE = 1e-3
"""The chi-square tests' significance: a correct rule fails one by chance once in a thousand runs."""

# prompts that repeat themselves, so prompt lookup finds matches from the first draw
PROMPTS = [[3, 17, 42, 5, 99, 7, 3, 17, 42, 5, 99, 7, 3, 17], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3],
           [9, 8, 7, 9, 8, 7, 9, 8]]


# -- host parts -------------------------------------------------------------------------------------------------

def test_ngram_proposes_the_continuation_of_the_latest_match():
    seq = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3]
    # suffix [1, 2, 3] occurred at 0 (then 4 5 9 1) and at 6 (then 7 8 6 1): the latest with k tokens after it
    assert ngram.propose(seq, 3, 3, 2) == [7, 8, 6]
    assert ngram.propose(seq, 3, 3, 3) == [7, 8, 6]
    assert ngram.propose([5, 6, 7, 8], 3, 3, 1) == []  # no earlier occurrence of any suffix
    # a run of one token: the latest occurrences overlap the suffix, the earliest has the longest continuation
    assert ngram.propose([4, 0, 0, 0, 0, 0], 3, 2, 2) == [0, 0, 0]
    assert ngram.propose(seq, 0, 3, 2) == []


def test_a_low_acceptance_rate_pauses_a_request_then_lets_it_try_again():
    a = Acceptance()
    for step in range(3):
        a.note(4, 0, step, 0.3)
        assert a.allows(step + 1)  # too few rows recorded to judge
    a.note(4, 0, 3, 0.3)
    assert not a.allows(4) and not a.allows(3 + PAUSE_PLANS - 1) and a.allows(3 + PAUSE_PLANS)
    b = Acceptance()
    for step in range(8):
        b.note(4, 2, step, 0.3)  # 50% accepted
    assert b.allows(9)
    c = SpecCounters()
    c.note(4, 2)
    c.note(2, 0)
    stats = c.stats()
    assert stats["spec_decode_num_draft_tokens"] == 6 and stats["spec_decode_num_accepted_tokens"] == 2
    assert stats["spec_decode_accepted_per_pos"] == [1, 1, 0, 0]
    assert stats["spec_decode_mean_accepted_length"] == 2.0


def test_a_request_that_was_copying_retries_its_lookup_after_one_token():
    a = Acceptance()
    assert not a.retry()  # never verified: cold
    a.note(4, WARM_ACCEPTED, 0, 0.3)
    assert [a.retry() for _ in range(RETRY_PLANS + 1)] == [True] * RETRY_PLANS + [False]
    a.note(4, WARM_ACCEPTED - 1, 1, 0.3)  # one accepted proposal (a common pair of words) warms nothing
    assert not a.retry()


def test_verify_rows_split_a_speculating_row_into_one_token_rows():
    rows, first = verify.as_single_rows([SeqStep(0, np.zeros(0, np.int32), 7, True),
                                         SeqStep(1, np.asarray([5, 6, 7], np.int32), 10, True, spec=2)])
    assert first == [0, 1]
    assert [(q.slot, q.tokens.tolist(), q.start, q.sample, q.spec) for q in rows[1:]] == [
        (1, [5], 10, False, 0), (1, [6], 11, False, 0), (1, [7], 12, False, 0)]


def test_shrink_gives_back_the_pages_of_rejected_positions_and_keeps_the_reservation():
    pool = PagePool(8, 4)
    seq = SequencePages.admit(pool, list(range(6)), 20)
    assert seq is not None and pool.headroom == 3  # 5 pages reserved
    seq.grow(13)  # a speculating row wrote up to position 12: 4 pages
    assert len(seq.pages) == 4 and pool.free_pages == 4
    seq.commit(list(range(13)), 9)  # 2 full computed pages cached
    assert seq.shrink(9) == 1  # positions 0..8 stay: 3 pages
    assert len(seq.pages) == 3 and seq.reserved == 2 and pool.free_pages == 5 and pool.headroom == 3
    with pytest.raises(ValueError, match="prefix cache"):
        seq.shrink(4)


def test_plans_carry_speculating_rows_over_the_wire():
    q = SeqStep(3, np.asarray([5, 6, 7], np.int32), 10, True, spec=2)
    back = StepPlan.from_bytes(StepPlan(1, seqs=(q,)).to_bytes()).seqs[0]
    assert back.spec == 2 and back.tokens.tolist() == [5, 6, 7] and back.num_tokens == 3


def test_accept_lengths_is_the_longest_matching_prefix():
    drawn = np.asarray([[1, 2, 3], [1, 9, 3], [0, 2, 3], [1, 2, 3]], np.int32)
    proposals = np.asarray([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, -1]], np.int32)
    assert np.asarray(verify.accept_lengths(drawn, proposals)).tolist() == [3, 1, 0, 2]


# -- engines ----------------------------------------------------------------------------------------------------

def _checkpoint(kind: str, tmp: Path, config: dict[str, Any] | None = None) -> Path:
    from hf_reference import tiny_hf_model

    from raydeploy.checkpoint.convert import convert

    tiny_hf_model(config or CASES[kind], tmp / "hf")
    convert(tmp / "hf", tmp / "ckpt", progress=False)
    return tmp / "ckpt"


def _engine(ckpt: Path, mesh_shape: dict[str, int], max_slots: int = 2, **engine_kw: Any) -> Any:
    """A float32 engine over the converted checkpoint (pages of 8 tokens, prompt chunks of 8 tokens a slot)."""
    import jax

    from raydeploy.checkpoint.reader import CheckpointReader
    from raydeploy.config import EngineConfig, ModelConfig
    from raydeploy.engine.engine import Engine
    from raydeploy.model.registry import from_hf_config
    from raydeploy.model.sharding import build_mesh, merge_rules

    n = int(np.prod(list(mesh_shape.values())))
    mesh = build_mesh(mesh_shape, jax.devices()[:n])
    rules = merge_rules(None)
    reader = CheckpointReader(ckpt)
    family, cfg = from_hf_config(reader.hf_config)
    params, _ = reader.load(reader.param_specs(), mesh, {**family.rules, **rules}, "float32", 2, progress=False)
    engine_cfg = EngineConfig(max_slots=max_slots, page_size=8, prefill_chunk=8 * max_slots, decode_steps=4,
                              compilation_cache_dir=None, warmup=False, **engine_kw)
    return Engine(family, cfg, params, mesh, rules, ModelConfig(max_seq_len=MAX_SEQ_LEN, param_dtype="float32"),
                  engine_cfg)


@pytest.fixture(scope="module", params=sorted(CASES))
def family_checkpoint(request, tmp_path_factory) -> Path:
    return _checkpoint(request.param, tmp_path_factory.mktemp(f"spec-{request.param}"))


def _run(ckpt: Path, method: str, requests: list[GenerationRequest], mesh: dict[str, int] | None = None,
         max_slots: int = 2, engine: Any = None, **spec: Any) -> tuple[list[Any], Scheduler, Any]:
    """The requests through the real scheduler and an in-process step loop (all submitted at once)."""
    from raydeploy.config.schema import SpeculativeConfig

    sets = [f"engine.max_slots={max_slots}", f"engine.speculative.method={method}", "serving.max_queue=1024",
            *(f"engine.speculative.{k}={v}" for k, v in spec.items())]
    if engine is None:
        engine = _engine(ckpt, mesh or {"dp": 1}, speculative=SpeculativeConfig(method=method, **spec),
                         max_slots=max_slots)
    sched = Scheduler.for_engine(engine, load_config(None, sets))
    outs = LocalRunner(engine, sched).generate(requests)
    return outs, sched, engine


def _requests(max_tokens: int = 40, sampling: SamplingParams | None = None, prompts=PROMPTS) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", tuple(p), max_tokens, sampling or SamplingParams(), ignore_eos=True)
            for i, p in enumerate(prompts)]


def _same(got: list[Any], want: list[Any]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.finish_reason == w.finish_reason
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4, rtol=0)


def test_greedy_and_seeded_outputs_equal_those_without_speculation(family_checkpoint):
    """Every family, one device: greedy token for token, logprobs within 1e-4, with speculating rows verified
    and some of their proposals accepted; and seeded sampled requests (penalties, top-k, top-p) token for token."""
    base, _, _ = _run(family_checkpoint, "none", _requests())
    spec, sched, _ = _run(family_checkpoint, "ngram", _requests(), ngram_min=1)
    _same(spec, base)
    stats = sched.stats()
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    sampled = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11, repetition_penalty=1.1,
                             frequency_penalty=0.3)
    base, _, _ = _run(family_checkpoint, "none", _requests(24, sampled))
    spec, sched, _ = _run(family_checkpoint, "ngram", _requests(24, sampled), ngram_min=1)
    _same(spec, base)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    from tests.test_families import TINY

    return _checkpoint("qwen3", tmp_path_factory.mktemp("spec-qwen3"), TINY["qwen3"])


def test_dp2_with_chunked_prefill_and_prefix_hits_equals_no_speculation(qwen3):
    """dp=2 (two groups, each verifying its own rows), prompts longer than a chunk (32 tokens), and a prompt that
    shares whole pages with an earlier one (prefix-cache hits): the same tokens."""
    long = [int(t) for t in np.random.default_rng(0).integers(0, 128, 40)]
    prompts = [long + [5, 6, 5, 6, 5], long + [7, 8, 7, 8], *PROMPTS]
    first, second = prompts[:1], prompts[1:]
    results = {}
    for method in ("none", "ngram"):
        outs, sched, engine = _run(qwen3, method, _requests(30, prompts=first), {"dp": 2}, max_slots=4, ngram_min=1)
        runner = LocalRunner(engine, sched)  # the same scheduler: the second batch hits the first's cached pages
        outs += runner.generate(_requests(30, prompts=second))
        results[method] = (outs, sched.stats())
    _same(results["ngram"][0], results["none"][0])
    assert results["ngram"][1]["prefix_cache_hits"] > 0
    assert results["ngram"][1]["spec_decode_num_drafts"] > 0


def _pool_state(sched: Scheduler) -> list[tuple[int, int, frozenset[bytes]]]:
    return [(p.free_pages, p.cached_idle_pages, frozenset(p._page_of)) for p in sched.pools]


def test_rejected_proposals_roll_back_their_pages(qwen3, monkeypatch):
    """A proposer that is always wrong (each proposal one past the right token's guess): every proposal is
    rejected, the tokens are those without speculation, and afterwards the pools' free pages and prefix-cache
    keys are those of the run without speculation (no page of a rejected token was kept or cached)."""
    base, base_sched, _ = _run(qwen3, "none", _requests(40))
    right = ngram.propose

    def wrong(tokens, k, ngram_max, ngram_min):
        return [(t + 1) % 128 for t in right(tokens, k, ngram_max, ngram_min)] or [(int(tokens[-1]) + 1) % 128] * k

    monkeypatch.setattr(ngram, "propose", wrong)
    spec, sched, _ = _run(qwen3, "ngram", _requests(40), min_acceptance=0.0)
    _same(spec, base)
    stats = sched.stats()
    assert stats["spec_decode_num_draft_tokens"] > 100
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"] // 4
    assert _pool_state(sched) == _pool_state(base_sched)


SMALL_VOCAB = dict(model_type="qwen3", vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                   rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.5)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory) -> Path:
    return _checkpoint("small", tmp_path_factory.mktemp("spec-small"), SMALL_VOCAB)


def _frequencies(ckpt: Path, method: str, seeds: range, engine: Any = None) -> tuple[np.ndarray, Any]:
    """Counts [positions, vocab] of the tokens drawn at each of 4 generated positions over requests with `seeds`
    (temperature 1, top_k 8): the proposer proposes a fixed run of tokens, so proposals are accepted and rejected
    at each position."""
    sampling = [SamplingParams(temperature=1.0, top_k=8, seed=s) for s in seeds]
    reqs = [GenerationRequest(f"s{s}", (1, 2, 3, 1, 2, 3, 1), 4, sp, ignore_eos=True) for s, sp in zip(seeds, sampling,
                                                                                                      strict=True)]
    outs, _, engine = _run(ckpt, method, reqs, max_slots=8, engine=engine, max_rows=8, min_acceptance=0.0)
    counts = np.zeros((4, SMALL_VOCAB["vocab_size"]), np.int64)
    for o in outs:
        for j, t in enumerate(o.token_ids):
            counts[j, t] += 1
    return counts, engine


def _chi_square_p(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest p-value over positions of the chi-square test that `a` and `b` (counts per token) come from
    one distribution (tokens neither drew left out)."""
    ps = []
    for x, y in zip(a, b, strict=True):
        keep = (x + y) > 0
        ps.append(scipy_stats.chi2_contingency(np.stack([x[keep], y[keep]]))[1])
    return min(ps)


@pytest.mark.slow
def test_sampled_rule_keeps_the_distribution_and_a_broken_rule_does_not(small_vocab, monkeypatch):
    """Token frequencies at each of 4 positions over 400 requests (disjoint seeds) with and without speculation:
    the chi-square test does not reject at significance 0.001; with the acceptance rule broken on purpose
    (every proposal accepted) it does."""
    monkeypatch.setattr(ngram, "propose", lambda tokens, k, a, b: [1, 2, 3, 1][:k])
    off, _ = _frequencies(small_vocab, "none", range(400))
    on, engine = _frequencies(small_vocab, "ngram", range(1000, 1400))
    assert _chi_square_p(off, on) > SIGNIFICANCE
    monkeypatch.setattr(verify, "accept_lengths", lambda drawn, proposals: (proposals >= 0).sum(-1))
    engine._executables.clear()  # the verify programs trace the broken rule
    broken, _ = _frequencies(small_vocab, "ngram", range(2000, 2400))
    assert _chi_square_p(off, broken) < SIGNIFICANCE


def test_stop_token_and_max_tokens_inside_an_accepted_run_end_the_request_there(qwen3):
    """A greedy request whose output repeats (so runs of proposals are accepted): with a stop id that falls in the
    middle of its output, and with a max_tokens that does, it ends at exactly that token as without
    speculation (later accepted tokens dropped, their pages given back)."""
    free, _, _ = _run(qwen3, "none", _requests(40))
    out = free[0].token_ids
    stop = out[len(out) // 2]
    cut = out.index(stop)
    reqs = [GenerationRequest("stop", tuple(PROMPTS[0]), 40, stop_token_ids=(stop,), ignore_eos=True),
            GenerationRequest("length", tuple(PROMPTS[0]), 23, ignore_eos=True)]
    base, base_sched, _ = _run(qwen3, "none", reqs)
    spec, sched, _ = _run(qwen3, "ngram", reqs)
    _same(spec, base)
    assert spec[0].finish_reason == "stop" and spec[0].token_ids == out[:cut]
    assert spec[1].finish_reason == "length" and spec[1].token_ids == out[:23]
    assert sched.stats()["spec_decode_num_accepted_tokens"] > 0
    assert _pool_state(sched) == _pool_state(base_sched)


def test_metrics_carry_vllms_spec_decode_counters():
    from prometheus_client import CollectorRegistry, generate_latest

    from raydeploy.serve.metrics import _VllmGangGauges

    counters = SpecCounters()
    counters.note(4, 3)
    counters.note(4, 1)
    reg = CollectorRegistry()
    reg.register(_VllmGangGauges("m", counters.stats(), None))
    text = generate_latest(reg).decode()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 2.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 8.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 4.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0' in text
    reg = CollectorRegistry()
    reg.register(_VllmGangGauges("m", {}, None))
    assert "spec_decode" not in generate_latest(reg).decode()


@pytest.mark.parametrize("accepted", [4, 1])
def test_plans_after_a_copy_run_one_pass_while_the_lookup_finds_nothing(qwen3, monkeypatch, accepted):
    """A request whose verified row had `accepted` proposals accepted, whose lookup then finds nothing: warm
    (4 accepted), its next `RETRY_PLANS` plans run one pass each (the lookup asks again after every token), then
    `decode_steps`; cold (1 accepted), its plans take `decode_steps` at once. Its tokens are those without
    speculation either way."""
    req = [GenerationRequest("r", tuple(PROMPTS[0]), 30, ignore_eos=True)]
    want = _run(qwen3, "none", req)[0][0].token_ids
    calls = []

    def propose(tokens, k, ngram_max, ngram_min):  # the true continuation once (`accepted` right), then nothing
        calls.append(len(tokens))
        if len(calls) > 1:
            return []
        done = len(tokens) - len(PROMPTS[0])
        right = want[done:done + accepted]
        return right + [(t + 1) % 100 for t in want[done + accepted:done + 4]]

    monkeypatch.setattr(ngram, "propose", propose)
    engine = _engine(qwen3, {"dp": 1}, speculative=SpeculativeConfig(method="ngram"))
    steps: list[int] = []
    step = engine.step

    def record(plan: StepPlan) -> Any:
        if plan.seqs and all(q.sampling is None for q in plan.seqs):
            steps.append(-1 if any(q.spec for q in plan.seqs) else plan.decode_steps)
        return step(plan)

    engine.step = record
    got = _run(qwen3, "ngram", req, engine=engine)[0][0]
    assert got.token_ids == want
    assert steps[0] == -1  # the verified row
    retries = RETRY_PLANS if accepted >= WARM_ACCEPTED else 0
    assert steps[1:1 + retries] == [1] * retries and steps[1 + retries] == 4
