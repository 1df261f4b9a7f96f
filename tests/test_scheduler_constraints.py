"""The scheduler's constrained requests (structured outputs) with the real grammar engine over the demo tokenizer,
driven by a fake engine: masks ride only on constrained sampling rows, plans with one pass once, the grammar's end
finishes "stop", an empty mask or a refused token fails just that request, a failed step leaves the matcher where
it was, and unconstrained rows beside them get what they get alone. Masks are filled in one batch with the bits of
row-by-row fills, and outside the scheduler's lock (`submit` and `abort` do not wait on them). Then the real demo
engine through LocalRunner: sampled JSON under a schema always validates (`model`, slow)."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from raydeploy.constraints import Constraint, GrammarEngine, words_for
from raydeploy.engine.local import LocalRunner
from raydeploy.engine.request import GenerationRequest, RequestFailed, TokenEvent
from raydeploy.engine.scheduler import Paging, Scheduler
from raydeploy.engine.step import SamplingParams, StepPlan, StepResult

EOS = 2
VOCAB = 49152
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]},
                                           "n": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["color", "n"], "additionalProperties": False}
JSON_C = Constraint("json_schema", json.dumps(SCHEMA))


def allowed_ids(words: np.ndarray) -> np.ndarray:
    return np.nonzero(np.unpackbits(np.asarray(words, np.uint32).view(np.uint8), bitorder="little"))[0]


class MaskedEngine:
    """A stand-in engine: a constrained row draws the lowest token its mask allows (or `force`'s token, mask or
    not); an unconstrained row draws 100 + its position (so its tokens do not depend on what shares its plan).
    Keeps every plan."""

    def __init__(self, force: dict[int, int] | None = None) -> None:
        self.plans: list[StepPlan] = []
        self.force = force or {}

    def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        tokens = np.zeros((plan.decode_steps, len(plan.seqs)), np.int32)
        for i, q in enumerate(plan.seqs):
            if q.allowed is not None:
                assert plan.decode_steps == 1 and q.sample
                assert q.allowed.shape == ((VOCAB + 31) // 32,) and q.allowed.dtype == np.uint32
            for k in range(plan.decode_steps):
                pos = q.start + max(len(q.tokens), 1) + k
                if pos in self.force:
                    tokens[k, i] = self.force[pos]
                elif q.allowed is not None:
                    tokens[k, i] = int(allowed_ids(q.allowed)[0])
                else:
                    tokens[k, i] = 100 + pos
        return StepResult(plan.step_id, tokens=tokens, logprobs=np.zeros(tokens.shape, np.float32))


@pytest.fixture(scope="module")
def grammar(demo_checkpoint) -> GrammarEngine:
    return GrammarEngine.from_checkpoint(demo_checkpoint, VOCAB, [EOS])


def make(grammar, decode_steps=4, max_slots=4, engine=None):
    sched = Scheduler(max_slots, 128, (EOS,), 16, Paging(4, 256, 1, 64), decode_steps=decode_steps,
                      vocab_size=VOCAB, grammar=grammar)
    eng = engine or MaskedEngine()
    return sched, eng, LocalRunner(eng, sched)


def req(rid, constraint=None, prompt=(1, 9, 9, 9, 5), max_tokens=40):
    return GenerationRequest(rid, tuple(prompt), max_tokens, SamplingParams(), constraint=constraint)


def text(grammar, ids) -> str:
    return grammar.tokenizer.decode_str(list(ids))


def test_constrained_rows_carry_masks_and_pass_once_while_unconstrained_ones_are_unaffected(grammar):
    alone_sched, _, alone = make(grammar)
    (plain_alone,) = alone.generate([req("p", max_tokens=30)], timeout_s=10)
    sched, eng, runner = make(grammar)
    outs = {o.request_id: o for o in runner.generate([req("c", JSON_C), req("p", max_tokens=30)], timeout_s=10)}
    c, p = outs["c"], outs["p"]
    # the lowest allowed token each time still writes a valid output, and the grammar's end finishes it
    assert c.finish_reason == "stop" and c.error is None
    value = json.loads(text(grammar, c.token_ids))
    assert value["color"] in ("red", "blue") and 1 <= value["n"] <= 9
    assert p.token_ids == plain_alone.token_ids and p.finish_reason == plain_alone.finish_reason == "length"
    c_slot = next(q.slot for q in eng.plans[0].seqs if q.allowed is not None)
    for plan in eng.plans:
        for q in plan.seqs:  # every sampling row of c, and no other row, carries a mask
            assert (q.allowed is not None) == (q.slot == c_slot and q.sample)
        if any(q.allowed is not None for q in plan.seqs):
            assert plan.decode_steps == 1
    masked = [plan for plan in eng.plans if any(q.allowed is not None for q in plan.seqs)]
    assert len(masked) == len(c.token_ids)  # one mask per draw: the last chunk's, then every decode row's
    assert max(plan.decode_steps for plan in eng.plans) == 4  # once c ended, p's plans pass four times again
    assert sched.stats()["constraint_masks"] == len(c.token_ids) and sched.slots_in_use == 0


def test_grammar_end_carries_the_last_token_and_eos_where_the_grammar_may_end_stops_as_before(grammar):
    sched, _, runner = make(grammar)
    events: list[TokenEvent] = []
    sched.submit(req("choice", Constraint("choice", '["yes", "no"]')), events.append)
    runner.run_until_idle()
    assert events[-1].finish_reason == "stop" and events[-1].token_id is not None
    assert text(grammar, [e.token_id for e in events]) in ("yes", "no")
    # "ab+" may end after "ab": the lowest allowed token is then eos (2), which ends it as any eos does
    (out,) = runner.generate([req("regex", Constraint("regex", "ab+"))], timeout_s=10)
    assert text(grammar, out.token_ids) == "ab" and out.finish_reason == "stop"


def test_a_grammar_that_allows_no_token_fails_its_request_and_not_the_others(demo_checkpoint):
    """A model vocabulary of the tokenizer's special tokens only: the regex's first character has no token."""
    narrow = GrammarEngine.from_checkpoint(demo_checkpoint, 17, [EOS])
    sched = Scheduler(2, 128, (EOS,), 16, Paging(4, 256, 1, 64), decode_steps=1, grammar=narrow)
    eng = MaskedEngine()
    outs = {o.request_id: o for o in LocalRunner(eng, sched).generate(
        [req("bad", Constraint("regex", "abc")), req("ok", max_tokens=3)], timeout_s=10)}
    bad = outs["bad"]
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert "request bad failed: its regex constraint allows no next token after 0 generated" in bad.error
    assert outs["ok"].finish_reason == "length" and len(outs["ok"].token_ids) == 3
    assert all(q.allowed is None for plan in eng.plans for q in plan.seqs)  # its prompt was never planned
    assert sched.slots_in_use == 0 and sched.stats()["requests_failed"] == 1


def test_a_token_the_mask_did_not_allow_fails_its_request(grammar):
    """An engine that ignores the mask (draws "<|endoftext|>", id 0, at the second output position)."""
    sched, _, runner = make(grammar, engine=MaskedEngine(force={6: 0}))
    events: list[TokenEvent] = []
    sched.submit(req("c", JSON_C), events.append)
    runner.run_until_idle()
    assert [e.token_id is not None for e in events] == [True, False]
    last = events[-1]
    assert last.finish_reason == "error" and not last.invalid and not last.retriable
    assert "request c failed: token 0 (output position 1) is not allowed by its json_schema constraint" in last.error
    assert sched.slots_in_use == 0


def test_refused_at_submit_without_a_grammar_engine_or_when_it_does_not_compile(grammar):
    none = Scheduler(2, 128, (EOS,), 4, Paging(4, 64, 1, 64))
    with pytest.raises(RequestFailed, match=r"request a: structured output \(json_schema constraint\) is not "
                                            "available") as e:
        none.submit(req("a", JSON_C), lambda ev: None)
    assert e.value.invalid and e.value.request_ids == ("a",)
    sched, _, _ = make(grammar)
    with pytest.raises(RequestFailed, match=r"request b: regex constraint: the regex cannot be used: (.|\n)*unclosed group") as e:
        sched.submit(req("b", Constraint("regex", "a(b")), lambda ev: None)
    assert e.value.invalid and sched.queue_depth == 0


def test_a_failed_step_leaves_the_matcher_where_it_was(grammar):
    """Undo a step that carried a constrained decode row (the engine blamed another row): the matcher has not
    moved, the row is planned again with the same mask, and the output is what it is without the failure."""
    _, _, alone = make(grammar)
    (expected,) = alone.generate([req("c", JSON_C)], timeout_s=10)
    sched, eng, runner = make(grammar)
    c = runner.submit(req("c", JSON_C))
    v = runner.submit(req("victim", max_tokens=30))
    for _ in range(3):
        runner.step_once()
    run = next(r for r in sched._slots if r is not None and r.req.request_id == "c")
    tokens_before = run.matcher.tokens
    plan = sched.next_plan()
    c_row = next(q for q in plan.seqs if q.allowed is not None)
    victim_slot = next(q.slot for q in plan.seqs if q.allowed is None)
    assert sched.step_failed(plan, RequestFailed("bad row", slots=(victim_slot,)))
    assert run.matcher.tokens == tokens_before
    again = sched.next_plan()
    assert np.array_equal(next(q.allowed for q in again.seqs if q.slot == c_row.slot), c_row.allowed)
    sched.on_result(again, eng.step(again))
    runner.run_until_idle()
    c_out, v_out = c.result(5), v.result(5)
    assert c_out.token_ids == expected.token_ids and c_out.finish_reason == "stop"
    assert v_out.finish_reason == "error" and "bad row" in v_out.error


def test_abort_and_fail_all_drop_constrained_requests(grammar):
    sched, _, runner = make(grammar)
    a = runner.submit(req("a", JSON_C))
    b = runner.submit(req("b", Constraint("choice", '["yes", "no"]')))
    runner.step_once()
    assert sched.abort("a")
    sched.fail_all("gang lost", retriable=True)
    assert a.result(5).finish_reason == "abort" and b.result(5).finish_reason == "error"
    assert sched.slots_in_use == 0 and sched.next_plan().seqs == ()


def test_for_engine_passes_the_grammar_engine(grammar):
    from raydeploy.config import load_config

    geometry = SimpleNamespace(max_slots=2, max_seq_len=64, page_size=4, pages_per_group=32, groups=1,
                               max_step_tokens=16, mixed_step_tokens=None)
    engine = SimpleNamespace(geometry=geometry, window_rings=False, eos_ids=(EOS,), slot_order=[0, 1],
                             vocab_size=VOCAB)
    sched = Scheduler.for_engine(engine, load_config(None), grammar=grammar)
    assert sched.grammar is grammar and sched.constrained.grammar is grammar
    sched.submit(req("a", JSON_C), lambda ev: None)
    assert sched.queue_depth == 1


@pytest.mark.parametrize("model_vocab", [VOCAB + 100, VOCAB - 152], ids=["wider", "narrower"])
def test_a_batch_fill_gives_the_bits_of_row_by_row_fills(demo_checkpoint, model_vocab):
    """Matchers of several grammars at different positions (one at its start, one failed), over a model vocabulary
    wider than the tokenizer's (padded ids never allowed) and a narrower one (llguidance's wider rows cut)."""
    g = GrammarEngine.from_checkpoint(demo_checkpoint, model_vocab, [EOS])
    walks = [(JSON_C, '{"color":"re'), (JSON_C, ""), (Constraint("regex", "ab+c"), "abbb"),
             (Constraint("choice", '["yes", "no"]'), "n"), (Constraint("json_object", ""), '{"a":[1,{"b"'),
             (JSON_C, '{"color":"blue","n":')]
    matchers = []
    for c, prefix in walks:
        m = g.matcher(c)
        for t in g.tokenizer.tokenize_str(prefix):
            assert m.accept(t), (c, prefix)
        matchers.append(m)
    failed = g.matcher(JSON_C)
    assert not failed.accept(model_vocab - 1)  # past the tokenizer's ids (narrower: a real id the grammar refuses)
    matchers.append(failed)
    words = np.full((len(matchers), words_for(model_vocab)), 0xFFFFFFFF, np.uint32)  # stale bits to overwrite
    g.fill(matchers, words)
    for row, m in zip(words, matchers, strict=True):
        assert np.array_equal(row, m.mask())
    counts = [len(allowed_ids(row)) for row in words]
    assert counts[-1] == 0 and all(0 < n < g.tokenizer_vocab for n in counts[:-1])
    assert len(set(counts[:-1])) > 2  # different positions, different masks
    assert allowed_ids(words[1]).max() < min(model_vocab, g.tokenizer_vocab)
    assert [m.tokens for m in matchers[:3]] == [len(g.tokenizer.tokenize_str(p)) for _, p in walks[:3]]  # unmoved
    with pytest.raises(ValueError, match=r"mask buffer must be contiguous uint32 \[7, "):
        g.fill(matchers, words[:, :-1].copy())
    other = GrammarEngine.from_checkpoint(demo_checkpoint, VOCAB, [EOS])
    with pytest.raises(ValueError, match="was not made by this grammar engine"):
        other.fill([matchers[0]], np.zeros((1, words_for(VOCAB)), np.uint32))


class GatedGrammar(GrammarEngine):
    """The real grammar engine whose batch fill, once `armed`, says it started (`entered`) and waits for `release`
    (bounded) before filling."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def fill(self, matchers, words) -> None:
        if self.armed:
            self.entered.set()
            assert self.release.wait(10), "the test never released the fill"
        super().fill(matchers, words)


def test_submit_and_abort_do_not_wait_for_masks_being_filled(demo_checkpoint):
    """While the step loop fills a running constrained stream's mask, another thread submits a request and aborts
    the stream: both return at once; the plan made after the fill leaves the aborted stream out and admits the
    new request."""
    gated = GatedGrammar.from_checkpoint(demo_checkpoint, VOCAB, [EOS])
    sched, eng, runner = make(gated, decode_steps=1)
    c = runner.submit(req("c", JSON_C))
    runner.step_once()  # c's prompt and first token: it decodes next, its mask filled before planning
    assert sched.stats()["constraint_masks"] == 1
    gated.armed = True
    plans: list[StepPlan | None] = []
    loop = threading.Thread(target=lambda: plans.append(sched.next_plan()), daemon=True)
    loop.start()
    try:
        assert gated.entered.wait(10)
        p_events: list[TokenEvent] = []
        aborted: list[bool] = []
        other = threading.Thread(target=lambda: (sched.submit(req("p", max_tokens=2), p_events.append),
                                                 aborted.append(sched.abort("c"))), daemon=True)
        other.start()
        other.join(5)
        assert not other.is_alive() and aborted == [True], "submit or abort waited for the mask fill"
        assert loop.is_alive() and not plans  # the fill still waits
        assert sched.queue_depth == 1
    finally:
        gated.release.set()
        loop.join(10)
    assert not loop.is_alive()
    (plan,) = plans
    assert plan is not None and [q.allowed for q in plan.seqs] == [None]  # p's prompt only: c is gone
    assert c.result(5).finish_reason == "abort"
    sched.on_result(plan, eng.step(plan))
    gated.armed = False
    runner.run_until_idle()
    assert [e.finish_reason for e in p_events] == [None, "length"] and sched.slots_in_use == 0


# -- the real demo engine

E2E_SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 100},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}},
    "required": ["color", "count", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def demo_runner(demo_checkpoint):
    from test_engine_paged import _build_engine
    from transformers import AutoTokenizer

    from raydeploy.config import Config, EngineConfig, ModelConfig

    engine = _build_engine(demo_checkpoint, {"dp": 1}, max_seq_len=256, max_slots=4, prefill_chunk=64,
                           decode_steps=4)
    cfg = Config(model=ModelConfig(max_seq_len=256),
                 engine=EngineConfig(max_slots=4, max_new_tokens=64, prefill_chunk=64, decode_steps=4))
    grammar = GrammarEngine.from_checkpoint(demo_checkpoint, engine.vocab_size, engine.eos_ids)
    sched = Scheduler.for_engine(engine, cfg, grammar=grammar)
    tok = AutoTokenizer.from_pretrained(str(demo_checkpoint), local_files_only=True)
    return LocalRunner(engine, sched), tok


@pytest.mark.model
@pytest.mark.slow
def test_sampled_json_under_a_schema_always_validates_on_the_demo_engine(demo_runner):
    """Temperature 1, several seeds, side by side with an unconstrained stream: each constrained output ends
    with the grammar ("stop") and validates against the schema (enum, integer bounds, array min/max items)."""
    jsonschema = pytest.importorskip("jsonschema")
    runner, tok = demo_runner
    msgs = [{"role": "user", "content": "Describe a fruit as JSON with a color, a count and some tags."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    prompt = tuple(int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids))
    c = Constraint("json_schema", json.dumps(E2E_SCHEMA))
    reqs = [GenerationRequest(f"s{seed}", prompt, 96, SamplingParams(temperature=1.0, seed=seed), constraint=c)
            for seed in range(6)]
    plain = GenerationRequest("plain", prompt, 24, SamplingParams(temperature=1.0, seed=7))
    outs = {o.request_id: o for o in runner.generate([*reqs, plain], timeout_s=600)}
    texts = set()
    for r in reqs:
        out = outs[r.request_id]
        assert out.finish_reason == "stop", (out.finish_reason, out.error, tok.decode(out.token_ids))
        text = tok.decode(out.token_ids)
        jsonschema.validate(json.loads(text), E2E_SCHEMA)
        texts.add(text)
    assert len(texts) > 1  # sampled, not one forced string
    assert outs["plain"].finish_reason in ("stop", "length") and outs["plain"].error is None
    (again,) = runner.generate([plain], timeout_s=600)
    assert again.token_ids == outs["plain"].token_ids  # the constrained rows beside it changed nothing
