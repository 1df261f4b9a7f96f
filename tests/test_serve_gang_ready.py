"""Serve readiness is the gang's readiness (the RayService path): with `ready_timeout_s`, each gang replica's
constructor returns only once its gang is ready, so `serve.run` (and KubeRay's RayService) sees the application
RUNNING only then; a gang that fails makes the replica fail with the gang's error. Real local Ray, real Serve,
the real supervisor and host process, with the stand-in engine; the failure path also with a stub supervisor.
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from raydeploy.config import ConfigError, load_config
from raydeploy.gang.bringup import GangError
from raydeploy.serve.builder import app_builder
from raydeploy.serve.replica import GangReplica


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.ray
@pytest.mark.e2e
def test_the_application_runs_only_once_its_gang_is_ready(demo_checkpoint):
    import ray
    from ray import serve

    from raydeploy.gang.directory import GangSet
    from raydeploy.serve.deployment import APP_NAME, build_serve_app
    from raydeploy.serve.run import connect_ray

    cfg = load_config(None, ["cluster.num_hosts=1", "cluster.devices_per_host=1", "mesh.axes={dp: 1}",
                             "engine.max_slots=2", f"serving.port={_free_port()}", "cluster.init_timeout_s=60"])
    assert connect_ray(None, temp_dir=f"/tmp/rdr-{os.getpid()}", num_cpus=2)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": cfg.serving.port})
        serve.run(build_serve_app(cfg, demo_checkpoint, ready_timeout_s=600, engine="toy"), name=APP_NAME,
                  route_prefix="/")
        st = GangSet(APP_NAME, cfg).state()  # the moment serve.run returns
        assert st["ready_gangs"] == 1 and st["gangs"][0]["state"] == "ready", st
    finally:
        serve.shutdown()
        ray.shutdown()


class _Remote:
    def __init__(self, value: dict) -> None:
        self.value = value

    def remote(self) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self.value)
        return fut


class _FailedSupervisor:
    """Stands in for a supervisor whose gang failed for good (beside the real path above)."""

    get_state = _Remote({"state": "failed", "last_error": "bring-up phase 'init' failed: host(s) [1] did not "
                                                          "finish init within 16s", "generation": 1})


def test_a_failed_gang_fails_the_replica_with_its_error():
    replica = object.__new__(GangReplica)
    replica.supervisor, replica.rpc_timeout_s, replica.name = _FailedSupervisor(), 5.0, "raydeploy-gang-x"
    replica._state, replica._state_at = {}, -1e9
    with pytest.raises(GangError, match=r"gang failed: bring-up phase 'init' failed: host\(s\) \[1\] did not finish"):
        asyncio.run(replica._wait_ready(60))
    with pytest.raises(RuntimeError, match=r"gang raydeploy-gang-x failed: bring-up phase 'init'"):
        asyncio.run(replica.check_health())


@pytest.mark.parametrize("bad", ["30", 0, -5, True])
def test_builder_rejects_a_bad_ready_timeout(bad) -> None:
    with pytest.raises(ConfigError, match=r"arg ready_timeout_s must be a number of seconds > 0, found "):
        app_builder({"config": "/etc/raydeploy/config.yaml", "ready_timeout_s": bad})
