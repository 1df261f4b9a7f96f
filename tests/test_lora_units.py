"""LoRA's host-side parts without a model: the adapter table (pins, LRU eviction, conflicts), reading PEFT adapter
files (each refusal names the tensor, file or setting), adapter commands on the wire, and the prefix cache keeping
adapters apart (the real scheduler over the counting fake engine of test_engine_scheduler)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from test_engine_scheduler import PagedTokenEngine, alone, collect, paged, prompt_of, req

from raydeploy.engine.local import LocalRunner
from raydeploy.engine.step import SeqStep, StepPlan
from raydeploy.lora.commands import AdapterCommand
from raydeploy.lora.layout import LoraLayout, LoraTarget
from raydeploy.lora.peft import AdapterError, read_adapter
from raydeploy.lora.slots import AdapterConflict, AdapterSlotsBusy, AdapterTable, UnknownAdapter


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


# -- the adapter table ---------------------------------------------------------------------------------------


def loaded(table: AdapterTable, name: str, path: str = "/x") -> int:
    table.register(name, path)
    slot, _ = table.place(name)
    table.loaded(name, slot)
    return slot


def test_table_evicts_the_least_recently_used_idle_adapter_and_keeps_it_known():
    t = AdapterTable(2, clock=Clock())
    assert loaded(t, "a") == 0 and loaded(t, "b") == 1
    ra = t.pin("a")  # a used after b: b is the least recently used
    t.unpin("a", ra.key)
    t.register("c", "/c")
    slot, evicted = t.place("c")
    assert (slot, evicted) == (1, "b")
    t.loaded("c", slot)
    assert t.known("b") and t.pin("b") is None  # known, not resident: a request loads it again
    assert sorted(t.resident) == ["a", "c"]


def test_table_never_evicts_an_adapter_in_use():
    t = AdapterTable(1, clock=Clock())
    loaded(t, "a")
    res = t.pin("a")
    t.register("b", "/b")
    with pytest.raises(AdapterSlotsBusy, match="all 1 adapter slots"):
        t.place("b")
    with pytest.raises(AdapterConflict, match="in use by 1 running request"):
        t.forget("a")
    t.unpin("a", res.key)
    assert t.place("b") == (0, "a")


def test_table_keys_each_residence_afresh_and_names_unknown_adapters():
    t = AdapterTable(2, clock=Clock())
    loaded(t, "a")
    first = t.pin("a").key
    t.unpin("a", first)
    assert t.forget("a") == 0
    with pytest.raises(UnknownAdapter) as e:
        t.pin("a")
    assert str(e.value) == "The model `a` does not exist."
    loaded(t, "a")
    assert t.pin("a").key != first  # a reload's pages never reuse the old adapter's
    with pytest.raises(AdapterConflict, match="'a' has already been loaded"):
        t.register("a", "/y")


# -- PEFT files ----------------------------------------------------------------------------------------------

LAYOUT = LoraLayout(slots=2, rank=4, layers=2, dtype="float32",
                    targets=(LoraTarget("q_proj", "layers.attn.q_proj.kernel", 8, 6, "embed", "q_heads"),
                             LoraTarget("down_proj", "layers.mlp.down_proj.kernel", 5, 8, "mlp", "embed")))
KEY = "base_model.model.model.layers.{}.{}.{}.lora_{}.weight"


def write_adapter(path: Path, tensors: dict[str, np.ndarray], **config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "down_proj"], **config}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def good_tensors(rank: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for layer in range(2):
        out[KEY.format(layer, "self_attn", "q_proj", "A")] = rng.normal(size=(rank, 8)).astype(np.float32)
        out[KEY.format(layer, "self_attn", "q_proj", "B")] = rng.normal(size=(6, rank)).astype(np.float32)
    out[KEY.format(1, "mlp", "down_proj", "A")] = rng.normal(size=(rank, 5)).astype(np.float32)
    out[KEY.format(1, "mlp", "down_proj", "B")] = rng.normal(size=(8, rank)).astype(np.float32)
    return out


def test_read_adapter_pads_to_the_slot_rank_and_transposes_b(tmp_path):
    t = good_tensors()
    ad = read_adapter(write_adapter(tmp_path / "a", t), LAYOUT)
    assert ad.rank == 2 and ad.scale == 2.0
    assert ad.a["q_proj"].shape == (2, 4, 8) and ad.b["down_proj"].shape == (2, 4, 8)
    np.testing.assert_array_equal(ad.a["q_proj"][1, :2], t[KEY.format(1, "self_attn", "q_proj", "A")])
    np.testing.assert_array_equal(ad.b["down_proj"][1, :2], t[KEY.format(1, "mlp", "down_proj", "B")].T)
    assert not ad.a["q_proj"][:, 2:].any() and not ad.b["down_proj"][0].any()  # padding; layer 0 untouched
    rs = read_adapter(write_adapter(tmp_path / "rs", t, use_rslora=True), LAYOUT)
    assert rs.scale == pytest.approx(4 / np.sqrt(2))


@pytest.mark.parametrize("change, message", [
    (lambda t: {**t, "base_model.model.model.embed_tokens.lora_A.weight": np.zeros((2, 8), np.float32)},
     "tensor base_model.model.model.embed_tokens.lora_A.weight is not a LoRA A/B weight"),
    (lambda t: {**t, KEY.format(0, "mlp", "gate_proj", "A"): np.zeros((2, 8), np.float32)},
     r"tensor base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight adapts gate_proj, which this model's "
     r"adapters cannot target \(adapted: q_proj, down_proj\)"),
    (lambda t: {**t, KEY.format(0, "self_attn", "q_proj", "A"): np.zeros((2, 7), np.float32)},
     r"tensor base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight has shape \[2, 7\], expected \[2, 8\]"),
    (lambda t: {k: v for k, v in t.items() if k != KEY.format(1, "mlp", "down_proj", "B")},
     r"tensor base_model.model.model.layers.1.mlp.down_proj.lora_A.weight has no lora_B partner"),
    (lambda t: {**t, KEY.format(5, "self_attn", "q_proj", "A"): np.zeros((2, 8), np.float32)},
     "is for layer 5, the model has 2 layers"),
    (lambda t: {**t, KEY.format(0, "self_attn", "q_proj", "B"): np.full((6, 2), np.nan, np.float32)},
     "q_proj.lora_B.weight holds non-finite values"),
])
def test_bad_adapter_files_name_the_tensor(tmp_path, change, message):
    with pytest.raises(AdapterError, match=message):
        read_adapter(write_adapter(tmp_path / "bad", change(good_tensors())), LAYOUT)


@pytest.mark.parametrize("config, message", [
    ({"r": 8}, "adapter bad has rank 8, above lora.max_rank 4"),
    ({"use_dora": True}, r"DoRA \(use_dora: true\) is not supported"),
    ({"bias": "all"}, "bias 'all' is not supported"),
    ({"peft_type": "IA3"}, "peft_type IA3 is not LORA"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern is not supported"),
])
def test_bad_adapter_configs_name_the_setting(tmp_path, config, message):
    with pytest.raises(AdapterError, match=message):
        read_adapter(write_adapter(tmp_path / "bad", good_tensors(), **config), LAYOUT)


def test_missing_adapter_files_are_named(tmp_path):
    with pytest.raises(AdapterError, match="does not exist"):
        read_adapter(tmp_path / "nowhere", LAYOUT)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="has no adapter_config.json"):
        read_adapter(tmp_path / "empty", LAYOUT)
    d = write_adapter(tmp_path / "nofile", good_tensors())
    (d / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="has no adapter_model.safetensors"):
        read_adapter(d, LAYOUT)
    (d / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(AdapterError, match="adapter_model.safetensors of adapter nofile cannot be read"):
        read_adapter(d, LAYOUT)


# -- the wire ------------------------------------------------------------------------------------------------


def test_adapter_commands_and_rows_cross_the_wire():
    cmd = AdapterCommand("load", 3, "/adapters/a")
    data = cmd.to_bytes()
    assert AdapterCommand.is_command(data) and AdapterCommand.from_bytes(data) == cmd
    plan = StepPlan(7, seqs=(SeqStep(1, np.asarray([5, 6], np.int32), 0, True, adapter=2),
                             SeqStep(0, np.zeros(0, np.int32), 4, True)))
    assert not AdapterCommand.is_command(plan.to_bytes())
    back = StepPlan.from_bytes(plan.to_bytes())
    assert [q.adapter for q in back.seqs] == [2, -1]


# -- the prefix cache ----------------------------------------------------------------------------------------


def test_prefix_cache_keeps_adapters_apart():
    """The same prompt under adapter a, then b, then the base model, then a again: only the last reuses pages (a's
    own), and none of b's or the base model's steps starts after a cached page."""
    eng = PagedTokenEngine(max_slots=2, groups=1)
    sched = paged(eng)
    runner = LocalRunner(eng, sched)
    prompt = prompt_of(18, 5)  # 4 full pages of 4 + 2 tokens
    starts = {}
    for rid, key, slot in (("a1", "a#1", 0), ("b1", "b#2", 1), ("base", "", -1), ("a2", "a#1", 0)):
        n_plans = len(eng.plans)
        out = collect(runner, req(rid, prompt=prompt, max_tokens=3, adapter=None if slot < 0 else key.split("#")[0],
                                  adapter_slot=slot, adapter_key=key))[rid]
        assert out.token_ids == alone(prompt, 3)
        first = next(q for p in eng.plans[n_plans:] for q in p.seqs if q.sampling is not None)
        assert first.adapter == slot  # the first chunk carries the request's adapter slot
        starts[rid] = first.start
    assert starts == {"a1": 0, "b1": 0, "base": 0, "a2": 16}
