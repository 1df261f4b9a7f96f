"""`raydeploy status` against the real HTTP stack (Ray Serve ingress + a gang with the stand-in engine):
not ready while the gang comes up or when the key is missing, then ready with the gang's numbers."""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
import time

import pytest

from raydeploy.cli import main
from raydeploy.config import load_config

pytestmark = [pytest.mark.ray, pytest.mark.e2e, pytest.mark.model]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_status_of_a_live_deployment(demo_checkpoint, capsys: pytest.CaptureFixture,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from raydeploy.serve.run import start_serving

    port = _free_port()
    monkeypatch.setenv("RAYDEPLOY_TEST_KEYS", "k-live")
    cfg = load_config(None, [f"serving.port={port}", "serving.api_keys_env=RAYDEPLOY_TEST_KEYS",
                             "engine.max_slots=2", "cluster.init_timeout_s=60"])
    temp_dir = tempfile.mkdtemp(prefix="rdst-", dir="/tmp")
    ray.init(num_cpus=2, _temp_dir=temp_dir, include_dashboard=False, configure_logging=False, log_to_driver=False)
    serving = None
    try:
        serving = start_serving(cfg, checkpoint_path=str(demo_checkpoint), engine="toy")
        url = serving.url
        deadline = time.monotonic() + 300
        rc = None
        while time.monotonic() < deadline:
            rc = main(["status", url, "--json", "--api-key", "k-live"])
            capsys.readouterr()
            if rc == 0:
                break
            assert rc in (1, 3)  # 1 while the HTTP proxy is not answering yet, 3 while the gang comes up
            time.sleep(1)
        assert rc == 0
        assert main(["status", url, "--json", "--api-key", "k-live"]) == 0
        info = json.loads(capsys.readouterr().out)
        st = info["status"]
        assert info["ready"] and st["state"] == "ready" and st["process_count"] == 2 and st["devices"] == 2
        assert st["ready_gangs"] == 1 and len(st["gang"]["gangs"]) == 1
        assert len(st["gang"]["gangs"][0]["host_status"]) == 2
        # no internal address over HTTP: not the real gang's coordinator ip:port, not its hosts' node IPs
        (gang,) = serving.gangs.status()["gangs"]  # the driver's view over Ray keeps them
        published = json.dumps(st)
        assert gang["coordinator_address"] and gang["coordinator_address"] not in published
        node_ips = {h["node_ip"] for h in gang["hosts"] if h.get("node_ip")}
        assert node_ips and not any(ip in published for ip in node_ips), node_ips
        monkeypatch.delenv("RAYDEPLOY_API_KEY", raising=False)
        assert main(["status", url]) == 1
        assert "/status needs an API key" in capsys.readouterr().out
    finally:
        if serving is not None:
            serving.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
