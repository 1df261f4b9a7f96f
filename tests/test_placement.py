"""Placement on a fake multi-node Ray cluster (ray.cluster_utils.Cluster) holding TWO TPU slices.

Each fake TPU host is its own raylet that advertises what Ray advertises on a real TPU host: `TPU`, a
resource named after its slice (the TPU_NAME, 1 per host) and, on worker 0 only, the head resource
`TPU-v5litepod-2-head`. Each raylet is started with the TPU variables in its environment (`env_vars`), so
the processes Ray starts there (probes, host actors) see them as a KubeRay TPU webhook would set them in a
pod. Worker ids are given in reverse of node creation order so that the bundle order Ray picks and the
rank order (TPU_WORKER_ID) cannot agree by accident. JAX runs on one virtual CPU device per host
(`cluster.env: {JAX_PLATFORMS: cpu}`) with the toy engine: the point is placement, preflight and restart.

- A gang lands all its hosts on one slice, with rank = TPU_WORKER_ID; a second gang takes the other slice.
- A host killed in a gang: the restart waits until the old process on EVERY node has exited (checked on
  each node) before any new host process starts, and the gang comes back on its slice.
- A gang whose config contradicts the slice (accelerator type) fails preflight, with the message and
  without restarts.
- A gang larger than a slice fails placement within its timeout, naming what was asked and what exists;
  a shutdown while placement is pending removes both reservations.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from raydeploy.config import config_from_dict
from raydeploy.gang.placement import (
    PlacementError,
    head_bundle,
    host_bundles,
    place_hosts,
    placement_strategy,
)

pytestmark = pytest.mark.ray

HEAD = "TPU-v5litepod-2-head"
SLICES = ("slice-a", "slice-b")


def _cfg(num_hosts: int = 2, accelerator_type: str = "v5e", **cluster):
    return config_from_dict({
        "cluster": {"num_hosts": num_hosts, "devices_per_host": 1, "platform": "tpu", "simulated": False,
                    "accelerator_type": accelerator_type, "host_resources": {"TPU": 1}, "host_num_cpus": 0.25,
                    "tpu_slice_head_resource": HEAD, "placement_strategy": "STRICT_SPREAD",
                    "placement_timeout_s": 60, "coordinator_bind_address": "127.0.0.1", "coordinator_port": 0,
                    "init_timeout_s": 30, "heartbeat_timeout_s": 5, "restart_backoff_s": 0.2, "max_restarts": 2,
                    # the fake nodes inherit this test process's XLA_FLAGS (4 devices): one per host here
                    "env": {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"},
                    **cluster},
        "mesh": {"axes": {"dp": 1, "fsdp": -1}},
        "engine": {"max_slots": 2, "compilation_cache_dir": None},
    }, source="test")


def tpu_env(slice_name: str, worker_id: int, num_hosts: int = 2) -> dict[str, str]:
    """The variables the KubeRay TPU webhook sets in a v5litepod-2 pod (two 1-chip hosts, fake)."""
    return {"TPU_NAME": slice_name, "TPU_WORKER_ID": str(worker_id),
            "TPU_WORKER_HOSTNAMES": ",".join(f"{slice_name}-w{i}" for i in range(num_hosts)),
            "TPU_ACCELERATOR_TYPE": "v5litepod-2", "TPU_TOPOLOGY": "1x2"}


@pytest.fixture(scope="module")
def fake_cluster():
    """{node_id: (slice, worker id)} of the fake TPU hosts; a CPU-only head node holds the drivers' actors."""
    from ray_cluster import fake_nodes_cluster

    def add(cluster) -> dict[str, tuple[str, int]]:
        hosts: dict[str, tuple[str, int]] = {}
        for slice_name in SLICES:
            for worker_id in (1, 0):
                res = {"TPU": 1, slice_name: 1, **({HEAD: 1} if worker_id == 0 else {})}
                node = cluster.add_node(num_cpus=1, resources=res, env_vars=tpu_env(slice_name, worker_id))
                hosts[node.node_id] = (slice_name, worker_id)
        return hosts

    with fake_nodes_cluster("rdp", "raydeploy-placement", add) as hosts:
        yield hosts


def test_bundles_and_strategy_are_derived_from_config():
    cfg = _cfg(2)
    assert host_bundles(cfg.cluster) == [{"CPU": 0.25, "TPU": 1.0}] * 2
    assert host_bundles(cfg.cluster, "slice-a") == [{"CPU": 0.25, "TPU": 1.0, "slice-a": 1.0}] * 2
    assert head_bundle(cfg.cluster) == {HEAD: 1.0}
    assert placement_strategy(cfg.cluster) == "STRICT_SPREAD"
    sim = config_from_dict({"cluster": {"num_hosts": 2, "simulated": True}, "mesh": {"axes": {"dp": 2, "tp": 2}}})
    assert placement_strategy(sim.cluster) == "PACK" and head_bundle(sim.cluster) is None


def _ready_gang(cfg, name: str):
    from raydeploy.gang.gang import start_gang

    gang = start_gang(cfg, engine="toy", name=name)
    gang.wait_ready(300)
    return gang


def _hosts_on_slice(gang, fake_cluster) -> tuple[str, dict]:
    """(slice, state) after checking that every rank runs on that slice's host with TPU_WORKER_ID == rank."""
    st = gang.state()
    rows = st["hosts"]
    where = [fake_cluster[r["node_id"]] for r in rows]
    slices = {s for s, _ in where}
    assert len(slices) == 1, f"hosts on several slices: {where}"
    assert [w for _, w in where] == [r["rank"] for r in rows] == [0, 1], where
    assert [r["tpu_worker_id"] for r in rows] == [0, 1]
    assert st["placement"]["slice"] == slices.pop()
    return st["placement"]["slice"], st


def test_two_gangs_one_slice_each_ranked_by_worker_id_and_restart_waits_on_every_node(fake_cluster):
    from raydeploy.engine.request import GenerationRequest
    from raydeploy.testing.toy import toy_expected_tokens

    cfg = _cfg(2)
    a = _ready_gang(cfg, "gang-a")
    b = None
    try:
        slice_a, st_a = _hosts_on_slice(a, fake_cluster)
        b = _ready_gang(cfg, "gang-b")
        slice_b, _ = _hosts_on_slice(b, fake_cluster)
        assert {slice_a, slice_b} == set(SLICES)
        for g in (a, b):
            out = g.generate(GenerationRequest("r", (5, 9), max_tokens=4, ignore_eos=True), timeout_s=60)
            assert [e.token_id for e in out] == toy_expected_tokens((5, 9), 4)

        # kill rank 1 of gang A: the restart must see every old process gone, each on its own node, before
        # any new host process starts; the new gang can only go back to slice A (B is held by gang B)
        old = st_a["hosts"]
        os.kill(old[1]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while a.state()["restarts"] < 1:
            assert time.monotonic() < deadline, a.state()
            time.sleep(0.2)
        a.wait_ready(300)
        slice_again, st = _hosts_on_slice(a, fake_cluster)
        assert slice_again == slice_a
        exits = st["history"][-1]["exits"]
        assert [e["rank"] for e in exits] == [0, 1]
        assert all(e["gone"] is True and e["checked"] == "node" for e in exits), exits
        assert [e["seen_on"] for e in exits] == [r["node_id"] for r in old]  # checked on each old host's node
        assert len({e["seen_on"] for e in exits}) == 2
        first_new = min(r["started_at"] for r in st["hosts"])
        assert max(e["at"] for e in exits) <= first_new, (exits, st["hosts"])
        assert {r["pid"] for r in st["hosts"]}.isdisjoint({r["pid"] for r in old})
    finally:
        a.shutdown()
        if b is not None:
            b.shutdown()


def test_config_that_contradicts_the_slice_fails_preflight_without_restart(fake_cluster):
    from raydeploy.gang.bringup import GangError
    from raydeploy.gang.gang import start_gang

    gang = start_gang(_cfg(2, accelerator_type="v6e"), engine="toy", name="gang-v6e")
    try:
        with pytest.raises(GangError) as info:
            gang.wait_ready(120)
        st = gang.state()
    finally:
        gang.shutdown()
    msg = str(info.value)
    assert st["state"] == "failed" and st["restarts"] == 0, st
    assert "bring-up phase 'preflight' failed" in msg and "(not retriable)" in msg
    assert ("TPU_ACCELERATOR_TYPE v5litepod-2 is a v5litepod slice but cluster.accelerator_type is 'v6e'"
            in msg), msg


def test_gang_larger_than_a_slice_names_what_was_asked_and_what_exists(fake_cluster):
    cfg = _cfg(3, placement_timeout_s=3)
    with pytest.raises(PlacementError) as info:
        place_hosts(cfg.cluster)
    msg = str(info.value)
    assert "cannot place 3 host(s)" in msg and "placement_timeout_s=3" in msg
    assert "STRICT_SPREAD" in msg and "'TPU': 1.0" in msg and "'slice-" in msg
    assert "5 alive node(s)" in msg and "TPU: 4" in msg

    from ray.util.placement_group import placement_group_table

    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())


def _gang_groups() -> list[dict]:
    from ray.util.placement_group import placement_group_table

    return [pg for pg in placement_group_table().values() if "-gang-" in pg["name"]]


def test_shutdown_during_placement_removes_the_pending_group(fake_cluster):
    """A gang still waiting for its bundles (3 hosts on a 2-host slice, a long placement timeout) is shut
    down: neither the slice's head reservation nor the pending host bundles may outlive it, or they would
    hold the cluster's accelerators with nobody using them."""
    from raydeploy.gang.gang import start_gang

    gang = start_gang(_cfg(3, placement_timeout_s=120), engine="toy", name="gang-pending")
    deadline = time.monotonic() + 30
    while not any(pg["state"] == "PENDING" for pg in _gang_groups()):
        assert time.monotonic() < deadline, f"no pending gang placement group: {_gang_groups()}"
        time.sleep(0.1)
    assert gang.state(10)["state"] == "starting"
    gang.shutdown(30)
    groups = [g for g in _gang_groups() if g["name"].startswith("gang-pending")]
    assert len(groups) == 2 and all(pg["state"] == "REMOVED" for pg in groups), groups
