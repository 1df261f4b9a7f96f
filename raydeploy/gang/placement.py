"""Placement: reserve one Ray bundle per host before any host actor starts.

A gang is all-or-nothing: either every host gets its bundle or none does, so the gang never half-starts
on a cluster that is too small. Each bundle asks for `{"CPU": host_num_cpus, **host_resources}` (on GPU
clusters `{GPU: 8}` makes it one bundle per node with its GPUs). Real clusters use the configured strategy
(STRICT_SPREAD puts each host on its own node); simulated hosts on one node use PACK.

A multi-host TPU gang (`cluster.tpu_slice_head_resource` set) takes one whole slice, the way Ray Train
reserves a slice: Ray advertises on every host of a slice a resource named after the slice (its TPU_NAME,
1 per host) and on the slice's worker 0 the head resource `TPU-<type>-head`. First a one-bundle group
claims the head resource; a zero-CPU probe in that bundle reads the slice's name; then every host bundle
also asks for that slice-name resource, so all bundles land on the same slice. The head group is held for
the gang's lifetime (a second gang cannot claim the same slice). Ranks follow TPU_WORKER_ID: a probe in
each bundle reads its host's worker id and `rank_bundle[rank]` is the bundle on worker `rank`.

Waiting is bounded by `cluster.placement_timeout_s`; on timeout the groups are removed and
:class:`PlacementError` says what was asked and what the cluster has. No JAX here (the driver imports it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from raydeploy.config import ClusterConfig
from raydeploy.gang.preflight import PreflightError


class PlacementError(RuntimeError):
    """The cluster cannot hold the gang: names the bundles asked for and the resources the cluster has."""

    def __init__(self, message: str) -> None:
        super().__init__(message)

    def __reduce__(self):  # crosses Ray intact
        return (PlacementError, (str(self),))


def pins_tpu_slice(cluster: ClusterConfig) -> bool:
    """Whether the gang reserves one whole TPU slice (head resource first, then the slice's hosts)."""
    return cluster.platform == "tpu" and not cluster.simulated and bool(cluster.tpu_slice_head_resource)


def host_bundles(cluster: ClusterConfig, slice_name: str | None = None) -> list[dict[str, float]]:
    """One resource bundle per host; with `slice_name` every bundle also asks for that slice's resource."""
    bundles: list[dict[str, float]] = []
    for _ in range(cluster.num_hosts):
        b: dict[str, float] = {}
        if cluster.host_num_cpus > 0:
            b["CPU"] = float(cluster.host_num_cpus)
        b.update({k: float(v) for k, v in cluster.host_resources.items()})
        if slice_name:
            b[slice_name] = 1.0
        bundles.append(b)
    return bundles


def head_bundle(cluster: ClusterConfig) -> dict[str, float] | None:
    """The bundle that reserves a TPU slice through its head resource (None when the gang pins no slice)."""
    return {str(cluster.tpu_slice_head_resource): 1.0} if pins_tpu_slice(cluster) else None


def placement_strategy(cluster: ClusterConfig) -> str:
    """The Ray strategy actually used: simulated hosts share one node, so spread strategies become PACK."""
    if cluster.simulated and cluster.placement_strategy in ("STRICT_SPREAD", "SPREAD"):
        return "PACK"
    return cluster.placement_strategy


@dataclass
class HostGroup:
    """A placement group with one bundle per host; host `rank` runs in bundle `rank_bundle[rank]`.

    On a pinned TPU slice `head_pg` holds the slice's head resource, `slice_name` is the slice and
    `worker_ids[i]` the TPU_WORKER_ID of bundle i's host; elsewhere `rank_bundle` is the identity."""

    pg: Any
    bundles: list[dict[str, float]]
    strategy: str
    wait_s: float
    name: str = "raydeploy-gang"
    head_pg: Any = None
    slice_name: str | None = None
    worker_ids: list[int] = field(default_factory=list)
    rank_bundle: list[int] = field(default_factory=list)
    owned: bool = True
    """False for a group someone else reserved (Serve, for the replica that owns this gang): never removed here."""

    def bundle_index(self, rank: int) -> int:
        return self.rank_bundle[rank] if self.rank_bundle else rank

    def bundle(self, rank: int) -> dict[str, float]:
        """The resources of host `rank`'s bundle."""
        return self.bundles[self.bundle_index(rank)]

    def scheduling_strategy(self, rank: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                placement_group_bundle_index=self.bundle_index(rank),
                                                placement_group_capture_child_tasks=False)

    def describe(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "bundles": self.bundles, "slice": self.slice_name,
                "worker_ids": list(self.worker_ids), "rank_bundle": list(self.rank_bundle),
                "wait_s": round(self.wait_s, 3)}

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        if not self.owned:
            return  # its owner (Serve) removes it with the replica
        for attr in ("pg", "head_pg"):
            if getattr(self, attr) is not None:
                remove_placement_group(getattr(self, attr))
                setattr(self, attr, None)


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
    """Ask Ray for the gang's first reservation and return at once with the (possibly still pending) group:
    the host bundles, or on a pinned TPU slice the head bundle (the host bundles follow in `wait_placed`,
    once the slice is known).

    Split from the wait so that whoever waits owns the group from the first moment: a caller cancelled
    while the group is pending (a shutdown during placement) can still remove it, instead of a reservation
    that nobody holds keeping the cluster's TPUs or GPUs."""
    from ray.util.placement_group import placement_group

    strategy = placement_strategy(cluster)
    head = head_bundle(cluster)
    if head is not None:
        head_pg = placement_group([head], strategy="PACK", name=f"{name}-slice-head")
        return HostGroup(pg=None, bundles=host_bundles(cluster), strategy=strategy, wait_s=0.0, name=name,
                         head_pg=head_pg)
    bundles = host_bundles(cluster)
    pg = placement_group(bundles, strategy=strategy, name=name)
    return HostGroup(pg=pg, bundles=bundles, strategy=strategy, wait_s=0.0, name=name)


def external_group(cluster: ClusterConfig, pg: Any, name: str) -> HostGroup:
    """The gang's hosts in a placement group reserved elsewhere (by Serve for the replica that owns the gang),
    host `rank` in bundle `rank`; the group is already placed and is not removed with the gang."""
    return HostGroup(pg=pg, bundles=host_bundles(cluster), strategy=placement_strategy(cluster), wait_s=0.0,
                     name=name, owned=False)


def _placement_error(cluster: ClusterConfig, group: HostGroup, what: str) -> PlacementError:
    asked = f"the slice head {head_bundle(cluster)}" if what == "head" else f"bundles {group.bundles}"
    return PlacementError(
        f"cannot place {cluster.num_hosts} host(s) within cluster.placement_timeout_s="
        f"{cluster.placement_timeout_s:g}s: asked for {asked} with strategy {group.strategy}; "
        f"the cluster has {describe_cluster()}")


async def wait_placed(group: HostGroup, cluster: ClusterConfig) -> None:
    """Wait (bounded by `placement_timeout_s` in all) until every bundle is reserved; on timeout remove
    the groups and raise :class:`PlacementError`. On a pinned TPU slice this also reads the slice name,
    places the host bundles on it and orders ranks by TPU_WORKER_ID (:class:`PreflightError` when a host
    lacks the variable). Cancelling the wait leaves the groups to the caller to remove."""
    import asyncio

    t0 = time.perf_counter()
    deadline = time.monotonic() + cluster.placement_timeout_s
    what = "head" if group.head_pg is not None else "hosts"
    try:
        if group.head_pg is not None:
            await asyncio.wait_for(_ready(group.head_pg), _left(deadline))
            probe = await asyncio.wait_for(_probe(group.head_pg, 0), _left(deadline))
            group.slice_name = probe.get("TPU_NAME")
            if not group.slice_name:
                raise PreflightError(
                    f"the node holding {cluster.tpu_slice_head_resource} ({probe.get('node_ip')}) has no TPU_NAME "
                    f"variable, so its slice cannot be told apart: TPU_NAME is set by the KubeRay TPU webhook "
                    f"or GKE's Ray add-on")
            await _place_on_slice(group, cluster, deadline)
        else:
            await asyncio.wait_for(_ready(group.pg), _left(deadline))
    except TimeoutError:
        err = _placement_error(cluster, group, what if group.pg is None else "hosts")
        group.remove()
        raise err from None
    except PreflightError:
        group.remove()
        raise
    group.wait_s = time.perf_counter() - t0


async def _place_on_slice(group: HostGroup, cluster: ClusterConfig, deadline: float) -> None:
    import asyncio

    from ray.util.placement_group import placement_group

    assert group.slice_name is not None
    group.bundles = host_bundles(cluster, group.slice_name)
    group.pg = placement_group(group.bundles, strategy=group.strategy, name=group.name)
    await asyncio.wait_for(_ready(group.pg), _left(deadline))
    probes = await asyncio.wait_for(asyncio.gather(*[_probe(group.pg, i) for i in range(len(group.bundles))]),
                                    _left(deadline))
    ids: list[int] = []
    for i, p in enumerate(probes):
        raw = p.get("TPU_WORKER_ID")
        if raw is None or not str(raw).strip().isdigit():
            raise PreflightError(f"host bundle {i} on node {p.get('node_ip')} of slice {group.slice_name} has "
                                 f"TPU_WORKER_ID={raw!r}, so ranks cannot follow the slice's worker order: "
                                 f"TPU_WORKER_ID is set by the KubeRay TPU webhook or GKE's Ray add-on")
        ids.append(int(raw))
    if sorted(ids) != list(range(cluster.num_hosts)):
        raise PreflightError(f"the hosts placed on slice {group.slice_name} have TPU_WORKER_ID {sorted(ids)}, "
                             f"expected 0..{cluster.num_hosts - 1} (cluster.num_hosts={cluster.num_hosts} must be "
                             f"the slice's host count)")
    group.worker_ids = ids
    group.rank_bundle = [ids.index(rank) for rank in range(cluster.num_hosts)]


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


async def _probe(pg: Any, bundle_index: int) -> dict[str, Any]:
    """The TPU variables (and node) of the host holding bundle `bundle_index` (a zero-CPU task there)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from raydeploy.gang.preflight import tpu_node_env

    task = ray.remote(num_cpus=0, max_retries=0)(tpu_node_env)
    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle_index,
                                                placement_group_capture_child_tasks=False)
    return await task.options(scheduling_strategy=strategy).remote()


async def _ready(pg: Any) -> Any:
    return await pg.ready()


def place_hosts(cluster: ClusterConfig, name: str = "raydeploy-gang") -> HostGroup:
    """`reserve_hosts` + `wait_placed` for callers without an event loop (blocking)."""
    import asyncio

    group = reserve_hosts(cluster, name)
    asyncio.run(wait_placed(group, cluster))
    return group
