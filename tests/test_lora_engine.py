"""LoRA adapters made with PEFT, served by the real paged `Engine`, against PEFT's own float32 outputs.

For each family (llama, qwen3, gemma3, qwen3_moe, mixtral) a tiny transformers model with seeded random weights is
converted by our safetensors converter, and three PEFT adapters are made on it (random non-zero B; ranks 4, 8
and 2 in slots of max_rank 8, so zero padding is exercised; one with rsLoRA; dense families adapt q/k/v/o and
gate/up/down, MoE families q/k/v/o). Then, on one device and on tp=2 (MoE: ep=2 x tp=2):
- each adapter's 32 greedy tokens through the engine equal PEFT's, and the 20 most likely tokens' logprobs at
  every step are within 1e-3 of PEFT's log-softmax;
- one batch mixing rows of the three adapters and a base row equals each of them run alone (and the base row
  equals transformers without adapters);
- an adapter unloaded from its slot leaves the slot's rows on the base model; a slot written again serves the
  new adapter.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import jax  # noqa: E402
from test_families import MOE, PROMPT, STEPS, TINY, _hf_model  # noqa: E402

CASES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  tie_word_embeddings=False, initializer_range=0.2),
    **TINY,
}
ADAPTERS = (("alpha", 4, 8.0, False, 1), ("beta", 8, 4.0, True, 2), ("gamma", 2, 2.0, False, 3))
"""(name, rank, lora_alpha, use_rslora, seed)."""
MAX_RANK = 8
SLOTS = {"alpha": 0, "beta": 1, "gamma": 3}
LP_ATOL = 1e-3
MAX_SEQ_LEN = 64


def targets(kind: str) -> list[str]:
    attn = ["q_proj", "k_proj", "v_proj", "o_proj"]
    return attn if kind in MOE else attn + ["gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Any, kind: str, dst: Path, rank: int, alpha: float, rslora: bool, seed: int) -> Any:
    """A PEFT LoRA model over a copy of `base` with seeded random A and non-zero B, saved to `dst`."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets(kind), lora_dropout=0.0,
                          use_rslora=rslora)
    model = peft.get_peft_model(copy.deepcopy(base), cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(dst)
    return model


def reference(model: Any, prompt: list[int], steps: int) -> dict[str, Any]:
    """Greedy tokens of `model` (transformers or PEFT) and, at each, the log-softmax over the vocabulary."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            ids.append(int(torch.argmax(logits)))
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1).numpy()[len(prompt) - 1:]
    return {"greedy": ids[len(prompt):], "logprobs": lp}


def build_case(kind: str, tmp: Path) -> dict[str, Any]:
    from raydeploy.checkpoint.convert import convert

    if kind in TINY:
        base, src = _hf_model(kind, tmp)
    else:
        from hf_reference import tiny_hf_model

        src = tmp / f"hf-{kind}"
        base = tiny_hf_model(CASES[kind], src)
    dst = tmp / "ckpt"
    convert(src, dst, progress=False)
    refs = {"base": reference(base, PROMPT, STEPS)}
    paths = {}
    for name, rank, alpha, rslora, seed in ADAPTERS:
        paths[name] = tmp / f"adapter-{name}"
        refs[name] = reference(make_adapter(base, kind, paths[name], rank, alpha, rslora, seed), PROMPT, STEPS)
    return {"kind": kind, "ckpt": dst, "refs": refs, "paths": paths}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory) -> dict[str, Any]:
    return build_case(request.param, tmp_path_factory.mktemp(f"lora-{request.param}"))


def lora_engine(ckpt: Path, mesh_shape: dict[str, int], max_adapters: int = 4, max_slots: int = 4, **engine_kw: Any
                ) -> Any:
    from raydeploy.checkpoint.reader import CheckpointReader
    from raydeploy.config import EngineConfig, ModelConfig
    from raydeploy.config.schema import LoraConfig
    from raydeploy.engine.engine import Engine
    from raydeploy.model.registry import from_hf_config
    from raydeploy.model.sharding import build_mesh, merge_rules

    n = int(np.prod(list(mesh_shape.values())))
    mesh = build_mesh(mesh_shape, jax.devices()[:n])
    rules = merge_rules(None)
    reader = CheckpointReader(ckpt)
    family, cfg = from_hf_config(reader.hf_config)
    params, _ = reader.load(reader.param_specs(), mesh, {**family.rules, **rules}, "float32", 2, progress=False)
    engine_cfg = EngineConfig(max_slots=max_slots, page_size=8, prefill_chunk=64, decode_steps=4,
                              compilation_cache_dir=None, warmup=False, **engine_kw)
    return Engine(family, cfg, params, mesh, rules, ModelConfig(max_seq_len=MAX_SEQ_LEN), engine_cfg,
                  lora_cfg=LoraConfig(max_adapters=max_adapters, max_rank=MAX_RANK))


def run_rows(engine: Any, rows: list[tuple[int, int]], step_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PROMPT in each (engine slot, adapter slot) row, prefilled in one step, then STEPS - 1 greedy decode passes
    in one plan; the slots are released after. Returns tokens [STEPS, rows], top ids and top logprobs
    [STEPS, rows, 20]."""
    from raydeploy.engine.step import PageUpdate, SamplingParams, SeqStep, StepPlan

    per_slot = engine.max_pages_per_seq
    pages = tuple(PageUpdate(s, 0, np.arange(s * per_slot, (s + 1) * per_slot, dtype=np.int32)) for s, _ in rows)
    prompt = np.asarray(PROMPT, np.int32)
    first = engine.step(StepPlan(step_id, pages=pages, seqs=tuple(
        SeqStep(s, prompt, 0, True, SamplingParams(), adapter=a, top_logprobs=True) for s, a in rows)))
    rest = engine.step(StepPlan(step_id + 1, decode_steps=STEPS - 1, seqs=tuple(
        SeqStep(s, np.zeros(0, np.int32), len(PROMPT), True, top_logprobs=True) for s, _ in rows)))
    engine.step(StepPlan(step_id + 2, release=tuple(s for s, _ in rows)))
    cat = np.concatenate
    return (cat([first.tokens, rest.tokens]), cat([first.top_ids, rest.top_ids]),
            cat([first.top_logprobs, rest.top_logprobs]))


def check_row(tokens: np.ndarray, top_ids: np.ndarray, top_lp: np.ndarray, ref: dict[str, Any]) -> None:
    """One row's greedy tokens equal the reference's; its top-20 logprobs at every step are within LP_ATOL."""
    assert tokens.tolist() == ref["greedy"]
    want = np.take_along_axis(ref["logprobs"], top_ids.astype(np.int64), axis=1)
    np.testing.assert_allclose(top_lp, want, atol=LP_ATOL, rtol=0)


def load_all(engine: Any, case: dict[str, Any]) -> None:
    for name, slot in SLOTS.items():
        info = engine.adapters.load(slot, str(case["paths"][name]))
        assert info["slot"] == slot and info["rank"] == dict((a[0], a[1]) for a in ADAPTERS)[name]


def check_engine(engine: Any, case: dict[str, Any]) -> None:
    refs = case["refs"]
    for name in SLOTS:  # each adapter moves the model's distribution far more than the tolerance
        assert np.abs(refs[name]["logprobs"] - refs["base"]["logprobs"]).max() > 100 * LP_ATOL, name
    load_all(engine, case)
    alone = {}
    for i, name in enumerate(("base", *SLOTS)):
        toks, ids, lps = run_rows(engine, [(i, SLOTS.get(name, -1))], step_id=10 * i)
        check_row(toks[:, 0], ids[:, 0], lps[:, 0], refs[name])
        alone[name] = toks[:, 0]
    # one batch: the three adapters and the base model, rows in other engine slots than they ran alone
    names = ("gamma", "base", "alpha", "beta")
    toks, ids, lps = run_rows(engine, [(i, SLOTS.get(n, -1)) for i, n in enumerate(names)], step_id=100)
    for i, name in enumerate(names):
        assert toks[:, i].tolist() == alone[name].tolist(), name
        check_row(toks[:, i], ids[:, i], lps[:, i], refs[name])


@pytest.mark.slow
def test_lora_one_device_matches_peft(case):
    engine = lora_engine(case["ckpt"], {"tp": 1})
    check_engine(engine, case)
    # unload: the slot's rows run the base model; reload another adapter into it: that adapter's outputs
    engine.adapters.unload(SLOTS["alpha"])
    toks, ids, lps = run_rows(engine, [(2, SLOTS["alpha"])], step_id=200)
    check_row(toks[:, 0], ids[:, 0], lps[:, 0], case["refs"]["base"])
    engine.adapters.load(SLOTS["alpha"], str(case["paths"]["gamma"]))
    toks, ids, lps = run_rows(engine, [(2, SLOTS["alpha"])], step_id=210)
    check_row(toks[:, 0], ids[:, 0], lps[:, 0], case["refs"]["gamma"])


@pytest.mark.slow
def test_lora_tp_mesh_matches_peft(case):
    """tp=2 (MoE: ep=2 x tp=2): B's output split where the base kernel's output is (q/k/v, gate/up), A's input
    where its input is (o, down)."""
    moe = case["kind"] in MOE
    engine = lora_engine(case["ckpt"], {"ep": 2, "tp": 2} if moe else {"tp": 2})
    w = engine.adapters.weights
    assert w.b["q_proj"].sharding.shard_shape(w.b["q_proj"].shape)[3] == w.b["q_proj"].shape[3] // 2
    assert w.a["o_proj"].sharding.shard_shape(w.a["o_proj"].shape)[3] == w.a["o_proj"].shape[3] // 2
    check_engine(engine, case)


def test_an_engine_without_adapter_slots_lowers_the_programs_of_before():
    """lora.max_adapters 0 adds no program input and traces no adapter term: its step programs lower to exactly
    the text of an engine built without a lora section; with slots they take the stacks and the slot table."""
    from raydeploy.config import EngineConfig, ModelConfig
    from raydeploy.config.schema import LoraConfig
    from raydeploy.engine.programs import ProgramSet
    from raydeploy.model.registry import from_hf_config
    from raydeploy.model.sharding import build_mesh, merge_rules

    family, cfg = from_hf_config(CASES["llama"])
    mesh = build_mesh({"tp": 2}, jax.devices()[:2])
    engine_cfg = EngineConfig(max_slots=4, page_size=8, prefill_chunk=16, compilation_cache_dir=None, warmup=False)

    def program_set(lora: Any) -> Any:
        return ProgramSet(family, cfg, mesh, merge_rules(None), ModelConfig(max_seq_len=MAX_SEQ_LEN), engine_cfg,
                          lora_cfg=lora)

    before, off = program_set(None), program_set(LoraConfig(max_adapters=0))
    on = program_set(LoraConfig(max_adapters=2, max_rank=4))
    assert len(off.abstract_state()[0]) == 2 and len(on.abstract_state()[0]) == 3
    for shape in before.shapes()[:3]:
        text = before.lower(shape).as_text()
        assert off.lower(shape).as_text() == text, shape.name
        assert on.lower(shape).as_text() != text, shape.name


def test_speculating_rows_verify_with_their_adapter(tmp_path):
    """A speculating row of an adapter's request is verified by the adapted model: proposing the adapter's own
    next greedy tokens (PEFT's), every proposal is accepted and the draw after them is PEFT's too. (Its places'
    token slots are taken out of the step's own sampling; the adapter must still find them.)"""
    from raydeploy.config.schema import SpeculativeConfig
    from raydeploy.engine.step import PageUpdate, SamplingParams, SeqStep, StepPlan

    case = build_case("llama", tmp_path)
    engine = lora_engine(case["ckpt"], {"tp": 1}, speculative=SpeculativeConfig(method="ngram", num_tokens=3))
    load_all(engine, case)
    want = case["refs"]["alpha"]["greedy"]
    assert want[:5] != case["refs"]["base"]["greedy"][:5]  # the base model would reject them
    per_slot = engine.max_pages_per_seq
    prompt = np.asarray(PROMPT, np.int32)
    first = engine.step(StepPlan(0, pages=(PageUpdate(0, 0, np.arange(per_slot, dtype=np.int32)),), seqs=(
        SeqStep(0, prompt, 0, True, SamplingParams(), adapter=SLOTS["alpha"]),)))
    assert int(first.tokens[0, 0]) == want[0]
    verified = engine.step(StepPlan(1, seqs=(
        SeqStep(0, np.asarray(want[:4], np.int32), len(PROMPT), True, spec=3),)))
    assert verified.spec_tokens[0].tolist() == want[1:5]
