"""Config loading is strict: unknown keys, wrong types and impossible combinations name file, key, numbers."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from raydeploy.config import Config, ConfigError, config_from_dict, config_reference_markdown, load_config
from raydeploy.model.sharding import DEFAULT_RULES, check_divisible, merge_rules, partition_spec
from raydeploy.model.spec import LlamaConfig, TensorSpec, param_specs


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "deploy.yaml"
    p.write_text(text)
    return p


def test_embedded_default_loads() -> None:
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.total_devices == cfg.cluster.num_hosts * cfg.cluster.devices_per_host
    assert cfg.mesh_shape == {"dp": 2}
    assert cfg.source.endswith("default_config.yaml")


def test_unknown_key_names_file_and_key(tmp_path: Path) -> None:
    p = _write(tmp_path, "engine:\n  max_slot: 4\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert str(p) in msg and "engine.max_slot" in msg and "max_slots" in msg


def test_unknown_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="key 'servng'"):
        load_config(_write(tmp_path, "servng: {}\n"))


def test_wrong_type_names_key_and_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(_write(tmp_path, "engine:\n  max_slots: eight\n"))
    assert "engine.max_slots" in str(ei.value) and "'eight'" in str(ei.value) and "integer" in str(ei.value)


def test_bool_is_not_an_int(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cluster.num_hosts"):
        load_config(_write(tmp_path, "cluster:\n  num_hosts: true\n"))


def test_literal_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.dtype.*'float32', 'bfloat16'.*'fp8'"):
        load_config(_write(tmp_path, "model:\n  dtype: fp8\n"))


def test_mesh_size_vs_devices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(_write(tmp_path, "cluster: {num_hosts: 2, devices_per_host: 2}\nmesh:\n  axes: {dp: 2, tp: 4}\n"))
    msg = str(ei.value)
    assert "mesh.axes" in msg and "8 devices" in msg and "4" in msg


def test_mesh_wildcard_resolves(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "cluster: {num_hosts: 4, devices_per_host: 4}\nmesh:\n  axes: {fsdp: -1, tp: 4}\n"))
    assert cfg.mesh_shape == {"fsdp": 4, "tp": 4}


def test_mesh_two_wildcards(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="only one axis may be -1"):
        load_config(_write(tmp_path, "mesh:\n  axes: {fsdp: -1, tp: -1}\n"))


def test_unknown_mesh_axis(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown mesh axis 'pp'"):
        load_config(_write(tmp_path, "mesh:\n  axes: {pp: 4}\n"))


def test_slots_vs_dp(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_slots 3 is not divisible by mesh dp=2"):
        load_config(_write(tmp_path, "engine: {max_slots: 3}\nmesh: {axes: {dp: 2, tp: 2}}\n"))


def test_buckets_must_cover_max_seq_len(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="largest prefill bucket 512 is smaller than model.max_seq_len 2048"):
        load_config(_write(tmp_path, "engine: {prefill_buckets: [128, 512]}\n"))


def test_overrides_apply_and_are_checked(tmp_path: Path) -> None:
    p = _write(tmp_path, "engine: {max_slots: 8}\n")
    cfg = load_config(p, ["engine.max_slots=4", "serving.port=9001", "model.dtype=bfloat16"])
    assert cfg.engine.max_slots == 4 and cfg.serving.port == 9001 and cfg.model.dtype == "bfloat16"
    with pytest.raises(ConfigError, match="engine.max_slots"):
        load_config(p, ["engine.max_slots=-1"])
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(p, ["engine.max_slots"])


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "engine: [\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(_write(tmp_path, "- 1\n"))


def test_simulated_requires_cpu() -> None:
    with pytest.raises(ConfigError, match="cluster.simulated"):
        config_from_dict({"cluster": {"platform": "tpu", "simulated": True}})


def test_config_error_pickles() -> None:
    err = ConfigError("bad", file="f.yaml", key="a.b")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and back.key == "a.b" and back.file == "f.yaml"


def test_reference_lists_every_field() -> None:
    md = config_reference_markdown()
    for key in ("cluster.heartbeat_timeout_s", "engine.sampling.top_p", "serving.max_body_bytes", "mesh.rules"):
        assert f"`{key}`" in md
    # every field has a docstring
    assert "|  |" not in md.replace("| `", "")


# -- sharding rules -------------------------------------------------------------------------------

SMOL = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=2, num_heads=9,
                   num_kv_heads=3, head_dim=64, tie_word_embeddings=True)


def test_every_param_matches_a_rule() -> None:
    rules = merge_rules(None)
    for spec in param_specs(SMOL).values():
        partition_spec(spec.logical_axes, rules, {"fsdp": 2, "tp": 3}, spec.name)


def test_heads_not_divisible_by_tp_names_tensor() -> None:
    rules = merge_rules(None)
    spec = param_specs(SMOL)["layers.0.attn.q_proj.kernel"]
    with pytest.raises(ConfigError) as ei:
        check_divisible(spec, rules, {"tp": 2})
    msg = str(ei.value)
    assert "layers.0.attn.q_proj.kernel" in msg and "'q_heads' of size 9" in msg and "tp=2" in msg


def test_colliding_axes_are_an_error() -> None:
    rules = merge_rules({"embed": "tp"})
    with pytest.raises(ConfigError, match="mesh axis 'tp' is used by both logical axes 'embed' and 'mlp'"):
        partition_spec(("embed", "mlp"), rules, {"tp": 2}, "layers.0.mlp.gate_proj.kernel")


def test_unknown_logical_axis_and_mesh_axis_in_rules() -> None:
    with pytest.raises(ConfigError, match="unknown logical axis 'heads'"):
        merge_rules({"heads": "tp"})
    with pytest.raises(ConfigError, match="names mesh axis 'model'"):
        merge_rules({"mlp": "model"})


def test_missing_rule_is_an_error() -> None:
    with pytest.raises(ConfigError, match="logical axis 'experts' has no sharding rule"):
        partition_spec(("experts",), DEFAULT_RULES, {"tp": 2}, TensorSpec("x", (4,), ("experts",)).name)
