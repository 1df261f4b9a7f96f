"""`EngineGeometry`: an engine's shapes from the config, the mesh and the rules alone, without JAX; the one
divisibility rule of the slots."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from raydeploy.config import load_config
from raydeploy.engine.geometry import DEFAULT_SLOT_RULE, SLOT_AXIS, EngineGeometry, slots_problem
from raydeploy.model.sharding import DEFAULT_RULES, merge_rules

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_importing_the_geometry_imports_no_jax() -> None:
    code = "import sys, raydeploy.engine.geometry, raydeploy.config; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_config_knows_the_slot_axis_default() -> None:
    assert DEFAULT_RULES[SLOT_AXIS] == DEFAULT_SLOT_RULE


def test_v5e_geometry() -> None:
    """tpu-v5e-16: 168 slots over dp=4, 8192 tokens in pages of 16, every slot's pages (auto)."""
    cfg = load_config(CONFIGS / "tpu-v5e-16.yaml")
    g = EngineGeometry.create(cfg.engine, cfg.model, cfg.mesh_shape, merge_rules(cfg.mesh.rules), "tpu", "bfloat16",
                              False)
    assert g.problems() == []
    assert (g.groups, g.slots_per_group, g.slot_axes) == (4, 42, ("dp",))
    assert (g.page_size, g.max_pages_per_seq, g.pages_per_group, g.total_pages) == (16, 512, 42 * 512, 4 * 42 * 512)
    assert g.max_step_tokens == max(cfg.engine.prefill_chunk, 42)
    assert g.page_buckets == (512,) and g.token_buckets[0] == 1 and g.token_buckets[-1] == g.max_step_tokens
    assert g.mixed_step_tokens is None  # only CPU caps the step beside running streams
    assert g.admission.max_slots == 168 and g.admission.max_seq_len == 8192
    assert g.to_dict()["slot_mesh"] == (("dp", 4),)


def test_slots_divide_over_the_axes_the_slot_axis_maps_to() -> None:
    """max_slots 6 divides over dp=2 but not over tp=4, the axis the rules map the slots to."""
    mesh = {"dp": 2, "tp": 4}
    assert slots_problem(6, {SLOT_AXIS: "dp"}, mesh) is None
    msg = ("engine.max_slots 6 is not divisible by mesh tp=4 (the dp groups of the KV cache's slots, "
           "mesh.rules.cache_batch)")
    assert slots_problem(6, {SLOT_AXIS: "tp"}, mesh) == msg
    assert slots_problem(6, {SLOT_AXIS: ("dp", "tp")}, mesh) == msg.replace("mesh tp=4", "mesh dp=2 x tp=4")
    assert slots_problem(5, {SLOT_AXIS: None}, mesh) is None  # one group
    cfg = load_config(CONFIGS / "local.yaml")
    engine = type(cfg.engine)(**{**{f: getattr(cfg.engine, f) for f in cfg.engine.__dataclass_fields__},
                                 "max_slots": 6})
    g = EngineGeometry.create(engine, cfg.model, mesh, {SLOT_AXIS: "tp"}, "cpu", "float32", False)
    assert g.groups == 4 and g.slots_per_group == 0
    assert g.problems() == [msg]


def test_the_bringup_fingerprint_includes_the_geometry() -> None:
    from raydeploy.gang.fingerprint import (
        FingerprintMismatchError,
        check_fingerprints,
        geometry_part,
        host_fingerprint,
    )

    cfg = load_config(None)
    part = geometry_part(cfg)
    assert part["max_slots"] == cfg.engine.max_slots and part["groups"] == cfg.mesh_shape.get("dp", 1)
    assert "page_buckets" not in part and "kv_dtype" not in part  # decided on the device, after the fingerprint
    same = host_fingerprint(cfg, "abc", {})
    assert same == host_fingerprint(load_config(None), "abc", {}) and "engine.geometry" in same
    other = host_fingerprint(load_config(None, ["engine.num_pages=4096"]), "abc", {})
    assert other["engine.geometry"] != same["engine.geometry"]
    with pytest.raises(FingerprintMismatchError, match=r"host 1 differs from host 0 in engine\.geometry"):
        check_fingerprints([same, other])


def test_the_engine_refuses_a_remapped_slot_axis_with_the_same_message() -> None:
    """The programs ask the same rule: slots over fsdp=2 (mesh.rules.cache_batch) with max_slots 3."""
    import jax

    from raydeploy.config import EngineConfig, ModelConfig
    from raydeploy.engine.programs import ProgramSet
    from raydeploy.model.registry import family_for
    from raydeploy.model.sharding import build_mesh
    from raydeploy.model.spec import LlamaConfig

    model = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    mesh = build_mesh({"dp": 1, "fsdp": 2}, jax.devices()[:2])
    rules = merge_rules({"cache_batch": "fsdp"})
    msg = ("engine.max_slots 3 is not divisible by mesh fsdp=2 (the dp groups of the KV cache's slots, "
           "mesh.rules.cache_batch)")
    with pytest.raises(ValueError, match=re.escape(msg)):
        ProgramSet(family_for("llama"), model, mesh, rules, ModelConfig(max_seq_len=64), EngineConfig(max_slots=3))
    ps = ProgramSet(family_for("llama"), model, mesh, rules, ModelConfig(max_seq_len=64), EngineConfig(max_slots=4))
    assert ps.geometry.groups == ps.groups == 2 and ps.geometry.slots_per_group == ps.slots_per_group == 2
