"""`raydeploy plan` with quantized weights and KV cache, and the largest max_slots it suggests.

The byte counts are checked against a hand count for a small shape over fsdp=2 x tp=2 (every projection kernel
1 byte a weight plus a float32 scale per output channel, sharded like the weight's output dims; embeddings, LM
head and norms in param_dtype; an int8 KV cache 1 byte an element plus a float32 scale per token, kv head, K and
V). The suggestion is checked by planning again: it fits, one more slot per dp group does not.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from raydeploy.cli import main
from raydeploy.config import load_config
from raydeploy.model.spec import LlamaConfig
from raydeploy.plan import GIB, USABLE_FRACTION, compiled_margin_slots, format_plan, make_plan, with_slots

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
SMALL = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False)
SMALL_YAML = """
cluster: {num_hosts: 2, devices_per_host: 2, platform: cpu, simulated: true, placement_strategy: PACK}
mesh: {axes: {fsdp: 2, tp: 2}}
model: {checkpoint: demo:smollm2-135m-instruct, dtype: bfloat16, param_dtype: bfloat16, max_seq_len: 256}
engine: {max_slots: 4, page_size: 16, attention: xla}
"""


def _small(tmp_path: Path, *overrides: str):
    p = tmp_path / "small.yaml"
    p.write_text(SMALL_YAML)
    return make_plan(load_config(p, list(overrides)), model=SMALL)


def test_int8_weight_bytes_per_device_match_a_hand_count(tmp_path: Path) -> None:
    """fsdp=2 x tp=2: embed over fsdp, heads / mlp / vocab over tp. A kernel's int8 shard is its elements / 4 (one
    input and one output dim split); its scale (the output dims) is split as those dims are: q/k/v's heads over tp,
    o/down's embed over fsdp, gate/up's mlp over tp."""
    d, nh, nkv, hd, f, v, layers = 64, 4, 2, 16, 128, 256, 2
    bf16, s = 2, 4
    per_layer = (
        d * nh * hd // 4 + nh * hd // 2 * s          # q: int8 [d, nh, hd] over fsdp x tp; scale [nh, hd] over tp
        + 2 * (d * nkv * hd // 4 + nkv * hd // 2 * s)  # k, v
        + nh * hd * d // 4 + d // 2 * s              # o: scale [d] over fsdp
        + 2 * (d * f // 4 + f // 2 * s)              # gate, up: scale [f] over tp
        + f * d // 4 + d // 2 * s                    # down: scale [d] over fsdp
        + 2 * d * bf16                               # the two norms, replicated
    )
    scales = layers * (nh * hd // 2 + 2 * nkv * hd // 2 + d // 2 + 2 * f // 2 + d // 2) * s
    expected = layers * per_layer + 2 * (v * d // 4) * bf16 + d * bf16  # + embed, LM head, final norm
    q = _small(tmp_path, "model.quantization=int8")
    assert q.quantization == "int8" and q.ok, q.problems
    assert q.param_bytes_per_device == expected
    assert q.weight_scale_bytes_per_device == scales
    kernels = layers * (d * nh * hd * 2 + 2 * d * nkv * hd + f * d * 3)
    kernel_scales = layers * (nh * hd + 2 * nkv * hd + d + 2 * f + d)
    assert q.param_bytes_total == kernels + kernel_scales * s + (2 * v * d + (2 * layers + 1) * d) * bf16
    assert q.param_count == SMALL_PARAM_COUNT == kernels + 2 * v * d + (2 * layers + 1) * d  # scales are no params
    none = _small(tmp_path)
    assert none.param_bytes_per_device == layers * (kernels // layers // 4 * bf16 + 2 * d * bf16) + (
        2 * (v * d // 4) + d) * bf16
    assert "int8 projection kernels + bfloat16 embeddings, LM head and norms" in format_plan(q)


SMALL_PARAM_COUNT = 2 * (64 * 4 * 16 * 2 + 2 * 64 * 2 * 16 + 128 * 64 * 3) + 2 * 256 * 64 + 5 * 64


def test_int8_kv_bytes_count_a_scale_per_token_and_head(tmp_path: Path) -> None:
    """An int8 KV cache: 1 byte an element, and a float32 scale per token, kv head, K and V; the kv heads over tp.
    4 slots x 256 tokens = 64 pages of 16 in one dp group."""
    layers, nkv, hd, tokens = 2, 2, 16, 4 * 256
    q = _small(tmp_path, "engine.kv_dtype=int8")
    assert q.kv_dtype == "int8" and q.ok, q.problems
    assert q.kv_bytes_per_device == layers * tokens * (2 * nkv // 2) * (hd + 4)
    assert q.kv_scale_bytes_per_device == layers * tokens * (2 * nkv // 2) * 4
    assert q.kv_bytes_total == q.kv_bytes_per_device * 2  # replicated over fsdp, split over tp
    assert q.kv_bytes_per_token == layers * 2 * nkv * (hd + 4)
    assert q.kv_bytes_per_token_per_device == layers * (2 * nkv // 2) * (hd + 4)
    bf = _small(tmp_path)
    assert bf.kv_bytes_per_device == layers * tokens * (2 * nkv // 2) * hd * 2 and bf.kv_scale_bytes_per_device == 0


@pytest.mark.parametrize("name,overrides", [
    ("tpu-v5e-16.yaml", []),
    ("tpu-v5e-16.yaml", ["model.quantization=int8"]),
    ("tpu-v5e-16.yaml", ["model.quantization=int8", "engine.kv_dtype=int8"]),
    ("tpu-v6e-16.yaml", []),
    ("tpu-v5e-8-llama3-70b-int8.yaml", []),
    ("tpu-v5e-16-gemma3-27b.yaml", []),
    ("gpu-2x8-h100.yaml", []),
])
def test_the_suggested_max_slots_fits_and_one_more_slot_per_group_does_not(name: str, overrides: list[str]) -> None:
    cfg = load_config(CONFIGS / name, overrides)
    plan = make_plan(cfg)
    s = plan.slots
    assert s is not None and s.max_slots > 0, s
    groups = plan.dp_groups
    assert s.max_slots % groups == 0
    fits = make_plan(with_slots(cfg, s.max_slots))
    assert fits.ok, fits.problems
    assert fits.param_bytes_per_device + fits.kv_bytes_per_device <= fits.usable_bytes_per_device
    assert fits.usable_bytes_per_device == int(fits.device_memory_bytes * USABLE_FRACTION[cfg.cluster.platform])
    assert s.kv_bytes_per_device == fits.kv_bytes_per_device
    over = make_plan(with_slots(cfg, s.max_slots + groups))
    assert over.param_bytes_per_device + over.kv_bytes_per_device > over.usable_bytes_per_device
    assert not over.ok and any("exceeds the usable" in p for p in over.problems), over.problems
    # the modelled figure at that size: every slot decoding, more tokens a second than batch 1, each stream slower
    one, full = s.modelled
    assert (one.streams, full.streams) == (1, s.max_slots)
    assert full.tok_s > one.tok_s and full.per_stream_tok_s <= one.per_stream_tok_s


def test_quantization_raises_the_suggested_slots_and_the_modelled_throughput() -> None:
    """v5e-16 Llama-3-8B: int8 weights free half the weights' bytes for KV, and an int8 KV cache halves a slot's."""
    cfg = CONFIGS / "tpu-v5e-16.yaml"
    bf = make_plan(load_config(cfg))
    w8 = make_plan(load_config(cfg, ["model.quantization=int8"]))
    kv8 = make_plan(load_config(cfg, ["model.quantization=int8", "engine.kv_dtype=int8"]))
    assert bf.slots and w8.slots and kv8.slots
    assert w8.param_bytes_per_device < 0.6 * bf.param_bytes_per_device
    assert kv8.kv_bytes_per_token * 1.9 < bf.kv_bytes_per_token
    assert bf.slots.max_slots < w8.slots.max_slots < kv8.slots.max_slots
    assert bf.slots.modelled[0].tok_s < w8.slots.modelled[0].tok_s  # batch 1 reads fewer weight bytes
    assert bf.slots.modelled[-1].tok_s < w8.slots.modelled[-1].tok_s < kv8.slots.modelled[-1].tok_s


def test_shipped_tpu_configs_fill_their_chips() -> None:
    """Every TPU config's max_slots is the suggestion (within one step of the dp groups for later byte changes)."""
    for path in sorted(CONFIGS.glob("tpu-*.yaml")):
        if path.name == "tpu-v5e-16-qwen3-30b-a3b.yaml":  # compiled at the suggested 54 slots it needs 18.4 GiB: open
            continue
        plan = make_plan(load_config(path))
        assert plan.ok and plan.slots is not None, (path.name, plan.problems)
        configured = plan.slots_per_dp_group * plan.dp_groups
        assert configured <= plan.slots.max_slots < configured + 2 * plan.dp_groups, (path.name, plan.slots)


def test_the_70b_int8_config_fits_a_v5e_8() -> None:
    """Llama-3-70B with int8 weights and an int8 KV cache on 2 hosts x 4 v5e chips: >= 32 slots of 8192 tokens;
    its bfloat16 weights alone would not fit these 8 chips."""
    cfg = load_config(CONFIGS / "tpu-v5e-8-llama3-70b-int8.yaml")
    plan = make_plan(cfg)
    assert plan.ok, plan.problems
    assert (plan.num_hosts, plan.devices_per_host, plan.accelerator_type) == (2, 4, "v5e")
    assert plan.quantization == "int8" and plan.kv_dtype == "int8"
    assert plan.slots_per_dp_group * plan.dp_groups >= 32 and cfg.model.max_seq_len == 8192
    assert plan.param_bytes_per_device + plan.kv_bytes_per_device <= plan.usable_bytes_per_device
    bf16 = make_plan(load_config(CONFIGS / "tpu-v5e-8-llama3-70b-int8.yaml",
                                 ["model.quantization=none", "engine.kv_dtype=auto"]))
    assert bf16.param_bytes_per_device > plan.usable_bytes_per_device and not bf16.ok


@pytest.mark.parametrize("platform,acc,chip", [("tpu", "v5e", "TPU v5e"), ("tpu", "v6e", "TPU v6e"),
                                               ("gpu", "a100-80g", "a100-80g")])
def test_fp8_is_refused_naming_the_chip(platform: str, acc: str, chip: str) -> None:
    name = "tpu-v5e-16.yaml" if platform == "tpu" else "gpu-2x8-h100.yaml"
    plan = make_plan(load_config(CONFIGS / name, ["model.quantization=fp8", f"cluster.accelerator_type={acc}"]))
    assert not plan.ok
    msg = next(p for p in plan.problems if "fp8" in p)
    assert chip in msg and "int8" in msg, msg


def test_an_fp8_kv_cache_is_refused_naming_the_chip() -> None:
    plan = make_plan(load_config(CONFIGS / "tpu-v5e-16.yaml", ["engine.kv_dtype=float8_e4m3fn"]))
    assert not plan.ok
    msg = next(p for p in plan.problems if "float8_e4m3fn" in p)
    assert "TPU v5e" in msg and "set engine.kv_dtype int8" in msg, msg
    ok = make_plan(load_config(CONFIGS / "tpu-v5e-16.yaml", ["engine.kv_dtype=float8_e4m3fn",
                                                             "cluster.accelerator_type=v7x"]))
    assert ok.kv_dtype == "float8_e4m3fn" and not any("fp8" in p for p in ok.problems), ok.problems


@pytest.mark.parametrize("platform,acc", [("tpu", "v7x"), ("gpu", "h100"), ("gpu", "l4")])
def test_fp8_plans_on_chips_with_fp8_matmuls(platform: str, acc: str) -> None:
    name = "tpu-v5e-16.yaml" if platform == "tpu" else "gpu-2x8-h100.yaml"
    plan = make_plan(load_config(CONFIGS / name, ["model.quantization=fp8", f"cluster.accelerator_type={acc}"]))
    assert not any("fp8" in p for p in plan.problems), plan.problems
    int8 = make_plan(load_config(CONFIGS / name, ["model.quantization=int8", f"cluster.accelerator_type={acc}"]))
    assert plan.param_bytes_per_device == int8.param_bytes_per_device  # 1 byte a weight either way


def test_plan_prints_the_suggestion_and_labels_the_model(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", str(CONFIGS / "tpu-v5e-8-llama3-70b-int8.yaml")]) == 0
    out = capsys.readouterr().out
    assert "slots         max_slots 36 fits (margin 10% of device memory" in out, out
    assert "MODEL, not a measurement (TPU v5e roofline" in out
    assert main(["plan", str(CONFIGS / "tpu-v5e-8-llama3-70b-int8.yaml"), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["slots"]["max_slots"] == 36 and d["slots"]["modelled"][-1]["streams"] == 36
    assert d["weight_scale_bytes_per_device"] > 0 and d["kv_scale_bytes_per_device"] > 0


def test_compiled_margin_slots_use_the_programs_own_bytes() -> None:
    """With compile figures the margin is the largest program's bytes beyond its arguments (temporaries, outputs,
    code); the slots follow linearly from the KV bytes of one slot per group."""
    plan = make_plan(load_config(CONFIGS / "tpu-v5e-16.yaml"))
    progs = SimpleNamespace(programs=[SimpleNamespace(peak_bytes=9 * GIB, argument_bytes=9 * GIB - 300 * 2**20),
                                      SimpleNamespace(peak_bytes=8 * GIB, argument_bytes=8 * GIB - 100 * 2**20)])
    slots, margin = compiled_margin_slots(plan, progs)
    assert margin == 300 * 2**20
    per_group_slot = plan.kv_bytes_per_device / plan.slots_per_dp_group
    room = plan.device_memory_bytes - margin - plan.param_bytes_per_device
    assert slots == int(room // per_group_slot) * plan.dp_groups and slots % plan.dp_groups == 0
    assert plan.param_bytes_per_device + slots // plan.dp_groups * per_group_slot + margin <= plan.device_memory_bytes
