"""Preflight: each check's message names the variable or figure and the prerequisite, from environments
and device folders built here; the compile cache dir check; and, on a real local Ray cluster whose TPU
nodes lack the TPU variables (no KubeRay TPU webhook), a gang that fails in seconds with the message and
without restarts instead of waiting out its placement timeout.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from raydeploy.config import config_from_dict
from raydeploy.gang.preflight import (
    PreflightError,
    cache_dir_problem,
    check_host,
    gpus_visible,
    tpu_chips_of_type,
    tpu_chips_visible,
)

HEAD = "TPU-v5litepod-16-head"


def _tpu_cfg(mesh: dict[str, int] | None = None, **cluster):
    return config_from_dict({
        "cluster": {"num_hosts": 4, "devices_per_host": 4, "platform": "tpu", "simulated": False,
                    "accelerator_type": "v5e", "host_resources": {"TPU": 4}, "tpu_slice_head_resource": HEAD,
                    **cluster},
        "mesh": {"axes": mesh or {"dp": 4, "tp": 4}},
        "engine": {"compilation_cache_dir": None},
    }, source="test")


def _tpu_env(worker_id: int = 1, **extra: str) -> dict[str, str]:
    return {"JAX_PLATFORMS": "tpu", "TPU_WORKER_ID": str(worker_id), "TPU_NAME": "my-slice",
            "TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3", "TPU_ACCELERATOR_TYPE": "v5litepod-16", "TPU_TOPOLOGY": "4x4",
            **extra}


def _dev(tmp_path: Path, *names: str) -> str:
    root = tmp_path / "dev"
    for n in names:
        (root / n).parent.mkdir(parents=True, exist_ok=True)
        (root / n).touch()
    root.mkdir(parents=True, exist_ok=True)
    return str(root)


def _fails(cfg, rank: int, env: dict[str, str], dev: str) -> str:
    with pytest.raises(PreflightError) as info:
        check_host(cfg, rank, env, dev)
    return str(info.value)


def test_a_good_tpu_host_passes_and_reports_what_it_found(tmp_path: Path) -> None:
    dev = _dev(tmp_path, "accel0", "accel1", "accel2", "accel3")
    info = check_host(_tpu_cfg(), 1, _tpu_env(1), dev)
    assert info["devices"] == 4 and info["TPU_WORKER_ID"] == "1" and info["jax_platform"] == "tpu"
    # v5e/v6e hosts expose chips as VFIO groups
    assert tpu_chips_visible({}, _dev(tmp_path / "v", "vfio/0", "vfio/1", "vfio/2", "vfio/3")) == 4


def test_missing_tpu_variables_name_them_and_the_webhook(tmp_path: Path) -> None:
    dev = _dev(tmp_path, "accel0", "accel1", "accel2", "accel3")
    msg = _fails(_tpu_cfg(), 0, {"JAX_PLATFORMS": "tpu"}, dev)
    assert "preflight failed on host 0" in msg
    assert "TPU variable(s) TPU_WORKER_ID, TPU_WORKER_HOSTNAMES, TPU_NAME not set" in msg
    assert "KubeRay TPU webhook" in msg and "GKE's Ray add-on" in msg


def test_topology_against_config(tmp_path: Path) -> None:
    dev = _dev(tmp_path, "accel0", "accel1", "accel2", "accel3")
    env = _tpu_env(2, TPU_WORKER_HOSTNAMES="h0,h1", TPU_ACCELERATOR_TYPE="v6e-8", TPU_TOPOLOGY="2x4")
    msg = _fails(_tpu_cfg(), 1, env, dev)
    assert "TPU_WORKER_HOSTNAMES lists 2 host(s) but cluster.num_hosts is 4" in msg
    assert "TPU_WORKER_ID is 2 but this host was placed as rank 1" in msg
    assert "TPU_ACCELERATOR_TYPE v6e-8 has 8 chip(s) but cluster.num_hosts x devices_per_host is 4 x 4 = 16" in msg
    assert "TPU_ACCELERATOR_TYPE v6e-8 is a v6e slice but cluster.accelerator_type is 'v5e'" in msg
    assert "this slice's head resource is TPU-v6e-8-head" in msg and HEAD in msg
    assert "TPU_TOPOLOGY 2x4 has 8 chip(s) but cluster.num_hosts x devices_per_host is 16" in msg
    assert "TPU_WORKER_ID is 'x', not an integer" in _fails(_tpu_cfg(), 0, _tpu_env(TPU_WORKER_ID="x"), dev)


def test_chip_count_and_platform(tmp_path: Path) -> None:
    msg = _fails(_tpu_cfg(), 1, _tpu_env(1), _dev(tmp_path, "accel0", "accel1"))
    assert "2 TPU chip(s) visible" in msg and "cluster.devices_per_host is 4" in msg and "google.com/tpu: 4" in msg
    msg = _fails(_tpu_cfg(), 1, _tpu_env(1, JAX_PLATFORMS="cuda"), _dev(tmp_path))
    assert "JAX_PLATFORMS is 'cuda' but cluster.platform is 'tpu'" in msg
    assert tpu_chips_of_type("v4-32") == ("v4", 16) and tpu_chips_of_type("v5litepod-16") == ("v5litepod", 16)
    assert tpu_chips_of_type("tpu7x-8") is None


def test_gpu_count_names_the_device_plugin(tmp_path: Path) -> None:
    cfg = config_from_dict({"cluster": {"num_hosts": 2, "devices_per_host": 8, "platform": "gpu", "simulated": False,
                                        "host_resources": {"GPU": 8}},
                            "mesh": {"axes": {"dp": 2, "tp": 8}}, "engine": {"compilation_cache_dir": None}})
    dev = _dev(tmp_path, *[f"nvidia{i}" for i in range(8)], "nvidiactl", "nvidia-uvm")
    assert gpus_visible({}, dev) == 8
    assert check_host(cfg, 0, {"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, dev)["devices"] == 8
    msg = _fails(cfg, 1, {"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "0,1"}, dev)
    assert "2 NVIDIA GPU(s) visible" in msg and "CUDA_VISIBLE_DEVICES='0,1'" in msg
    assert "cluster.devices_per_host is 8" in msg and "NVIDIA GPU device plugin" in msg
    msg = _fails(cfg, 0, {"JAX_PLATFORMS": "cuda"}, _dev(tmp_path / "none"))
    assert "0 NVIDIA GPU(s) visible" in msg


def test_simulated_cpu_host_checks_its_virtual_device_count(tmp_path: Path) -> None:
    cfg = config_from_dict({"cluster": {"num_hosts": 2, "devices_per_host": 2}, "mesh": {"axes": {"dp": 2, "tp": 2}},
                            "engine": {"compilation_cache_dir": None}})
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert check_host(cfg, 0, env)["devices"] == 2
    msg = _fails(cfg, 0, {"JAX_PLATFORMS": "cpu"}, str(tmp_path))
    assert "JAX will create 1 CPU device(s)" in msg and "cluster.devices_per_host is 2" in msg


def test_compile_cache_dir_missing_or_read_only(tmp_path: Path) -> None:
    assert cache_dir_problem(None) is None and cache_dir_problem("gs://bucket/cache") is None
    assert cache_dir_problem(str(tmp_path / "new" / "cache")) is None  # creatable
    ro = "/proc/sys"  # read-only for every user, root included (a chmod-ed folder is not for root)
    assert not os.access(ro, os.W_OK)
    msg = cache_dir_problem(ro)
    assert msg is not None and f"engine.compilation_cache_dir '{ro}' is read-only" in msg
    msg = cache_dir_problem(f"{ro}/sub/cache")
    assert msg is not None and "is missing and cannot be created" in msg and f"'{ro}'" in msg
    f = tmp_path / "file"
    f.write_text("x")
    assert "exists and is not a directory" in (cache_dir_problem(str(f)) or "")


def test_plan_reports_an_unusable_cache_dir(tmp_path: Path) -> None:
    from raydeploy.plan import make_plan

    f = tmp_path / "file"
    f.write_text("x")
    cfg = config_from_dict({"cluster": {"num_hosts": 2, "devices_per_host": 1}, "mesh": {"axes": {"dp": 2}},
                            "engine": {"compilation_cache_dir": str(f / "cache")}}, source="test")
    plan = make_plan(cfg)
    assert any("engine.compilation_cache_dir" in p and "cannot be created" in p for p in plan.problems), plan.problems
    remote = config_from_dict({"cluster": {"num_hosts": 2, "devices_per_host": 1}, "mesh": {"axes": {"dp": 2}},
                               "engine": {"compilation_cache_dir": "gs://b/cache"}}, source="test")
    assert any("gs://b/cache is not checked here" in w for w in make_plan(remote).warnings)


@pytest.fixture(scope="module")
def bare_tpu_cluster():
    """Two nodes with TPU chips whose pods lack the TPU variables: Ray advertises `TPU` but no slice name and
    no head resource, as on a cluster without the KubeRay TPU webhook."""
    from ray_cluster import fake_nodes_cluster

    def add(cluster):
        return [cluster.add_node(num_cpus=1, resources={"TPU": 4}) for _ in range(2)]

    with fake_nodes_cluster("rdf", "raydeploy-preflight", add) as nodes:
        yield nodes


@pytest.mark.ray
def test_tpu_nodes_without_variables_fail_preflight_without_restarts(bare_tpu_cluster) -> None:
    from raydeploy.gang.bringup import GangError
    from raydeploy.gang.gang import start_gang

    cfg = _tpu_cfg({"dp": 2, "tp": 4}, num_hosts=2, placement_timeout_s=600, max_restarts=3)
    gang = start_gang(cfg, engine="toy", name="gang-bare")
    try:
        with pytest.raises(GangError) as info:
            gang.wait_ready(120)  # far below placement_timeout_s: the error does not wait for placement
        st = gang.state()
    finally:
        gang.shutdown()
    msg = str(info.value)
    assert st["state"] == "failed" and st["restarts"] == 0 and len(st["history"]) == 1, st
    assert "2 node(s) have TPU chips but none advertises a slice head resource" in msg
    assert f"cluster.tpu_slice_head_resource={HEAD}" in msg
    assert msg.count("lacks TPU_WORKER_ID, TPU_WORKER_HOSTNAMES, TPU_NAME") == 2
    assert "KubeRay TPU webhook" in msg and "(not retriable)" in msg
    from ray.util.placement_group import placement_group_table

    # the attempt ended before any placement group was made
    assert not [pg for pg in placement_group_table().values() if pg["name"].startswith("gang-bare")]
