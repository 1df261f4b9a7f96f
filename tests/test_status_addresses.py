"""`/status` publishes no internal address: not the jax.distributed coordinator's ip:port, not a host's node IP,
not the config's bind or Ray addresses, not an address inside an error text. Real HTTP (uvicorn on loopback)
over the real app, with a gang stand-in whose status has the supervisor's shape (raydeploy.gang.supervisor)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from serve_fakes import FakeBackend, ThreadedServer, tokenizer_dir

from raydeploy.config import load_config
from raydeploy.serve.app import ServerInfo, create_app
from raydeploy.serve.auth import ApiKeyCheck
from raydeploy.serve.deployment import public_config
from raydeploy.serve.generation import Limits, ServingCore
from raydeploy.serve.redact import MASK, without_addresses
from raydeploy.serve.text import TextCodec

KEY = "sk-test-0123456789"
COORDINATOR = "10.12.3.4:8476"
NODE_IPS = ("10.12.3.4", "10.12.3.5")
ADDRESSES = (COORDINATOR, *NODE_IPS, "10.12.0.2", "fd00::7")


class GangWithAddresses(FakeBackend):
    """The fake gang, its status shaped as the supervisor's: coordinator address, node IPs, an error naming one."""

    async def state(self) -> dict[str, Any]:
        return {**await super().state(), "last_error": f"host 1 did not join the coordinator at {COORDINATOR} "
                                                        "within 60s (restarted)"}

    async def status(self) -> dict[str, Any]:
        hosts = [{"rank": r, "alive": True, "pid": 100 + r, "node_id": f"node{r}", "node_ip": ip}
                 for r, ip in enumerate(NODE_IPS)]
        host_status = [{"rank": r, "pid": 100 + r, "phase": "serving", "node_ip": ip, "init": {"init_s": 0.5}}
                       for r, ip in enumerate(NODE_IPS)]
        gang = {"gang": "g0", "state": "ready", "restarts": 1, "coordinator_address": COORDINATOR,
                "hosts": hosts, "host_status": host_status,
                "history": [{"generation": 0, "error": f"preflight failed on node {NODE_IPS[1]}; "
                                                       f"peer [fd00::7]:8476 unreachable"}]}
        return {**await self.state(), "gangs": [gang]}


@pytest.fixture(scope="module")
def server():
    codec = TextCodec.from_dir(tokenizer_dir())
    cfg = load_config(None, ["model.max_seq_len=128", "engine.max_new_tokens=64",
                             "engine.max_slots=4",
                             "cluster.coordinator_bind_address=10.12.3.4", "cluster.ray_address=10.12.0.2:6379"])
    backend = GangWithAddresses(codec.encode(" Hi.") + list(codec.eos_token_ids), codec.eos_token_ids[0])
    core = ServingCore(backend, codec, Limits.from_config(cfg, "smollm2-135m-instruct"))
    app = create_app(core, api_keys=ApiKeyCheck((KEY,)), max_body_bytes=4096,
                     info=ServerInfo(config=public_config(cfg), devices=2, process_count=2, mesh={"dp": 2}))
    with ThreadedServer(app) as s:
        yield s


def test_status_json_holds_no_internal_address(server):
    r = httpx.get(server.url + "/status", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    for address in ADDRESSES:
        assert address not in r.text, f"/status publishes {address}"
    for key in ("coordinator_address", "coordinator_bind_address", "node_ip", "ray_address"):
        assert f'"{key}"' not in r.text, key
    st = r.json()
    # what operators read stays: the gang, its hosts (rank, pid, node id, phase), the errors' words
    (gang,) = st["gang"]["gangs"]
    assert [h["node_id"] for h in gang["hosts"]] == ["node0", "node1"]
    assert [h["phase"] for h in gang["host_status"]] == ["serving", "serving"]
    assert st["last_error"] == f"host 1 did not join the coordinator at {MASK} within 60s (restarted)"
    assert gang["history"][0]["error"] == f"preflight failed on node {MASK}; peer {MASK} unreachable"
    assert st["config"]["cluster"]["coordinator_port"] is None and st["config"]["model"]["max_seq_len"] == 128


def test_the_mask_leaves_versions_ids_and_numbers_alone():
    kept = {"versions": "jax 0.10.2, ray 2.60.0", "id": "a1b2:c3", "n": 10, "f": 1.5, "node_id": "ab12cd",
            "ratio": "3.5:1", "list": ["ok", None, True]}
    assert without_addresses(kept) == kept
    masked = without_addresses({"e": "at 192.168.0.10, then 10.0.0.7:8476 and [::1]:80.", "node_ip": "1.2.3.4"})
    assert masked == {"e": f"at {MASK}, then {MASK} and {MASK}."}
    assert json.dumps(masked).count(MASK) == 3
