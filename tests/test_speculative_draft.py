"""The draft-model method of speculative decoding (`raydeploy.engine.speculative.draft`): a second, smaller model
of the same vocabulary proposes k greedy tokens per speculating row, inside every host's engine step, with its
own KV pool under the target's page table; the target verifies them as it verifies the ngram method's.

Real engines over tiny random models (transformers' seeded weights, converted by our converter), driven by the real
scheduler and step loop, with and without `engine.speculative.method: draft`:
- greedy tokens and logprobs equal those without speculation, with a one-layer draft of the same family and
  vocabulary, with prompts longer than a step's chunk (the draft catches up over several chunks) and prefix-cache
  hits (the draft rewrites its K/V of the reused pages), on one device and with dp=2;
- the target as its own draft: every proposal of a greedy request is accepted (the acceptance counters say so),
  which holds only if the draft's K/V are kept right through catch-up, rollback and reuse;
- seeded sampled requests emit the same tokens as without speculation;
- a draft of another vocabulary size is refused before a weight is read, naming both sizes;
- after many rejected proposals the pools' free pages and prefix-cache keys equal a run without speculation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from raydeploy.engine.local import LocalRunner  # noqa: E402
from raydeploy.engine.request import GenerationRequest  # noqa: E402
from raydeploy.engine.speculative.draft import DRAFT_PLACEHOLDER, Drafter, check_vocab  # noqa: E402
from raydeploy.engine.step import SamplingParams  # noqa: E402
from tests.test_families import TINY  # noqa: E402
from tests.test_speculative import PROMPTS, _checkpoint, _engine, _pool_state, _requests, _run, _same  # noqa: E402

TARGET = TINY["qwen3"]
DRAFT = {**TARGET, "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 2,
         "num_key_value_heads": 1}
"""A smaller model of the target's family and vocabulary (its own random weights)."""


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return _checkpoint("qwen3", tmp_path_factory.mktemp("draft-target"), TARGET)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory) -> Path:
    return _checkpoint("qwen3", tmp_path_factory.mktemp("draft-small"), DRAFT)


def _draft_engine(ckpt: Path, draft: Path, mesh: dict[str, int] | None = None, max_slots: int = 2,
                  **spec: Any) -> Any:
    """A target engine (as test_speculative's) with `draft` attached the way bring-up attaches it
    (`raydeploy.loading.build_drafter`)."""
    from raydeploy.config import EngineConfig, ModelConfig
    from raydeploy.config.schema import SpeculativeConfig
    from raydeploy.loading import build_drafter
    from raydeploy.model.sharding import merge_rules
    from tests.test_engine_families import MAX_SEQ_LEN

    sc = SpeculativeConfig(method="draft", draft_checkpoint=str(draft), **spec)
    engine = _engine(ckpt, mesh or {"dp": 1}, max_slots=max_slots, speculative=sc)
    engine_cfg = EngineConfig(max_slots=max_slots, page_size=8, prefill_chunk=8 * max_slots, decode_steps=4,
                              compilation_cache_dir=None, warmup=False, speculative=sc)
    model_cfg = ModelConfig(max_seq_len=MAX_SEQ_LEN, param_dtype="float32", load_threads=2)
    engine.attach_draft(build_drafter(engine, engine.mesh, merge_rules(None), model_cfg, engine_cfg))
    return engine


def _run_draft(ckpt: Path, draft: Path, requests: list[GenerationRequest], mesh: dict[str, int] | None = None,
               max_slots: int = 2, engine: Any = None, **spec: Any) -> tuple[list[Any], Any, Any]:
    if engine is None:
        engine = _draft_engine(ckpt, draft, mesh, max_slots, **spec)
    return _run(ckpt, "draft", requests, mesh, max_slots, engine=engine, draft_checkpoint=str(draft), **spec)


# Engines shared by the one-device tests (each run has its own scheduler, so it starts every slot afresh: a first
# chunk sends its slot's whole page-table row and starts the draft's record of the slot over).

@pytest.fixture(scope="module")
def plain(target) -> Any:
    return _engine(target, {"dp": 1})


@pytest.fixture(scope="module")
def with_small(target, small_draft) -> Any:
    return _draft_engine(target, small_draft)


@pytest.fixture(scope="module")
def with_itself(target) -> Any:
    return _draft_engine(target, target)


# -- host parts -------------------------------------------------------------------------------------------------

def test_a_draft_of_another_vocabulary_is_refused_naming_both_sizes(tmp_path):
    """A converted draft checkpoint of 96 tokens for a target of 128: refused from its config alone, before a
    weight of either model is read (`build_engine` checks it before reading the target's), naming both sizes."""
    import jax

    from raydeploy.loading import read_draft
    from raydeploy.model.sharding import build_mesh

    check_vocab(128, 128, "d")
    other = _checkpoint("qwen3", tmp_path, {**DRAFT, "vocab_size": 96})
    mesh = build_mesh({"dp": 1}, jax.devices()[:1])
    with pytest.raises(ValueError, match=r"draft_checkpoint .*: the draft model's vocab_size 96 differs from the "
                                         r"target model's vocab_size 128"):
        read_draft(str(other), 128, mesh)
    reader, _, model = read_draft(str(other), 96, mesh)
    assert model.vocab_size == 96 and reader.path == other


def test_the_scheduler_plans_placeholders_for_the_draft():
    from raydeploy.config import load_config
    from raydeploy.engine.speculative.policy import SpeculationPolicy

    cfg = load_config(None, ["engine.speculative.method=draft", "engine.speculative.draft_checkpoint=/x"])
    policy = SpeculationPolicy.from_config(cfg.engine.speculative)
    assert policy is not None and policy.method == "draft"
    from raydeploy.config.schema import SpeculativeConfig

    with pytest.raises(ValueError, match="needs engine.speculative.draft_checkpoint"):
        SpeculationPolicy.from_config(SpeculativeConfig(method="draft"))
    assert DRAFT_PLACEHOLDER == 0


# -- engines ----------------------------------------------------------------------------------------------------

LONG = [int(t) for t in np.random.default_rng(0).integers(0, 128, 40)]


def test_greedy_outputs_with_a_small_draft_equal_those_without(target, small_draft, plain, with_small):
    """A one-layer draft: greedy tokens and logprobs as without speculation, over prompts longer than a chunk
    (16 tokens a step: the draft catches up over several of its own chunks) and a second batch that reuses the
    first's cached pages (the draft rewrites its K/V there)."""
    prompts = [LONG + [5, 6, 5, 6, 5], *PROMPTS]
    second = [LONG + [7, 8, 7, 8]]
    results = {}
    steps_before = with_small.draft.draft_steps
    for method in ("none", "draft"):
        if method == "none":
            outs, sched, engine = _run(target, "none", _requests(30, prompts=prompts), engine=plain)
        else:
            outs, sched, engine = _run_draft(target, small_draft, _requests(30, prompts=prompts), engine=with_small,
                                             min_acceptance=0.0)
        outs += LocalRunner(engine, sched).generate(_requests(30, prompts=second))
        results[method] = (outs, sched.stats(), engine)
    _same(results["draft"][0], results["none"][0])
    stats = results["draft"][1]
    assert stats["prefix_cache_hits"] > 0
    assert stats["spec_decode_num_drafts"] > 0
    drafter: Drafter = results["draft"][2].draft
    # the draft model ran: a catch-up step at least for every plan with speculating rows (2 slots: 2 rows at most)
    assert drafter.draft_steps - steps_before >= stats["spec_decode_num_drafts"] // 2 > 0
    reported = results["draft"][2].status()["draft"]  # what the host's /status shows
    assert reported["steps"] == drafter.draft_steps and reported["unknown_rows"] == 0
    assert "draft" not in results["none"][2].status()


def test_the_target_as_its_own_draft_accepts_every_greedy_proposal(target, plain, with_itself):
    """The target drafting for itself: every greedy proposal equals the target's argmax, so all are accepted (the
    draft's K/V were kept right: caught up over chunks, rolled back, reused) and the outputs are those without."""
    prompts = [LONG + [5, 6, 5], *PROMPTS]
    base, _, _ = _run(target, "none", _requests(30, prompts=prompts), engine=plain)
    spec, sched, _ = _run_draft(target, target, _requests(30, prompts=prompts), engine=with_itself)
    _same(spec, base)
    stats = sched.stats()
    assert stats["spec_decode_num_draft_tokens"] > 40
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_acceptance_rate"] == 1.0
    assert with_itself.draft.unknown == 0  # every speculating row was drafted


def test_seeded_sampled_outputs_equal_those_without(target, small_draft, plain, with_small):
    """Sampled requests (penalties, top-k, top-p) with seeds: each draw keeps its position's key, so the draft's
    greedy proposals change no token."""
    sampled = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11, repetition_penalty=1.1,
                             frequency_penalty=0.3)
    base, _, _ = _run(target, "none", _requests(24, sampled), engine=plain)
    spec, sched, _ = _run_draft(target, small_draft, _requests(24, sampled), engine=with_small, min_acceptance=0.0)
    _same(spec, base)
    assert sched.stats()["spec_decode_num_drafts"] > 0


def test_rejected_draft_proposals_roll_back_their_pages(target, small_draft, plain, with_small):
    """The small random draft is mostly wrong: many proposals are rejected, the tokens are those without
    speculation, and the pools' free pages and prefix-cache keys end as without speculation."""
    base, base_sched, _ = _run(target, "none", _requests(40), engine=plain)
    spec, sched, _ = _run_draft(target, small_draft, _requests(40), engine=with_small, min_acceptance=0.0)
    _same(spec, base)
    stats = sched.stats()
    assert stats["spec_decode_num_draft_tokens"] - stats["spec_decode_num_accepted_tokens"] > 50
    assert _pool_state(sched) == _pool_state(base_sched)


@pytest.mark.slow
def test_dp2_with_the_target_as_its_own_draft(target):
    """dp=2 (each group's draft rows proposed and verified in their group), chunked prompts, prefix-cache hits:
    the same tokens as without speculation, every greedy proposal accepted."""
    prompts = [LONG + [5, 6, 5, 6, 5], *PROMPTS]
    second = [LONG + [7, 8, 7, 8], PROMPTS[0]]
    results = {}
    for method in ("none", "draft"):
        if method == "none":
            outs, sched, engine = _run(target, "none", _requests(30, prompts=prompts), {"dp": 2}, max_slots=4)
        else:
            outs, sched, engine = _run_draft(target, target, _requests(30, prompts=prompts), {"dp": 2}, max_slots=4)
        outs += LocalRunner(engine, sched).generate(_requests(30, prompts=second))
        results[method] = (outs, sched.stats())
    _same(results["draft"][0], results["none"][0])
    stats = results["draft"][1]
    assert stats["prefix_cache_hits"] > 0 and stats["spec_decode_num_drafts"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
