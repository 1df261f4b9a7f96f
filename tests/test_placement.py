"""Placement on a fake multi-node Ray cluster (ray.cluster_utils.Cluster): 4 nodes, each with TPU: 4 and
one with a slice-head resource. One host actor lands on each node, rank 0 on the head's node; a request
the cluster cannot hold fails within placement_timeout_s with a message naming bundles and resources.
"""

from __future__ import annotations

import os

import pytest

from raydeploy.config import config_from_dict
from raydeploy.gang.placement import PlacementError, host_bundles, place_hosts, placement_strategy

pytestmark = pytest.mark.ray

HEAD = "TPU-v5litepod-16-head"


def _cfg(num_hosts: int, **cluster):
    return config_from_dict({
        "cluster": {"num_hosts": num_hosts, "devices_per_host": 4, "platform": "tpu", "simulated": False,
                    "host_resources": {"TPU": 4}, "host_num_cpus": 0.5, "tpu_slice_head_resource": HEAD,
                    "placement_strategy": "STRICT_SPREAD", "placement_timeout_s": 3, **cluster},
        "mesh": {"axes": {"dp": 1, "fsdp": -1}},
    }, source="test")


@pytest.fixture(scope="module")
def fake_cluster():
    import ray
    from ray.cluster_utils import Cluster

    # the fake cluster's nodes keep their files (and the cluster address file) under RAY_TMPDIR
    tmp = f"/tmp/rdp-{os.getpid()}"
    os.makedirs(f"{tmp}/ray", exist_ok=True)
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"TPU": 4, HEAD: 1}, "include_dashboard": False})
    try:
        for _ in range(3):
            cluster.add_node(num_cpus=1, resources={"TPU": 4})
        ray.init(address=cluster.address, namespace="raydeploy-placement", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved


def test_bundles_and_strategy_are_derived_from_config():
    cfg = _cfg(4)
    assert host_bundles(cfg.cluster) == [{"CPU": 0.5, "TPU": 4.0, HEAD: 1.0}] + [{"CPU": 0.5, "TPU": 4.0}] * 3
    assert placement_strategy(cfg.cluster) == "STRICT_SPREAD"
    sim = config_from_dict({"cluster": {"num_hosts": 2, "simulated": True}, "mesh": {"axes": {"dp": 2, "tp": 2}}})
    assert placement_strategy(sim.cluster) == "PACK"


def test_one_host_actor_per_node_rank0_on_slice_head(fake_cluster):
    import ray

    from raydeploy.gang.host import HostActor, actor_options

    cfg = _cfg(4)
    group = place_hosts(cfg.cluster)
    try:
        actors = []
        for rank in range(4):
            opts = actor_options(cfg, rank, group.bundles[rank], group.scheduling_strategy(rank), 1)
            opts.pop("name")
            actors.append(ray.remote(HostActor).options(**opts).remote(cfg, rank, 1, None))
        nodes = ray.get([a.node_id.remote() for a in actors], timeout=60)
        assert len(set(nodes)) == 4, nodes
        head_node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and HEAD in n["Resources"])
        assert nodes[0] == head_node
        for a in actors:
            ray.kill(a)
    finally:
        group.remove()


def test_unsatisfiable_placement_names_what_was_asked_and_what_exists(fake_cluster):
    cfg = _cfg(5, placement_timeout_s=2)
    with pytest.raises(PlacementError) as info:
        place_hosts(cfg.cluster)
    msg = str(info.value)
    assert "cannot place 5 host(s)" in msg and "placement_timeout_s=2" in msg
    assert "STRICT_SPREAD" in msg and "'TPU': 4.0" in msg
    assert "4 alive node(s)" in msg and "TPU: 16" in msg

    from ray.util.placement_group import placement_group_table

    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())


def _gang_groups() -> list[dict]:
    from ray.util.placement_group import placement_group_table

    return [pg for pg in placement_group_table().values() if pg["name"].startswith("raydeploy-gang-")]


def test_shutdown_during_placement_removes_the_pending_group(fake_cluster):
    """A gang still waiting for its bundles (5 hosts on 4 nodes, a long placement timeout) is shut down: the
    pending reservation must not outlive it, or it would hold the cluster's accelerators with nobody using
    them."""
    import time

    from raydeploy.gang.gang import start_gang

    cfg = _cfg(5, placement_timeout_s=120)
    gang = start_gang(cfg, engine="toy")
    deadline = time.monotonic() + 30
    while not any(pg["state"] == "PENDING" for pg in _gang_groups()):
        assert time.monotonic() < deadline, f"no pending gang placement group: {_gang_groups()}"
        time.sleep(0.1)
    assert gang.state(10)["state"] == "starting"
    gang.shutdown(30)
    groups = _gang_groups()
    assert groups and all(pg["state"] == "REMOVED" for pg in groups), groups
