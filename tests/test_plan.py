"""`raydeploy plan`: every shipped config plans; impossible plans fail naming the numbers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from raydeploy.cli import main
from raydeploy.config import ConfigError, load_config
from raydeploy.model.spec import LlamaConfig
from raydeploy.plan import GIB, axis_span, format_plan, make_plan

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
# SmolLM2-135M-Instruct, the demo model (values of its config.json).
SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
                      tie_word_embeddings=True)
DEMO_CONFIGS = ["local.yaml", "cpu-fsdp.yaml", "predict-small.yaml"]
BUNDLED_CONFIGS = ["tpu-v5e-16.yaml", "tpu-v6e-16.yaml", "gpu-2x8-h100.yaml", "tpu-v5e-16-qwen3-30b-a3b.yaml",
                   "tpu-v5e-16-gemma3-27b.yaml", "tpu-v5e-8-llama3-70b-int8.yaml"]


def test_every_config_is_covered() -> None:
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(DEMO_CONFIGS + BUNDLED_CONFIGS)


@pytest.mark.parametrize("name", BUNDLED_CONFIGS)
def test_accelerator_configs_plan(name: str) -> None:
    plan = make_plan(load_config(CONFIGS / name))
    assert plan.ok, plan.problems
    assert plan.total_devices == plan.num_hosts * plan.devices_per_host == (8 if "v5e-8" in name else 16)
    assert plan.platform in ("tpu", "gpu")
    res = "TPU" if plan.platform == "tpu" else "GPU"
    assert all(b[res] == plan.devices_per_host for b in plan.bundles)
    assert plan.param_bytes_per_device + plan.kv_bytes_per_device <= plan.usable_bytes_per_device
    assert plan.param_bytes_per_host == plan.param_bytes_per_device * plan.devices_per_host
    if plan.platform == "tpu":
        assert plan.slice_head_bundle is not None and next(iter(plan.slice_head_bundle)).endswith("-head")


def test_v5e_numbers() -> None:
    """Llama-3-8B bf16 over dp=4 x tp=4: each chip holds a quarter of the weights (vocab, heads, MLP over tp)."""
    plan = make_plan(load_config(CONFIGS / "tpu-v5e-16.yaml"))
    assert plan.param_count == 8_030_261_248
    assert plan.param_bytes_total == 2 * plan.param_count
    # everything but the 2 norms/layer + final norm is split 4 ways
    norms = (2 * 32 + 1) * 4096
    assert plan.param_bytes_per_device == 2 * ((plan.param_count - norms) // 4 + norms)
    # 168 slots / dp 4 = 42 per host; 8 KV heads / tp 4 = 2 per chip; 8192 x 128 x 32 layers x K,V x 2 bytes
    assert plan.slots_per_dp_group == 42
    assert plan.kv_bytes_per_device == 42 * 8192 * 2 * 128 * 32 * 2 * 2 == 10.5 * GIB
    assert plan.mesh_axis_span == {"dp": "across hosts", "tp": "in-host"}


def test_moe_plan_counts_experts_over_ep(capsys: pytest.CaptureFixture) -> None:
    """Qwen3-30B-A3B over ep=4 x tp=4, sizes worked out here from its config.json: each chip holds a
    sixteenth of the experts (32 experts of 128 over ep, their 768 units over tp) and a quarter of everything
    else but the norms (over tp, replicated over ep); KV bytes per token from the 4 KV heads of 128 dims."""
    raw = json.loads((CONFIGS / "models/qwen3-30b-a3b/config.json").read_text())
    layers, d, v = raw["num_hidden_layers"], raw["hidden_size"], raw["vocab_size"]
    e, k, f = raw["num_experts"], raw["num_experts_per_tok"], raw["moe_intermediate_size"]
    nh, nkv, hd = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    attn = d * nh * hd + 2 * d * nkv * hd + nh * hd * d
    norms = layers * (2 * d + 2 * hd) + d
    experts = layers * e * 3 * d * f
    router = layers * d * e
    split4 = layers * attn + 2 * v * d  # attention, embedding and LM head: over tp
    total = split4 + experts + router + norms
    plan = make_plan(load_config(CONFIGS / "tpu-v5e-16-qwen3-30b-a3b.yaml"))
    assert plan.ok, plan.problems
    assert plan.mesh == {"ep": 4, "tp": 4}
    assert plan.param_count == total and 30.4e9 < total < 30.6e9
    assert plan.active_param_count == total - experts + experts * k // e
    assert 3.2e9 < plan.active_param_count < 3.4e9
    assert plan.param_bytes_total == 2 * total
    assert plan.param_bytes_per_device == 2 * (experts // 16 + split4 // 4 + router + norms)
    assert plan.kv_bytes_per_token == layers * 2 * nkv * hd * 2
    # KV heads over tp only: every ep group holds the whole pool of its tp shard
    assert plan.kv_bytes_per_device == plan.kv_bytes_total // 4
    assert plan.model["experts"] == 128 and plan.model["experts_per_token"] == 8
    assert main(["plan", str(CONFIGS / "tpu-v5e-16-qwen3-30b-a3b.yaml")]) == 0
    out = capsys.readouterr().out
    assert "experts       128 per layer, 8 per token (ffn 768): 3.353B params active per token" in out
    assert "ffn 6144" not in out  # the config's dense intermediate size: no layer of this model uses it
    assert "96.0 KiB per token" in out


def test_moe_plan_ep_must_divide_the_experts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    p = _write(tmp_path, "tpu-v5e-16-qwen3-30b-a3b.yaml",
               "mesh: {axes: {ep: 3, tp: 4}}\ncluster: {num_hosts: 3}")
    plan = make_plan(load_config(p))
    assert "mesh axis ep=3 does not divide the model's 128 experts (ep must be a divisor of 128)" in plan.problems
    assert main(["plan", str(p)]) == 1
    assert "raydeploy plan: mesh axis ep=3 does not divide the model's 128 experts" in capsys.readouterr().err


@pytest.mark.parametrize("name", DEMO_CONFIGS)
def test_demo_configs_plan(name: str) -> None:
    plan = make_plan(load_config(CONFIGS / name), model=SMOLLM2)
    assert plan.ok, plan.problems
    assert plan.platform == "cpu" and plan.placement_strategy == "PACK"
    assert plan.param_count == 134_515_008


def test_cpu_fsdp_shards_weights_across_hosts() -> None:
    plan = make_plan(load_config(CONFIGS / "cpu-fsdp.yaml"), model=SMOLLM2)
    local = make_plan(load_config(CONFIGS / "local.yaml"), model=SMOLLM2)
    assert plan.mesh_axis_span["fsdp"] == "across hosts"
    # fsdp splits the hidden dimension across hosts: a host holds about half of what local.yaml's host holds
    assert plan.param_bytes_per_host < 0.6 * local.param_bytes_per_host


@pytest.mark.model
def test_local_plan_reads_the_demo_checkpoint(demo_checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", str(CONFIGS / "local.yaml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["model"]["heads"] == 9 and out["mesh"] == {"dp": 2}
    assert out["model_config_json"].endswith("config.json")


def test_axis_span() -> None:
    assert axis_span({"dp": 2, "tp": 2}, 2) == {"dp": "across hosts", "tp": "in-host"}
    assert axis_span({"fsdp": 2, "tp": 8}, 4) == {"fsdp": "across hosts", "tp": "both"}
    assert axis_span({"dp": 1, "tp": 4}, 4) == {"dp": "size 1", "tp": "in-host"}


# -- impossible plans ---------------------------------------------------------------------------------


def _write(tmp_path: Path, base: str, text: str) -> Path:
    """A config that includes a shipped one's values with some replaced (YAML-level merge)."""
    import yaml

    raw = yaml.safe_load((CONFIGS / base).read_text())
    for section, values in yaml.safe_load(text).items():
        raw.setdefault(section, {}).update(values)
    if base != "local.yaml" and raw["model"].get("hf_config"):
        raw["model"]["hf_config"] = str(CONFIGS / raw["model"]["hf_config"])
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_heads_not_divisible_by_tp(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "cpu-fsdp.yaml", "mesh: {rules: {q_heads: tp}}"))
    plan = make_plan(cfg, model=SMOLLM2)
    assert not plan.ok
    text = "; ".join(plan.problems)
    assert "9 attention heads, not divisible by tp=2 (mesh.rules.q_heads)" in text
    # the per-tensor check names one generic tensor, not 30 copies of it
    assert "tensor layers.*.attn.q_proj.kernel: dimension 'q_heads' of size 9 is not divisible by mesh tp=2" in text
    assert sum("q_proj" in p for p in plan.problems) == 1
    with pytest.raises(ConfigError, match="impossible plan: .*9 attention heads"):
        plan.raise_if_impossible()


def test_kv_cache_not_divisible(tmp_path: Path) -> None:
    """The slots split over the mesh axes `mesh.rules.cache_batch` names, not over dp: one rule
    (`EngineGeometry`), asked at load and by the plan, so a remapped slot axis never reaches an engine."""
    remapped = "mesh: {axes: {fsdp: 4, tp: 4}, rules: {cache_batch: fsdp}}"
    with pytest.raises(ConfigError, match=r"key 'engine\.max_slots': engine\.max_slots 6 is not divisible by mesh fsdp=4 "
                                          r"\(the dp groups of the KV cache's slots, mesh\.rules\.cache_batch\)"):
        load_config(_write(tmp_path, "tpu-v5e-16.yaml", "engine: {max_slots: 6}\n" + remapped))
    cfg = load_config(_write(tmp_path, "tpu-v5e-16.yaml", "engine: {max_slots: 8}\n" + remapped))
    assert make_plan(cfg).ok
    # a config built in code (not through load) meets the same rule in the plan
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, max_slots=6))
    plan = make_plan(cfg)
    assert ("engine.max_slots 6 is not divisible by mesh fsdp=4 (the dp groups of the KV cache's slots, "
            "mesh.rules.cache_batch)") in plan.problems, plan.problems
    assert any("tensor page_tables: dimension 'cache_batch' of size 6 is not divisible by mesh fsdp=4" in p
               for p in plan.problems), plan.problems


def test_paged_pool_memory_follows_num_pages(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The pool is pages per dp group x page_size tokens, K and V of every layer; auto = every slot at
    max_seq_len (the v5e-16 config at 64 slots: 16 per dp group x 8192 tokens = 8192 pages of 16, 4 GiB per chip)."""
    auto = make_plan(load_config(_write(tmp_path, "tpu-v5e-16.yaml", "engine: {max_slots: 64}")))
    assert (auto.page_size, auto.pages_per_dp_group) == (16, 16 * 8192 // 16)
    half = make_plan(load_config(_write(tmp_path, "tpu-v5e-16.yaml", "engine: {num_pages: 4096, max_slots: 64}")))
    assert half.pages_per_dp_group == 4096
    assert half.kv_bytes_per_device * 2 == auto.kv_bytes_per_device == 4 * GIB
    assert main(["plan", str(_write(tmp_path, "tpu-v5e-16.yaml",
                                    "engine: {num_pages: 4096, page_size: 32, max_slots: 64}"))]) == 0
    assert "(paged: 4096 pages of 32 tokens = 131072 tokens per dp group; 16 slots per dp group)" in capsys.readouterr().out


def test_max_slots_vs_dp_fails_at_load(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_slots 6 is not divisible by mesh dp=4"):
        load_config(_write(tmp_path, "tpu-v5e-16.yaml", "engine: {max_slots: 6}"))


def test_out_of_memory_names_the_numbers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # Llama-3-70B on a v5e-16 slice: 141 GB of bf16 weights over 16 x 16 GiB chips with 64 long slots
    p = _write(tmp_path, "tpu-v5e-16.yaml", "model: {hf_config: models/llama-3-70b-instruct/config.json}\n"
                                            "engine: {max_slots: 64}")
    assert main(["plan", str(p)]) == 1
    cap = capsys.readouterr()
    assert "plan IMPOSSIBLE" in cap.out
    assert ("per device: parameters 32.86 GiB + KV cache 10.00 GiB = 42.86 GiB exceeds the usable 14.40 GiB "
            "(90% of 16.00 GiB, v5e (16 GiB))") in cap.err


def test_host_resources_must_match_devices(tmp_path: Path) -> None:
    plan = make_plan(load_config(_write(tmp_path, "gpu-2x8-h100.yaml", "cluster: {host_resources: {GPU: 4}}")))
    assert "cluster.host_resources.GPU is 4 but cluster.devices_per_host is 8" in " ".join(plan.problems)


def test_remote_checkpoint_needs_hf_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    p = _write(tmp_path, "tpu-v5e-16.yaml", "model: {checkpoint: 'gs://bucket/llama', hf_config: null}")
    assert main(["plan", str(p)]) == 1
    err = capsys.readouterr().err
    assert "key 'model.hf_config'" in err and "gs://bucket/llama is not on this machine" in err


def test_missing_hf_config_file(tmp_path: Path) -> None:
    p = _write(tmp_path, "tpu-v5e-16.yaml", "model: {hf_config: nowhere/config.json}")
    with pytest.raises(ConfigError, match=r"model config.json .*nowhere/config.json does not exist"):
        make_plan(load_config(p))


def test_unknown_accelerator(tmp_path: Path) -> None:
    p = _write(tmp_path, "tpu-v5e-16.yaml", "cluster: {accelerator_type: v99}")
    with pytest.raises(ConfigError, match="device memory unknown .* 'v99'.*cluster.device_memory_gib"):
        make_plan(load_config(p))
    p = _write(tmp_path, "tpu-v5e-16.yaml", "cluster: {accelerator_type: v99, device_memory_gib: 16}")
    assert make_plan(load_config(p)).device_memory_bytes == 16 * GIB


def test_sliding_window_rings_shrink_the_planned_kv_cache(capsys: pytest.CaptureFixture) -> None:
    """Gemma 3 27B (bundled config.json: 62 layers, 52 local with a 1024-token window) with 16 slots of 32768
    tokens on v5e-16: with rings the local layers' KV is a ring of ceil((1024 + 256 - 1) / 16) + 1 = 81 pages
    per slot, the plan's KV is the main pool of the 10 global layers plus the rings, and it fits; with
    `window_pages: all` every layer keeps every page and the plan is impossible, naming the numbers."""
    from raydeploy.plan import format_plan

    path, slots = CONFIGS / "tpu-v5e-16-gemma3-27b.yaml", "engine.max_slots=16"
    ring = make_plan(load_config(path, [slots]))
    full = make_plan(load_config(path, [slots, "engine.window_pages=all"]))
    e = load_config(path, [slots]).engine
    pages = -(-(1024 + e.prefill_chunk - 1) // e.page_size) + 1
    assert pages == 81 and (ring.window_ring_pages, ring.window_layers) == (81, 52)
    assert (full.window_ring_pages, full.window_layers) == (0, 0)
    per_page = 2 * 16 * 128 * e.page_size * 2  # K and V of one layer's page, bfloat16
    assert full.kv_bytes_total == 62 * e.max_slots * (32768 // e.page_size) * per_page
    assert ring.kv_bytes_total == full.kv_bytes_total * 10 // 62 + 52 * e.max_slots * pages * per_page
    assert ring.ok and ring.kv_bytes_per_device == ring.kv_bytes_total // 16
    assert f"52 sliding-window layers keep a ring of {pages} pages per slot" in format_plan(ring)
    assert not full.ok and "ring" not in format_plan(full)
    assert "KV cache 15.50 GiB" in full.problems[0] and "exceeds the usable 14.40 GiB" in full.problems[0]
    assert main(["plan", str(path), "--set", slots, "--set", "engine.window_pages=all"]) != 0
    assert "15.50 GiB" in capsys.readouterr().err


def test_a_cpu_plan_counts_the_packed_copies_weights_may_add(tmp_path: Path) -> None:
    """On CPU with `engine.pack_weights: auto` a layer projection that is exactly 4-bit blocks is also held packed
    (0.75 bytes a weight) and a tied table of 8-bit blocks too (1.125): the plan shows the most they add and warns
    when only they would not fit; off, another dtype or a split mesh packs nothing."""
    d, f, q, kv, layers, vocab = 576, 1536, 9 * 64, 3 * 64, 30, 49152
    per_layer = d * q + d * kv * 2 + q * d + d * f * 2 + f * d  # q, k, v, o, gate, up, down
    want = layers * per_layer * 3 // 4 + vocab * d * 9 // 8
    plan = make_plan(load_config(CONFIGS / "local.yaml"), model=SMOLLM2)
    assert plan.packed_bytes_per_device == want and plan.ok and not plan.warnings
    for text in ("engine: {pack_weights: 'off'}", "model: {param_dtype: bfloat16}"):
        assert make_plan(load_config(_write(tmp_path, "local.yaml", text)), model=SMOLLM2).packed_bytes_per_device == 0
    assert make_plan(load_config(CONFIGS / "cpu-fsdp.yaml"), model=SMOLLM2).packed_bytes_per_device == 0
    # 0.72 GiB usable: the float32 weights (0.50 GiB) and the float16 KV pool (0.18) fit, the packed copies would not
    tight = make_plan(load_config(_write(tmp_path, "local.yaml", "cluster: {device_memory_gib: 0.9}")), model=SMOLLM2)
    assert tight.ok
    assert any("with packed copies of 4-/8-bit-block weights (up to 0.10 GiB) they would not" in w
               and "engine.pack_weights: off" in w for w in tight.warnings), tight.warnings
    assert "packed copies up to 0.10 GiB per device" in format_plan(plan)


def test_the_kv_cache_dtype_sets_the_planned_pool_and_pallas_needs_the_models(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture) -> None:
    """`engine.kv_dtype` float16 halves a float32 model's planned pool and `plan` prints its dtype; auto is the
    model's dtype. On a TPU the pallas kernels read the model's dtype, so another one is a problem that names the
    settings, unless the attention backend is xla."""
    f32 = make_plan(load_config(_write(tmp_path, "local.yaml", "engine: {kv_dtype: float32}")), model=SMOLLM2)
    f16 = make_plan(load_config(_write(tmp_path, "local.yaml", "engine: {kv_dtype: float16}")), model=SMOLLM2)
    auto = make_plan(load_config(_write(tmp_path, "local.yaml", "engine: {kv_dtype: auto}")), model=SMOLLM2)
    assert (f32.kv_dtype, f16.kv_dtype, auto.kv_dtype) == ("float32", "float16", "float32")
    assert f16.kv_bytes_per_device * 2 == f32.kv_bytes_per_device == auto.kv_bytes_per_device > 0
    assert f16.kv_bytes_per_token * 2 == f32.kv_bytes_per_token == 30 * 2 * 3 * 64 * 4
    assert f16.ok and "KV cache      float16:" in format_plan(f16)
    tpu = make_plan(load_config(_write(tmp_path, "tpu-v5e-16.yaml", "engine: {kv_dtype: float16}")))
    assert not tpu.ok
    assert any("engine.kv_dtype float16 differs from model.dtype bfloat16, but the pallas attention kernels on tpu "
               "read" in p for p in tpu.problems), tpu.problems
    assert main(["plan", str(_write(tmp_path, "tpu-v5e-16.yaml", "engine: {kv_dtype: float16}"))]) != 0
    err = capsys.readouterr().err
    assert "set engine.kv_dtype auto" in err and "or engine.attention xla" in err, err
    xla = make_plan(load_config(_write(tmp_path, "tpu-v5e-16.yaml", "engine: {kv_dtype: float16, attention: xla}")))
    assert xla.ok and xla.kv_dtype == "float16", xla.problems
    same = make_plan(load_config(_write(tmp_path, "tpu-v5e-16.yaml", "engine: {kv_dtype: bfloat16}")))
    assert same.ok and same.kv_bytes_per_device == tpu.kv_bytes_per_device
