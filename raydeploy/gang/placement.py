"""Placement: reserve one Ray bundle per host before any host actor starts.

A gang is all-or-nothing: either every host gets its bundle or none does, so the gang never half-starts
on a cluster that is too small. Each bundle asks for `{"CPU": host_num_cpus, **host_resources}`; rank 0's
bundle also claims `tpu_slice_head_resource` when set, so a whole TPU slice is taken atomically. Real
clusters use the configured strategy (STRICT_SPREAD puts each host on its own node); simulated hosts on one
node use PACK. Waiting is bounded by `cluster.placement_timeout_s`; on timeout the group is removed and
:class:`PlacementError` says what was asked and what the cluster has. No JAX here (the driver imports it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from raydeploy.config import ClusterConfig


class PlacementError(RuntimeError):
    """The cluster cannot hold the gang: names the bundles asked for and the resources the cluster has."""

    def __init__(self, message: str) -> None:
        super().__init__(message)

    def __reduce__(self):  # crosses Ray intact
        return (PlacementError, (str(self),))


def host_bundles(cluster: ClusterConfig) -> list[dict[str, float]]:
    """One resource bundle per host, rank 0 first."""
    bundles: list[dict[str, float]] = []
    for rank in range(cluster.num_hosts):
        b: dict[str, float] = {}
        if cluster.host_num_cpus > 0:
            b["CPU"] = float(cluster.host_num_cpus)
        b.update({k: float(v) for k, v in cluster.host_resources.items()})
        if rank == 0 and cluster.tpu_slice_head_resource:
            b[cluster.tpu_slice_head_resource] = 1.0
        bundles.append(b)
    return bundles


def placement_strategy(cluster: ClusterConfig) -> str:
    """The Ray strategy actually used: simulated hosts share one node, so spread strategies become PACK."""
    if cluster.simulated and cluster.placement_strategy in ("STRICT_SPREAD", "SPREAD"):
        return "PACK"
    return cluster.placement_strategy


@dataclass
class HostGroup:
    """A ready placement group with one bundle per host; `bundle_index == rank`."""

    pg: Any
    bundles: list[dict[str, float]]
    strategy: str
    wait_s: float

    def scheduling_strategy(self, rank: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=rank,
                                                placement_group_capture_child_tasks=False)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def describe_cluster() -> str:
    """What the cluster has: node count, total and available resources (for error messages)."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    total = _fmt(ray.cluster_resources())
    avail = _fmt(ray.available_resources())
    per_node = "; ".join(f"{n.get('NodeManagerAddress')}: {_fmt(n.get('Resources', {}))}" for n in nodes)
    return f"{len(nodes)} alive node(s); total {total}; available {avail}; per node: {per_node}"


def _fmt(res: dict[str, float]) -> str:
    keep = {k: v for k, v in res.items() if not k.startswith("node:") and k not in ("memory", "object_store_memory")
            and not k.startswith("bundle_group")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(keep.items())) + "}"


def reserve_hosts(cluster: ClusterConfig, name: str = "raydeploy-gang") -> HostGroup:
    """Ask Ray for the gang's bundles and return at once with the (possibly still pending) group.

    Split from the wait so that whoever waits owns the group from the first moment: a caller cancelled
    while the group is pending (a shutdown during placement) can still remove it, instead of a reservation
    that nobody holds keeping the cluster's TPUs or GPUs."""
    from ray.util.placement_group import placement_group

    bundles = host_bundles(cluster)
    strategy = placement_strategy(cluster)
    pg = placement_group(bundles, strategy=strategy, name=name)
    return HostGroup(pg=pg, bundles=bundles, strategy=strategy, wait_s=0.0)


def _placement_error(cluster: ClusterConfig, group: HostGroup) -> PlacementError:
    return PlacementError(
        f"cannot place {cluster.num_hosts} host(s) within cluster.placement_timeout_s="
        f"{cluster.placement_timeout_s:g}s: asked for bundles {group.bundles} with strategy {group.strategy}; "
        f"the cluster has {describe_cluster()}")


async def wait_placed(group: HostGroup, cluster: ClusterConfig) -> None:
    """Wait (bounded by `placement_timeout_s`) until every bundle is reserved; on timeout remove the group
    and raise :class:`PlacementError`. Cancelling the wait leaves the group to the caller to remove."""
    import asyncio

    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(_ready(group.pg), cluster.placement_timeout_s)
    except TimeoutError:
        err = _placement_error(cluster, group)
        group.remove()
        raise err from None
    group.wait_s = time.perf_counter() - t0


async def _ready(pg: Any) -> Any:
    return await pg.ready()


def place_hosts(cluster: ClusterConfig, name: str = "raydeploy-gang") -> HostGroup:
    """`reserve_hosts` + `wait_placed` for callers without an event loop (blocking)."""
    import asyncio

    group = reserve_hosts(cluster, name)
    asyncio.run(wait_placed(group, cluster))
    return group
