"""A multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`), for tests of placement and
preflight on nodes that advertise TPU resources and variables they do not have."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def fake_nodes_cluster(tag: str, namespace: str, add_nodes: Callable[[Any], Any]) -> Iterator[Any]:
    """A CPU-only head node (1 CPU, no dashboard) plus the nodes `add_nodes(cluster)` adds, with this process
    connected in `namespace`; Ray's files under /tmp/<tag>-<pid>. Yields what `add_nodes` returned, and tears
    everything down (RAY_TMPDIR restored) however the block ends."""
    import ray
    from ray.cluster_utils import Cluster

    tmp = f"/tmp/{tag}-{os.getpid()}"
    os.makedirs(f"{tmp}/ray", exist_ok=True)
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        added = add_nodes(cluster)
        ray.init(address=cluster.address, namespace=namespace, log_to_driver=False)
        yield added
    finally:
        ray.shutdown()
        cluster.shutdown()
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved
