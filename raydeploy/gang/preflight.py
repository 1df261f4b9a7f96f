"""Preflight: check a host's accelerator environment before it joins jax.distributed.

A TPU slice or GPU node that is not set up for the gang fails late and vaguely otherwise: without the
KubeRay TPU webhook (or GKE's Ray add-on) the TPU_* variables are missing, Ray never advertises the slice
head resource and placement waits out its timeout; a GPU pod without the NVIDIA device plugin sees no GPU
and JAX falls back or hangs in initialize. The checks here read only the environment and device files, so
they finish in milliseconds and initialise no JAX backend: `jax.distributed.initialize` must come before
any backend starts, and a TPU backend cannot be opened twice in one process (nor while another process
holds the chips).

Two layers:
- :func:`check_host` runs in every host actor before `jax.distributed.initialize`: accelerator platform,
  device count, the TPU variables and the slice topology against the config, the compile cache dir.
- :func:`check_tpu_nodes` runs in the supervisor before placement on TPU: when the cluster has TPU nodes
  but none advertises a slice head resource, it probes the nodes' variables and names what is missing
  instead of letting placement wait out its timeout.

A failure raises :class:`PreflightError`, which the supervisor does not retry: the same hosts would fail
the same way. No JAX here.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping
from typing import Any

from raydeploy.config import Config

TPU_VARS = ("TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "TPU_NAME")
TPU_PREREQ = ("set on each TPU host by the KubeRay TPU webhook (ray-project/kuberay ray-tpu webhook) or "
              "GKE's Ray add-on (Ray Operator with TPU support); see docs/kuberay.md")
GPU_PREREQ = ("the NVIDIA GPU device plugin must expose the GPUs (nvidia.com/gpu in the pod's resources) "
              "and the image must carry jax[cuda12]; see docs/kuberay.md")
# Per generation: how the number at the end of TPU_ACCELERATOR_TYPE counts (TensorCores on v2-v4 and v5p,
# chips on v5e/v6e) and the cluster.accelerator_type names that fit it.
_TPU_GENERATIONS: dict[str, tuple[int, tuple[str, ...]]] = {
    "v2": (2, ("v2",)), "v3": (2, ("v3",)), "v4": (2, ("v4",)), "v5p": (2, ("v5p",)),
    "v5litepod": (1, ("v5e", "v5litepod")), "v5e": (1, ("v5e", "v5litepod")), "v6e": (1, ("v6e",)),
}


class PreflightError(RuntimeError):
    """A host (or the cluster) is not set up for the gang: names the variable or figure and the prerequisite.
    Not retriable: restarting the gang on the same hosts fails the same way."""

    retriable = False

    def __init__(self, message: str) -> None:
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray intact
        return (PreflightError, (str(self),))


def cache_dir_problem(cache_dir: str | None) -> str | None:
    """Why `engine.compilation_cache_dir` cannot be used from this machine, or None when it can (or is off).

    A local path must exist as a writable directory or be creatable (its nearest existing parent
    writable); nothing is created here. A URL (gs://...) is not checked: that needs the hosts' credentials.
    """
    if not cache_dir or "://" in cache_dir:
        return None
    path = os.path.abspath(os.path.expanduser(cache_dir))
    if os.path.exists(path):
        if not os.path.isdir(path):
            return f"engine.compilation_cache_dir {cache_dir!r} exists and is not a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return (f"engine.compilation_cache_dir {cache_dir!r} is read-only: JAX writes compiled programs "
                    f"there (mount it read-write, or point it at a writable shared path or a gs:// URL)")
        return None
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        return (f"engine.compilation_cache_dir {cache_dir!r} is missing and cannot be created: its nearest "
                f"existing parent {parent!r} is not a writable directory")
    return None


def jax_platform_of(env: Mapping[str, str]) -> str:
    """The platform JAX will use in a process with this environment (first of JAX_PLATFORMS)."""
    first = (env.get("JAX_PLATFORMS") or "").split(",")[0].strip().lower()
    return {"cuda": "gpu", "rocm": "gpu"}.get(first, first)


def virtual_cpu_devices(env: Mapping[str, str]) -> int:
    """CPU devices JAX will create from XLA_FLAGS (1 when the flag is absent)."""
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", env.get("XLA_FLAGS", ""))
    return int(m.group(1)) if m else 1


def tpu_chips_visible(env: Mapping[str, str], dev_root: str = "/dev") -> int:
    """TPU chips this process can open, from the device files (as Ray counts them), narrowed by
    TPU_VISIBLE_CHIPS when set; no TPU runtime is opened."""
    chips = len(glob.glob(os.path.join(dev_root, "accel[0-9]*")))
    if chips == 0:
        chips = len(glob.glob(os.path.join(dev_root, "vfio", "[0-9]*")))
    visible = env.get("TPU_VISIBLE_CHIPS")
    if visible and chips:
        return min(chips, len([c for c in visible.split(",") if c.strip()]))
    return chips


def gpus_visible(env: Mapping[str, str], dev_root: str = "/dev") -> int:
    """NVIDIA GPUs this process can use: /dev/nvidiaN files, narrowed by CUDA_VISIBLE_DEVICES when set."""
    present = len([p for p in glob.glob(os.path.join(dev_root, "nvidia[0-9]*"))
                   if re.fullmatch(r"nvidia\d+", os.path.basename(p))])
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and present:
        return min(present, len([g for g in visible.split(",") if g.strip()]))
    return present


def tpu_chips_of_type(accelerator_type: str) -> tuple[str, int] | None:
    """(generation, chips) of a TPU_ACCELERATOR_TYPE such as v5litepod-16 or v4-32; None when unknown."""
    m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", accelerator_type.strip().lower())
    if not m or m.group(1) not in _TPU_GENERATIONS:
        return None
    per_chip = _TPU_GENERATIONS[m.group(1)][0]
    return m.group(1), max(1, int(m.group(2)) // per_chip)


def check_host(cfg: Config, rank: int, env: Mapping[str, str] | None = None, dev_root: str = "/dev") -> dict[str, Any]:
    """Every check for host `rank` in this process's environment; returns what was found, raises
    :class:`PreflightError` naming the first problem set (all problems of this host, joined)."""
    env = os.environ if env is None else env
    c = cfg.cluster
    problems: list[str] = []
    info: dict[str, Any] = {"rank": rank, "pid": os.getpid()}
    platform = jax_platform_of(env)
    info["jax_platform"] = platform or "(unset)"
    expected = c.platform
    if platform != expected and not (c.platform == "tpu" and platform == "cpu" and "JAX_PLATFORMS" in c.env):
        problems.append(f"JAX_PLATFORMS is {env.get('JAX_PLATFORMS')!r} but cluster.platform is {expected!r}")
    if platform == "cpu":
        n = virtual_cpu_devices(env)
        info["devices"] = n
        if n != c.devices_per_host:
            problems.append(f"JAX will create {n} CPU device(s) (XLA_FLAGS --xla_force_host_platform_device_count) "
                            f"but cluster.devices_per_host is {c.devices_per_host}")
    elif platform == "tpu":
        n = tpu_chips_visible(env, dev_root)
        info["devices"] = n
        if n < c.devices_per_host:
            problems.append(f"{n} TPU chip(s) visible ({dev_root}/accel*, {dev_root}/vfio/*) but cluster.devices_per_host "
                            f"is {c.devices_per_host}: the pod must request google.com/tpu: {c.devices_per_host} on a "
                            f"TPU node pool")
    elif platform == "gpu":
        n = gpus_visible(env, dev_root)
        info["devices"] = n
        if n != c.devices_per_host:
            where = f" (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r})" if "CUDA_VISIBLE_DEVICES" in env else ""
            problems.append(f"{n} NVIDIA GPU(s) visible ({dev_root}/nvidia[0-9]*){where} but cluster.devices_per_host "
                            f"is {c.devices_per_host}: {GPU_PREREQ}")
    if c.platform == "tpu" and not c.simulated:
        problems += _tpu_problems(cfg, rank, env, info)
    if (p := cache_dir_problem(cfg.engine.compilation_cache_dir)) is not None:
        problems.append(p)
    if problems:
        raise PreflightError(f"preflight failed on host {rank} (pid {os.getpid()}): " + "; ".join(problems))
    return info


def _tpu_problems(cfg: Config, rank: int, env: Mapping[str, str], info: dict[str, Any]) -> list[str]:
    c = cfg.cluster
    missing = [v for v in TPU_VARS if not env.get(v)]
    if missing:
        return [f"TPU variable(s) {', '.join(missing)} not set: they are {TPU_PREREQ}"]
    problems: list[str] = []
    info.update({v: env[v] for v in TPU_VARS})
    hosts = [h for h in env["TPU_WORKER_HOSTNAMES"].split(",") if h.strip()]
    if len(hosts) != c.num_hosts:
        problems.append(f"TPU_WORKER_HOSTNAMES lists {len(hosts)} host(s) but cluster.num_hosts is {c.num_hosts}")
    try:
        worker_id = int(env["TPU_WORKER_ID"])
    except ValueError:
        return problems + [f"TPU_WORKER_ID is {env['TPU_WORKER_ID']!r}, not an integer"]
    if worker_id != rank:
        problems.append(f"TPU_WORKER_ID is {worker_id} but this host was placed as rank {rank} (ranks follow "
                        f"TPU_WORKER_ID)")
    total = c.num_hosts * c.devices_per_host
    acc = env.get("TPU_ACCELERATOR_TYPE")
    if acc:
        info["TPU_ACCELERATOR_TYPE"] = acc
        parsed = tpu_chips_of_type(acc)
        if parsed is None:
            problems.append(f"TPU_ACCELERATOR_TYPE {acc!r} is not a known TPU type")
        else:
            gen, chips = parsed
            if chips != total:
                problems.append(f"TPU_ACCELERATOR_TYPE {acc} has {chips} chip(s) but cluster.num_hosts x "
                                f"devices_per_host is {c.num_hosts} x {c.devices_per_host} = {total}")
            names = _TPU_GENERATIONS[gen][1]
            if c.accelerator_type and c.accelerator_type.lower() not in names:
                problems.append(f"TPU_ACCELERATOR_TYPE {acc} is a {gen} slice but cluster.accelerator_type is "
                                f"{c.accelerator_type!r}")
        head = f"TPU-{acc}-head"
        if c.tpu_slice_head_resource and c.tpu_slice_head_resource != head:
            problems.append(f"this slice's head resource is {head} (from TPU_ACCELERATOR_TYPE) but "
                            f"cluster.tpu_slice_head_resource is {c.tpu_slice_head_resource}")
    topo = env.get("TPU_TOPOLOGY")
    if topo:
        info["TPU_TOPOLOGY"] = topo
        dims = [int(d) for d in re.findall(r"\d+", topo)]
        chips = 1
        for d in dims:
            chips *= d
        if not dims or chips != total:
            problems.append(f"TPU_TOPOLOGY {topo} has {chips if dims else '?'} chip(s) but cluster.num_hosts x "
                            f"devices_per_host is {total}")
    return problems


def tpu_node_env(names: tuple[str, ...] = (*TPU_VARS, "TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY")) -> dict[str, Any]:
    """The TPU variables of the process this runs in (a Ray worker inherits its node's), with its node id."""
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            **{n: os.environ.get(n) for n in names}}


async def check_tpu_nodes(cfg: Config, timeout_s: float) -> None:
    """Before placement on a TPU cluster: if TPU nodes exist but none advertises a slice head resource
    (`TPU-<type>-head`, which Ray adds only when the TPU variables are set), probe every TPU node's
    variables (a zero-CPU task pinned to each node, bounded by `timeout_s`) and raise
    :class:`PreflightError` naming each node and what it lacks. No TPU nodes at all is left to placement
    (an autoscaler may add them)."""
    import asyncio

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    c = cfg.cluster
    if c.platform != "tpu" or c.simulated:
        return
    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("TPU", 0) > 0]
    heads = sorted({r for n in nodes for r in n.get("Resources", {}) if r.startswith("TPU-") and r.endswith("-head")})
    if not nodes or heads:
        return
    probe = ray.remote(num_cpus=0, max_retries=0)(tpu_node_env)
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
            for n in nodes]
    try:
        found = await asyncio.wait_for(asyncio.gather(*[_await(r) for r in refs]), timeout_s)
    except TimeoutError:
        found = []
    lines = []
    for n, f in zip(nodes, found or [{}] * len(nodes), strict=True):
        missing = [v for v in TPU_VARS if not f.get(v)] if f else [f"(no answer within {timeout_s:g}s)"]
        lines.append(f"node {n.get('NodeManagerAddress')} lacks {', '.join(missing) or 'nothing'}")
    raise PreflightError(
        f"{len(nodes)} node(s) have TPU chips but none advertises a slice head resource (cluster."
        f"tpu_slice_head_resource={c.tpu_slice_head_resource}), so no slice can be reserved: "
        f"{'; '.join(lines)}. The TPU variables {', '.join(TPU_VARS)} are {TPU_PREREQ}")


async def _await(ref: Any) -> Any:
    return await ref
