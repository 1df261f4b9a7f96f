"""Serve readiness is the gang's readiness (the RayService path): with `ready_timeout_s`, the ingress replica's
constructor returns only once the gang supervisor reports `ready`, and fails with the gang's error when the
gang fails. Real local Ray, the real supervisor and host processes, with the stand-in engine.
"""

from __future__ import annotations

import os

import pytest

from raydeploy.config import ConfigError, load_config
from raydeploy.gang.bringup import GangError
from raydeploy.gang.gang import start_gang
from raydeploy.serve.builder import app_builder
from raydeploy.serve.deployment import wait_for_gang


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, _temp_dir=f"/tmp/rdr-{os.getpid()}", include_dashboard=False,
             namespace="raydeploy-tests", configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def _cfg(*extra: str):
    return load_config(None, ["cluster.heartbeat_timeout_s=4", "cluster.init_timeout_s=6",
                              "cluster.restart_backoff_s=0.2", "engine.max_slots=2", *extra])


@pytest.mark.ray
def test_ingress_waits_until_the_gang_is_ready(ray_cluster):
    cfg = load_config(None, ["engine.max_slots=2"])  # default timeouts: a busy machine still brings it up
    gang = start_gang(cfg, engine="toy")
    try:
        assert gang.state()["state"] != "ready"  # still starting: the wait below has something to wait for
        st = wait_for_gang(cfg, 120)
        assert st["state"] == "ready"
        assert gang.coordinator() is not None
    finally:
        gang.shutdown()


@pytest.mark.ray
def test_ingress_fails_with_the_gang_error(ray_cluster):
    cfg = _cfg("cluster.max_restarts=0")
    gang = start_gang(cfg, engine="toy", faults={1: {"never_join": 120}})
    try:
        with pytest.raises(GangError) as info:
            wait_for_gang(cfg, 120)
        msg = str(info.value)
        assert "gang failed" in msg and "host(s) [1] did not finish init" in msg, msg
    finally:
        gang.shutdown()


@pytest.mark.parametrize("bad", ["30", 0, -5, True])
def test_builder_rejects_a_bad_ready_timeout(bad) -> None:
    with pytest.raises(ConfigError, match=r"arg ready_timeout_s must be a number of seconds > 0, found "):
        app_builder({"config": "/etc/raydeploy/config.yaml", "ready_timeout_s": bad})
