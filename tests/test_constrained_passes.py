"""Constrained rows in multi-pass plans (`ConstrainedDraws.shared_passes`): a decode plan that holds constrained and
unconstrained rows runs `decode_steps` passes, the constrained rows drawing in the first only
(`SeqStep.first_pass_only`).

- the scheduler, with a stand-in engine: such plans pass `decode_steps` times, a constrained row takes one token
  from each, the unconstrained rows every pass's; off (the default) they pass once, as before;
- the real demo engine: a constrained row in a plan of several passes leaves the slot's last token at its one
  draw, and its plan's later token rows hold 0 for it;
- the real demo engine behind the real scheduler and grammar engine (`model`, slow): with presence and frequency
  penalties on every request (a token state written in the later passes would change the next draws) and a
  staggered arrival, every request, constrained or not, gets the tokens it gets alone, while the unconstrained
  rows beside the constrained one take several tokens a plan.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_constrained_engine import pack_bits
from test_engine_paged import _build_engine
from test_scheduler_constraints import JSON_C as SMALL_C
from test_scheduler_constraints import VOCAB, allowed_ids
from transformers import AutoTokenizer

from raydeploy.config import Config, EngineConfig, ModelConfig
from raydeploy.constraints import Constraint, GrammarEngine
from raydeploy.engine.local import LocalRunner
from raydeploy.engine.request import GenerationRequest
from raydeploy.engine.scheduler import Paging, Scheduler
from raydeploy.engine.step import PageUpdate, SamplingParams, SeqStep, StepPlan, StepResult

EOS = 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                    "minItems": 2, "maxItems": 4}},
          "required": ["name", "tags"], "additionalProperties": False}
JSON_C = Constraint("json_schema", json.dumps(SCHEMA))


class PassEngine:
    """A stand-in engine that runs a plan as the real one does: a row with a mask draws in the first pass only (its
    later token rows 0), the lowest token its mask allows; an unconstrained row draws 100 + its position in every
    pass. Keeps every plan."""

    def __init__(self) -> None:
        self.plans: list[StepPlan] = []

    def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        tokens = np.zeros((plan.decode_steps, len(plan.seqs)), np.int32)
        for i, q in enumerate(plan.seqs):
            for k in range(1 if q.first_pass_only else plan.decode_steps):
                pos = q.start + max(len(q.tokens), 1) + k
                tokens[k, i] = int(allowed_ids(q.allowed)[0]) if q.allowed is not None else 100 + pos
        return StepResult(plan.step_id, tokens=tokens, logprobs=np.zeros(tokens.shape, np.float32))


@pytest.fixture(scope="module")
def grammar(demo_checkpoint) -> GrammarEngine:
    return GrammarEngine.from_checkpoint(demo_checkpoint, VOCAB, [EOS])


def _mixed_run(grammar: GrammarEngine, shared: bool) -> tuple[PassEngine, dict]:
    sched = Scheduler(4, 128, (EOS,), 16, Paging(4, 256, 1, 64), decode_steps=4, vocab_size=VOCAB, grammar=grammar)
    sched.constrained.shared_passes = shared
    eng = PassEngine()
    reqs = [GenerationRequest("c", (1, 9, 9, 9, 5), 60, SamplingParams(), constraint=SMALL_C),
            GenerationRequest("p", (1, 9, 9, 9, 5), 30, SamplingParams())]
    outs = {o.request_id: o for o in LocalRunner(eng, sched).generate(reqs, timeout_s=10)}
    assert sched.slots_in_use == 0
    return eng, outs


def _mixed(plan: StepPlan) -> bool:
    """A decode plan with a constrained and an unconstrained row."""
    decode = [q for q in plan.seqs if not len(q.tokens)]
    return any(q.allowed is not None for q in decode) and any(q.allowed is None for q in decode)


def test_the_scheduler_passes_mixed_plans_decode_steps_times_when_shared_and_once_when_not(grammar):
    eng, outs = _mixed_run(grammar, shared=True)
    off, once = _mixed_run(grammar, shared=False)
    # the same tokens either way: each row's draws do not depend on the plans' passes
    for rid in ("c", "p"):
        assert outs[rid].token_ids == once[rid].token_ids and outs[rid].finish_reason == once[rid].finish_reason
    assert outs["c"].finish_reason == "stop" and outs["p"].finish_reason == "length"
    assert outs["p"].token_ids == [100 + 5 + k for k in range(30)]
    mixed = [plan for plan in eng.plans if _mixed(plan)]
    assert mixed and all(plan.decode_steps == 4 for plan in mixed[:-1])  # the last may be cut by p's max_tokens
    # one mask per draw of c (its last chunk's, then one per plan it decodes in)
    masked = [plan for plan in eng.plans if any(q.allowed is not None for q in plan.seqs)]
    assert len(masked) == len(outs["c"].token_ids)
    p_plans = [plan for plan in eng.plans if any(q.allowed is None and q.sample for q in plan.seqs)]
    assert len(p_plans) <= 1 + -(-29 // 4) + 1  # its first token, then four a plan (one plan cut short at most)
    off_mixed = [plan for plan in off.plans if _mixed(plan)]
    assert off_mixed and all(plan.decode_steps == 1 for plan in off_mixed)
    assert len(off.plans) > len(eng.plans)


@pytest.fixture(scope="module")
def engine(demo_checkpoint):
    return _build_engine(demo_checkpoint, {"dp": 1}, max_seq_len=256, max_slots=4, prefill_chunk=64,
                         decode_steps=4)


@pytest.mark.model
def test_the_engine_leaves_a_constrained_row_out_of_later_passes(engine, prompt_ids):
    """A plan of four passes with a constrained row (one allowed token) and an unconstrained one: the constrained
    row's later token rows are 0 and its slot's last token stays its one draw; the unconstrained row draws four."""
    a, b = (np.asarray(prompt_ids[i][:24], np.int32) for i in range(2))
    per = -(-(max(a.size, b.size) + 8) // engine.page_size)
    pages = [PageUpdate(s, 0, np.arange(per, dtype=np.int32) + per * s) for s in range(2)]
    engine.step(StepPlan(0, seqs=(SeqStep(0, a, 0, True, SamplingParams()), SeqStep(1, b, 0, True, SamplingParams())),
                         pages=tuple(pages)))
    forced = 4321
    masked = SeqStep(0, np.zeros(0, np.int32), a.size, True, allowed=pack_bits([forced], engine.vocab_size))
    free = SeqStep(1, np.zeros(0, np.int32), b.size, True)
    got = engine.step(StepPlan(1, seqs=(masked, free), decode_steps=4))
    assert got.tokens[:, 0].tolist() == [forced, 0, 0, 0]
    assert int(np.asarray(engine.last_tokens).reshape(-1)[0]) == forced
    assert int(np.asarray(engine.last_tokens).reshape(-1)[1]) == int(got.tokens[3, 1])
    engine.step(StepPlan(2, release=(0, 1)))


@pytest.mark.model
@pytest.mark.slow
def test_mixed_plans_keep_every_requests_alone_tokens_with_penalties(engine, demo_checkpoint, prompt_ids):
    cfg = Config(model=ModelConfig(max_seq_len=256),
                 engine=EngineConfig(max_slots=4, max_new_tokens=64, prefill_chunk=64, decode_steps=4))
    grammar = GrammarEngine.from_checkpoint(demo_checkpoint, engine.vocab_size, engine.eos_ids)

    def runner(shared: bool) -> tuple[LocalRunner, list[StepPlan]]:
        sched = Scheduler.for_engine(engine, cfg, grammar=grammar)
        sched.constrained.shared_passes = shared
        run = LocalRunner(engine, sched)
        plans: list[StepPlan] = []

        def step(plan: StepPlan) -> StepResult:
            plans.append(plan)
            return engine.step(plan)

        run.loop.run = step
        return run, plans

    pen = {"presence_penalty": 0.8, "frequency_penalty": 0.6}
    reqs = {
        "c": GenerationRequest("c", tuple(prompt_ids[0]), 48, SamplingParams(temperature=1.0, seed=5, **pen),
                               constraint=JSON_C),
        "u": GenerationRequest("u", tuple(prompt_ids[1]), 24, SamplingParams(temperature=0.9, seed=6, **pen),
                               ignore_eos=True),
        "g": GenerationRequest("g", tuple(prompt_ids[2]), 16, SamplingParams(frequency_penalty=1.5),
                               ignore_eos=True),
    }
    alone = {}
    for rid, r in reqs.items():
        run, _ = runner(shared=True)
        (alone[rid],) = run.generate([r], timeout_s=600)
    run, plans = runner(shared=True)
    streams = {rid: run.submit(reqs[rid]) for rid in ("c", "u")}
    for _ in range(4):  # g arrives while c and u decode
        run.step_once()
    streams["g"] = run.submit(reqs["g"])
    run.run_until_idle()
    together = {rid: s.result(600) for rid, s in streams.items()}
    for rid in reqs:
        assert together[rid].error is None, together[rid].error
        assert together[rid].token_ids == alone[rid].token_ids, rid
    assert together["c"].finish_reason == "stop"
    tok = AutoTokenizer.from_pretrained(str(demo_checkpoint), local_files_only=True)
    assert set(json.loads(tok.decode(together["c"].token_ids))) == {"name", "tags"}
    mixed = [p for p in plans if _mixed(p)]
    assert mixed and max(p.decode_steps for p in mixed) == 4
    u_slot = next(q.slot for p in plans for q in p.seqs if q.sampling is not None and q.sampling.seed == 6)
    u_plans = [p for p in plans if any(q.slot == u_slot and not len(q.tokens) for q in p.seqs)]
    # 23 tokens after its first, several a plan (one a plan would take 23 plans; g's prompt chunks and the
    # passes its prompt waits for take a few of one pass)
    assert len(u_plans) <= 12 and sum(p.decode_steps > 1 for p in u_plans) >= 3

