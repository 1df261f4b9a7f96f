"""Config loading is strict: unknown keys, wrong types and impossible combinations name file, key, numbers."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest

from raydeploy.config import (
    Config,
    ConfigError,
    EngineConfig,
    config_from_dict,
    config_reference_markdown,
    load_config,
)
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


@pytest.mark.parametrize("value", ["0.5", "1", "-2.0"])
def test_max_decode_slowdown_is_zero_or_above_one(tmp_path: Path, value: str) -> None:
    path = _write(tmp_path, f"engine: {{max_decode_slowdown: {value}}}\n")
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    msg = str(ei.value)
    assert "engine.max_decode_slowdown" in msg and "must be 0 (never hold a prompt's chunks back) or > 1" in msg
    assert str(path) in msg
    assert load_config(_write(tmp_path, "engine: {max_decode_slowdown: 0}\n")).engine.max_decode_slowdown == 0


@pytest.mark.parametrize("value", ["-0.1", "1.5"])
def test_burst_wait_is_a_fraction_of_a_pass(tmp_path: Path, value: str) -> None:
    path = _write(tmp_path, f"engine: {{burst_wait: {value}}}\n")
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    msg = str(ei.value)
    assert "engine.burst_wait" in msg and f"must be a fraction of a decode pass in [0, 1], found {value}" in msg
    assert str(path) in msg
    assert load_config(_write(tmp_path, "engine: {burst_wait: 0}\n")).engine.burst_wait == 0


@pytest.mark.parametrize(("text", "key", "message"), [
    ("engine: {speculative: {method: draft}}", "engine.speculative.draft_checkpoint", "method draft needs"),
    ("engine: {speculative: {num_tokens: 0}}", "engine.speculative.num_tokens", "must be >= 1, found 0"),
    ("engine: {speculative: {ngram_min: 5}}", "engine.speculative.ngram_min", "ngram_min 5 and ngram_max 4"),
    ("engine: {speculative: {min_acceptance: 1.5}}", "engine.speculative.min_acceptance", "in [0, 1], found 1.5"),
    ("lora: {max_rank: 0, max_adapters: 2}", "lora.max_rank", "must be >= 1, found 0"),
    ("lora: {adapters: {a: /x}}", "lora.adapters", "1 adapters to preload but lora.max_adapters is 0"),
    ("lora: {max_adapters: 2}\nengine: {speculative: {method: draft, draft_checkpoint: /x}}",
     "engine.speculative.method", "the draft method does not run LoRA adapters yet"),
])
def test_speculative_and_lora_settings_are_checked_before_anything_starts(tmp_path: Path, text: str, key: str,
                                                                         message: str) -> None:
    path = _write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    assert f"key '{key}'" in str(ei.value) and message in str(ei.value) and str(path) in str(ei.value)


def test_a_removed_key_is_refused_naming_it_and_why(tmp_path: Path) -> None:
    path = _write(tmp_path, "engine: {prefill_buckets: [128, 512]}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert "engine.prefill_buckets" in msg and str(path) in msg
    assert "this key was removed (prompts are computed in chunks of engine.prefill_chunk tokens" in msg
    assert "delete it from the config" in msg
    with pytest.raises(ConfigError, match=r"engine.prefill_buckets.*this key was removed"):
        load_config(None, ["engine.prefill_buckets=[64]"])


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


# Each case: YAML text, the dotted key and the exact message after "file <path>, key '<key>': ". The wording is
# the loader's contract (file, key, what was expected, what was found), whatever does the type checking.
TYPE_CASES = [
    ("engine:\n  sampling:\n    top_k: many\n", "engine.sampling.top_k", "expected an integer, found 'many'"),
    ("engine:\n  sampling:\n    topk: 3\n", "engine.sampling.topk",
     "unknown key; known keys here are: temperature, top_p, top_k, repetition_penalty"),
    ("engine:\n  sampling:\n    temperature: hot\n", "engine.sampling.temperature", "expected a number, found 'hot'"),
    ("engine:\n  sampling:\n    temperature: false\n", "engine.sampling.temperature",
     "expected a number, found False"),
    ("serving:\n  cors_origins: [a, 3]\n", "serving.cors_origins[1]", "expected a string, found 3"),
    ("serving:\n  cors_origins: 64\n", "serving.cors_origins", "expected a list, found 64"),
    ("engine:\n  warmup: 1\n", "engine.warmup", "expected true or false, found 1"),
    ("engine:\n  attention: flash\n", "engine.attention", "must be one of 'auto', 'xla', 'pallas', found 'flash'"),
    ("engine: 4\n", "engine", "expected a mapping (section), found 4"),
    ("engine:\n  sampling: [1]\n", "engine.sampling", "expected a mapping (section), found [1]"),
    ("model:\n", "model", "expected a mapping (section), found None"),
    ("mesh:\n  axes: {dp: 1, tp: two}\n", "mesh.axes.tp", "expected an integer, found 'two'"),
    ("mesh:\n  axes: {1: 4}\n", "mesh.axes.1", "expected a string, found 1"),
    ("mesh:\n  axes: [dp, tp]\n", "mesh.axes", "expected a mapping, found ['dp', 'tp']"),
    ("mesh:\n  rules: {embed: 3}\n", "mesh.rules.embed", "expected list[str] | str | None, found 3"),
    ("mesh:\n  rules: {embed: [tp, 2]}\n", "mesh.rules.embed", "expected list[str] | str | None, found ['tp', 2]"),
    ("cluster:\n  coordinator_port: high\n", "cluster.coordinator_port", "expected int | None, found 'high'"),
    ("cluster:\n  host_resources: {TPU: four}\n", "cluster.host_resources.TPU", "expected a number, found 'four'"),
    ("cluster:\n  env: {DEBUG: 1}\n", "cluster.env.DEBUG", "expected a string, found 1"),
    ("serving:\n  host: 127\n", "serving.host", "expected a string, found 127"),
    ("serving:\n  cors_origins: [true]\n", "serving.cors_origins[0]", "expected a string, found True"),
    ("replicas:\n  initial: 1.5\n", "replicas.initial", "expected int | None, found 1.5"),
    # the first problem in the file's order is the one reported
    ("serving:\n  port: x\nengine:\n  max_slotz: 4\n  max_slots: y\n", "serving.port",
     "expected an integer, found 'x'"),
    ("engine:\n  max_slotz: 4\n  max_slots: y\n", "engine.max_slotz", "unknown key; known keys here are: "
     + ", ".join(f.name for f in dataclasses.fields(EngineConfig))),
    ("source: x.yaml\ncluster: {num_hosts: 1.0}\n", "cluster.num_hosts", "expected an integer, found 1.0"),
]


@pytest.mark.parametrize(("text", "key", "message"), TYPE_CASES)
def test_type_errors_name_file_dotted_key_and_value(tmp_path: Path, text: str, key: str, message: str) -> None:
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert str(ei.value) == f"file {p}, key '{key}': {message}"
    assert ei.value.file == str(p) and ei.value.key == key


def test_override_type_errors_name_the_dotted_key(tmp_path: Path) -> None:
    p = _write(tmp_path, "")
    with pytest.raises(ConfigError) as ei:
        load_config(p, ["engine.sampling.top_p=high"])
    assert str(ei.value) == f"file {p}, key 'engine.sampling.top_p': expected a number, found 'high'"
    with pytest.raises(ConfigError, match=r"key 'engine.sampling.top': unknown key; known keys here are: temperature"):
        load_config(p, ["engine.sampling.top=1"])
    with pytest.raises(ConfigError, match=r"override 'engine.max_slots.x=1': 'max_slots' is not a section"):
        load_config(_write(tmp_path, "engine: {max_slots: 4}\n"), ["engine.max_slots.x=1"])


def test_loaded_values_have_the_declared_types(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "serving: {request_timeout_s: 10}\ncluster: {host_resources: {TPU: 4}}\n"
                                       "engine: {sampling: {temperature: 0}}\nmesh: {rules: {embed: [tp], mlp: null}}\n"))
    assert cfg.serving.request_timeout_s == 10.0 and type(cfg.serving.request_timeout_s) is float  # YAML int -> float
    assert cfg.cluster.host_resources == {"TPU": 4.0} and type(cfg.cluster.host_resources["TPU"]) is float
    assert type(cfg.engine.sampling.temperature) is float
    assert cfg.mesh.rules == {"embed": ["tp"], "mlp": None}
    assert cfg.source == str(tmp_path / "deploy.yaml")
    # frozen dataclasses as before: replace works, to_dict round-trips through the loader
    again = config_from_dict(cfg.to_dict(), source="again")
    assert again == dataclasses.replace(cfg, source="again")


def test_tuples_are_not_lists() -> None:
    with pytest.raises(ConfigError, match=r"key 'serving.cors_origins': expected a list, found \('a', 'b'\)"):
        config_from_dict({"serving": {"cors_origins": ("a", "b")}})


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
