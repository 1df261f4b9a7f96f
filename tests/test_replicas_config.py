"""The `replicas` config section and the Serve options of the gang deployment made from it (no cluster):
bad values are refused naming the key, min == max fixes the count, otherwise Serve's autoscaling_config;
admission (slots per replica, the router's queue) and placement follow the config."""

from __future__ import annotations

from pathlib import Path

import pytest

from raydeploy.config import ConfigError, load_config
from raydeploy.gang.directory import gang_name, sum_stats, summarize
from raydeploy.serve.deployment import GANG_DEPLOYMENT_NAME, gang_deployment_options
from raydeploy.serve.routing import ready_for_requests


@pytest.mark.parametrize(("override", "key", "words"), [
    ("replicas.min=0", "replicas.min", "must be >= 1"),
    ("replicas.max=0", "replicas.max", "must be >= replicas.min=1, found 0"),
    ("replicas.initial=3", "replicas.initial", "between replicas.min=1 and replicas.max=1, found 3"),
    ("replicas.target_ongoing_requests=0", "replicas.target_ongoing_requests", "must be > 0"),
    ("replicas.upscale_delay_s=-1", "replicas.upscale_delay_s", "must be >= 0"),
    ("replicas.routing_stats_period_s=0", "replicas.routing_stats_period_s", "must be > 0"),
    ("replicas.maximum=2", "replicas.maximum", "unknown key; known keys here are: min, max"),
    ("replicas.max=two", "replicas.max", "expected an integer, found 'two'"),
])
def test_bad_replicas_values_name_the_key(override: str, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    msg = str(info.value)
    assert f"key '{key}'" in msg and words in msg, msg


def test_fixed_count_and_admission_from_the_config() -> None:
    cfg = load_config(None, ["replicas.min=2", "replicas.max=2", "engine.max_slots=6", "serving.max_queue=10",
                             "cluster.host_num_cpus=0.25", "serving.request_timeout_s=120"])
    opts = gang_deployment_options(cfg)
    assert opts["name"] == GANG_DEPLOYMENT_NAME and opts["num_replicas"] == 2 and "autoscaling_config" not in opts
    assert opts["max_ongoing_requests"] == 6 and opts["max_queued_requests"] == 10 + 6 * 2  # a backstop
    assert opts["placement_group_bundles"] == [{"CPU": 0.25}, {"CPU": 0.25}]  # one bundle per host
    assert opts["placement_group_strategy"] == "PACK"  # simulated hosts share the node
    assert opts["ray_actor_options"] == {"num_cpus": 0} and opts["graceful_shutdown_timeout_s"] == 150
    rc = opts["request_router_config"]
    assert rc.request_routing_stats_period_s == 1.0 and "ReadyGangRouter" in str(rc.request_router_class)


def test_autoscaling_follows_serve_names() -> None:
    cfg = load_config(None, ["replicas.min=1", "replicas.max=3", "replicas.upscale_delay_s=5",
                             "replicas.downscale_delay_s=60", "replicas.downscaling_factor=0.5",
                             "engine.max_slots=4"])
    auto = gang_deployment_options(cfg)["autoscaling_config"]
    assert auto == {"min_replicas": 1, "max_replicas": 3, "initial_replicas": None, "target_ongoing_requests": 4.0,
                    "upscale_delay_s": 5.0, "downscale_delay_s": 60.0, "look_back_period_s": 30.0,
                    "downscaling_factor": 0.5}
    cfg = load_config(None, ["replicas.max=2", "replicas.target_ongoing_requests=3"])
    assert gang_deployment_options(cfg)["autoscaling_config"]["target_ongoing_requests"] == 3.0


def test_a_bundle_without_resources_is_refused_before_serve_sees_it() -> None:
    cfg = load_config(None, ["cluster.host_num_cpus=0"])
    with pytest.raises(ConfigError, match=r"key 'cluster.host_num_cpus'.*needs resources in every host bundle"):
        gang_deployment_options(cfg)


def test_tpu_slices_are_pinned_by_the_supervisor_not_by_serve() -> None:
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tpu-v5e-16.yaml")
    opts = gang_deployment_options(cfg)
    assert "placement_group_bundles" not in opts and opts["num_replicas"] == 1


def test_the_deployment_state_is_ready_while_any_gang_is() -> None:
    assert gang_name("raydeploy", "abc") == "raydeploy-gang-raydeploy-abc"
    st = summarize([{"gang": "b", "state": "restarting", "restarts": 1, "last_error": "host 0 failed"},
                    {"gang": "a", "state": "ready", "restarts": 0, "last_error": None}])
    assert st["state"] == "ready" and st["ready_gangs"] == 1 and st["total_gangs"] == 2 and st["restarts"] == 1
    assert [g["gang"] for g in st["gangs"]] == ["a", "b"] and st["last_error"] == "host 0 failed"
    assert summarize([{"state": "failed"}, {"state": "restarting"}])["state"] == "restarting"
    assert summarize([{"state": "failed"}])["state"] == "failed"
    assert summarize([])["state"] == "starting" and summarize([])["ready_gangs"] == 0
    total = sum_stats({"a": {"slots_in_use": 2, "error": None}, "b": {"slots_in_use": 3, "queue_depth": 1}})
    assert total["slots_in_use"] == 5 and total["queue_depth"] == 1 and set(total["gangs"]) == {"a", "b"}
    assert ready_for_requests({"ready": True}) and not ready_for_requests({"ready": False})
    assert not ready_for_requests({})  # no report yet: not ready
