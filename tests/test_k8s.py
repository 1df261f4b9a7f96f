"""KubeRay manifests (k8s/): each validates against the KubeRay CRD schemas and keeps production habits.

The CRDs are read from `<repo>/../shared/kuberay-crds/`. Validation is strict: besides the schema's types
and enums, an unknown field anywhere (a typo Kubernetes would silently prune) is an error. The raydeploy
config embedded in each manifest must load and plan.
"""

from __future__ import annotations

import copy
import importlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from raydeploy.config import load_config
from raydeploy.plan import make_plan

REPO = Path(__file__).resolve().parents[1]
CRD_DIR = REPO.parent / "shared" / "kuberay-crds"
MANIFESTS = sorted((REPO / "k8s").glob("*.yaml"))
ACCELERATORS = ("google.com/tpu", "nvidia.com/gpu")
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.I)
COORDINATOR_PORT = 8476  # cluster.coordinator_port's default on real clusters
GCSFUSE = "gcsfuse.csi.storage.gke.io"
# checkpoint shards are read in ranges by many threads: cache whole files, download them in parallel, cache
# metadata for the life of the mount (the bucket is read-only here)
RANGE_READ = {"file-cache:max-size-mb:-1", "file-cache:cache-file-for-range-read:true",
              "file-cache:enable-parallel-downloads:true", "metadata-cache:ttl-secs:-1"}

pytestmark = pytest.mark.skipif(not CRD_DIR.is_dir(), reason=f"KubeRay CRD schemas not found at {CRD_DIR}")


def _strict(schema: Any) -> Any:
    """Forbid fields the schema does not declare (like `kubectl apply --validate=strict`)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def validators() -> dict[str, Any]:
    import jsonschema

    out = {}
    for path in CRD_DIR.glob("*.yaml"):
        crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        kind = crd["spec"]["names"]["kind"]
        (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        schema = _strict(v1["schema"]["openAPIV3Schema"])
        out[kind] = jsonschema.Draft7Validator(schema)
    assert {"RayCluster", "RayJob", "RayService"} <= set(out)
    return out


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _ray_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in _docs(path) if d["apiVersion"] == "ray.io/v1"]


def _cluster_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return {"RayCluster": lambda s: s, "RayService": lambda s: s["rayClusterConfig"],
            "RayJob": lambda s: s["rayClusterSpec"]}[doc["kind"]](doc["spec"])


def _pods(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(role, pod spec) of the head, every worker group and the job submitter."""
    cs = _cluster_spec(doc)
    pods = [("head", cs["headGroupSpec"]["template"]["spec"])]
    pods += [(f"worker {g['groupName']}", g["template"]["spec"]) for g in cs.get("workerGroupSpecs", [])]
    if doc["kind"] == "RayJob" and "submitterPodTemplate" in doc["spec"]:
        pods.append(("submitter", doc["spec"]["submitterPodTemplate"]["spec"]))
    return pods


def _errors(validators: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validators[doc["kind"]].iter_errors(doc)]


def test_manifests_exist() -> None:
    kinds = {d["kind"] for p in MANIFESTS for d in _ray_docs(p)}
    assert kinds == {"RayCluster", "RayJob", "RayService"}
    names = {p.name for p in MANIFESTS}
    assert {"rayservice-tpu-v5e.yaml", "rayservice-gpu.yaml", "rayjob-convert.yaml", "rayjob-predict.yaml"} <= names


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_validates_against_crd(path: Path, validators: dict[str, Any]) -> None:
    for doc in _ray_docs(path):
        assert _errors(validators, doc) == []


def test_validation_can_fail(validators: dict[str, Any]) -> None:
    doc = _ray_docs(REPO / "k8s" / "rayservice-tpu-v5e.yaml")[0]
    bad = copy.deepcopy(doc)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["numOfHost"] = 4  # typo
    assert any("numOfHost" in e for e in _errors(validators, bad))
    bad = copy.deepcopy(doc)
    bad["spec"]["rayClusterConfig"]["authOptions"]["mode"] = "on"
    assert any("authOptions/mode" in e for e in _errors(validators, bad))
    bad = copy.deepcopy(doc)
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["readinessProbe"][
        "periodSeconds"] = "ten"
    assert any("periodSeconds" in e for e in _errors(validators, bad))


def _habit_violations(docs: list[dict[str, Any]], name: str) -> list[str]:
    bad: list[str] = []
    for doc in docs:
        if doc["kind"] == "Service" and doc["spec"].get("type", "ClusterIP") != "ClusterIP":
            bad.append(f"{name}: Service {doc['metadata']['name']} exposed outside the cluster")
        if doc["kind"] == "Secret":
            bad.append(f"{name}: secrets are created out of band, not committed")
    for doc in [d for d in docs if d["apiVersion"] == "ray.io/v1"]:
        cs = _cluster_spec(doc)
        where = f"{name} {doc['kind']} {doc['metadata']['name']}"
        if cs.get("authOptions", {}).get("mode") != "token":
            bad.append(f"{where}: Ray token auth must be on")
        if cs["headGroupSpec"].get("serviceType", "ClusterIP") != "ClusterIP":
            bad.append(f"{where}: head service exposed outside the cluster")
        for role, pod in _pods(doc):
            if pod.get("hostNetwork"):
                bad.append(f"{where} {role}: hostNetwork")
            if not pod.get("serviceAccountName"):
                bad.append(f"{where} {role}: no serviceAccountName")
            for v in pod.get("volumes", []):
                attrs = v.get("csi", {}).get("volumeAttributes", {})
                opts = set(attrs.get("mountOptions", "").split(","))
                if v.get("csi", {}).get("driver") == GCSFUSE and v["csi"].get("readOnly") and not RANGE_READ <= opts:
                    bad.append(f"{where} {role}: read-only bucket {attrs.get('bucketName')} lacks "
                               f"{sorted(RANGE_READ - opts)}")
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for c in pod["containers"]:
                res = c.get("resources", {})
                for kind in ("requests", "limits"):
                    if not {"cpu", "memory"} <= set(res.get(kind, {})):
                        bad.append(f"{where} {role}: resources.{kind} needs cpu and memory")
                held = set(res.get("requests", {})) | set(res.get("limits", {}))
                if role == "head" and set(ACCELERATORS) & held:
                    bad.append(f"{where}: accelerators on the head")
                for acc in ACCELERATORS:
                    if res.get("requests", {}).get(acc) != res.get("limits", {}).get(acc):
                        bad.append(f"{where} {role}: {acc} requests != limits")
                for env in c.get("env", []):
                    if SECRET_NAME.search(env["name"]) and (
                            "value" in env or "secretKeyRef" not in env.get("valueFrom", {})):
                        bad.append(f"{where} {role}: {env['name']} must come from a Secret (secretKeyRef)")
                if role == "head" and not c.get("readinessProbe"):
                    bad.append(f"{where} {role}: no readiness probe")
                if role.startswith("worker") and c.get("readinessProbe"):
                    # KubeRay's default applies; Serve runs proxies only where replicas live
                    bad.append(f"{where} {role}: custom readiness probe on a worker")
                if role != "submitter":
                    shm = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
                    vol = volumes.get(shm[0]["name"], {}).get("emptyDir", {}) if shm else {}
                    if vol.get("medium") != "Memory" or not vol.get("sizeLimit"):
                        bad.append(f"{where} {role}: /dev/shm needs an emptyDir with medium Memory and a sizeLimit")
                if role.startswith("worker") and set(ACCELERATORS) & held and not any(
                        p.get("containerPort") == COORDINATOR_PORT for p in c.get("ports", [])):
                    bad.append(f"{where} {role}: no containerPort {COORDINATOR_PORT} (jax.distributed coordinator)")
                for m in c.get("volumeMounts", []):
                    vol = volumes.get(m["name"], {})
                    if m["mountPath"].startswith("/mnt/checkpoints") and not ({"csi", "persistentVolumeClaim"} & set(vol)):
                        bad.append(f"{where} {role}: checkpoints must come from a bucket mount or a volume claim")
                if any("hostPort" in p for p in c.get("ports", [])):
                    bad.append(f"{where} {role}: hostPort")
    return bad


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_production_habits(path: Path) -> None:
    assert _habit_violations(_docs(path), path.name) == []


def test_habit_checks_can_fail() -> None:
    docs = _docs(REPO / "k8s" / "rayservice-gpu.yaml")
    rs = docs[1]["spec"]["rayClusterConfig"]
    rs["authOptions"]["mode"] = "disabled"
    rs["headGroupSpec"]["serviceType"] = "LoadBalancer"
    head = rs["headGroupSpec"]["template"]["spec"]
    head["hostNetwork"] = True
    head["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "1"
    head["containers"][0]["env"].append({"name": "RAY_AUTH_TOKEN", "value": "plain"})
    head["volumes"] = [v if v["name"] != "checkpoints" else {"name": "checkpoints", "hostPath": {"path": "/data"}}
                       for v in head["volumes"]]
    del rs["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["requests"]
    docs.append({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "dash"},
                 "spec": {"type": "NodePort", "ports": [{"port": 8265}]}})
    text = "\n".join(_habit_violations(docs, "x"))
    for expected in ("token auth must be on", "head service exposed", "hostNetwork", "accelerators on the head",
                     "RAY_AUTH_TOKEN must come from a Secret", "bucket mount or a volume claim",
                     "resources.requests needs cpu and memory", "Service dash exposed"):
        assert expected in text


def test_real_cluster_checks_can_fail() -> None:
    docs = _docs(REPO / "k8s" / "rayservice-tpu-v5e.yaml")
    rs = docs[1]["spec"]["rayClusterConfig"]
    worker = rs["workerGroupSpecs"][0]["template"]["spec"]
    c = worker["containers"][0]
    c["readinessProbe"] = {"httpGet": {"path": "/ready", "port": 8000}}
    c["ports"] = [p for p in c["ports"] if p["containerPort"] != 8476]
    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["mountPath"] != "/dev/shm"]
    del worker["serviceAccountName"]
    (ckpt,) = [v for v in worker["volumes"] if v["name"] == "checkpoints"]
    ckpt["csi"]["volumeAttributes"]["mountOptions"] = "implicit-dirs"
    head = rs["headGroupSpec"]["template"]["spec"]
    (shm,) = [v for v in head["volumes"] if v["name"] == "dshm"]
    del shm["emptyDir"]["sizeLimit"]
    text = "\n".join(_habit_violations(docs, "x"))
    for expected in ("worker tpu-v5e-16: custom readiness probe on a worker",
                     "worker tpu-v5e-16: no containerPort 8476", "worker tpu-v5e-16: no serviceAccountName",
                     "worker tpu-v5e-16: /dev/shm needs an emptyDir", "head: /dev/shm needs an emptyDir",
                     "read-only bucket my-raydeploy-checkpoints lacks ['file-cache:cache-file-for-range-read:true'"):
        assert expected in text, text


def _makefile_vars() -> dict[str, str]:
    out = {}
    for line in (REPO / "Makefile").read_text().splitlines():
        if m := re.match(r"^([A-Z_]+)\s*[:?]?=\s*(\S.*?)\s*$", line):
            out[m.group(1)] = m.group(2)
    return out


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_images_are_the_makefile_images(path: Path) -> None:
    """Accelerator pods run the image built for their accelerator; every image is one the Makefile builds."""
    mk = _makefile_vars()
    built = {"tpu": mk["IMAGE_TPU"], "cuda": mk["IMAGE_CUDA"]}
    ray_version = re.search(r":(\d+\.\d+\.\d+)-", mk["RAY_IMAGE_TPU"]).group(1)  # type: ignore[union-attr]
    for doc in _ray_docs(path):
        assert _cluster_spec(doc)["rayVersion"] == ray_version
        images = set()
        for role, pod in _pods(doc):
            for c in pod["containers"]:
                images.add(c["image"])
                limits = c.get("resources", {}).get("limits", {})
                if "google.com/tpu" in limits:
                    assert c["image"] == built["tpu"], f"{path.name} {role}: {c['image']}"
                if "nvidia.com/gpu" in limits:
                    assert c["image"] == built["cuda"], f"{path.name} {role}: {c['image']}"
        assert len(images) == 1 and images <= set(built.values()), f"{path.name}: {images}"


@pytest.mark.parametrize("path", [p for p in MANIFESTS if p.name.startswith("rayservice")], ids=lambda p: p.name)
def test_rayservice_serves_raydeploy(path: Path) -> None:
    (doc,) = _ray_docs(path)
    serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    module, _, attr = app["import_path"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr)), app["import_path"]
    config_path = app["args"]["config"]
    for role, pod in _pods(doc):
        mounts = [m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])]
        assert any(config_path.startswith(m + "/") for m in mounts), f"{role}: {config_path} not mounted"
    # Serve readiness is the gang's readiness: replicas start serving only once the gang is ready
    assert isinstance(app["args"].get("ready_timeout_s"), int | float) and app["args"]["ready_timeout_s"] > 0
    assert app["args"]["ready_timeout_s"] <= doc["spec"]["deploymentUnhealthySecondThreshold"]


def test_tpu_and_gpu_worker_groups() -> None:
    seen = set()
    for path in MANIFESTS:
        for doc in _ray_docs(path):
            for g in _cluster_spec(doc).get("workerGroupSpecs", []):
                pod = g["template"]["spec"]
                limits = pod["containers"][0]["resources"]["limits"]
                if "google.com/tpu" in limits:
                    seen.add("tpu")
                    assert g["numOfHosts"] > 1
                    sel = pod["nodeSelector"]
                    assert sel["cloud.google.com/gke-tpu-accelerator"] and sel["cloud.google.com/gke-tpu-topology"]
                if "nvidia.com/gpu" in limits:
                    seen.add("gpu")
    assert seen == {"tpu", "gpu"}


def _embedded(path: Path) -> list[tuple[str, str, dict[str, Any]]]:
    out = []
    docs = _docs(path)
    ray_docs = [d for d in docs if d["apiVersion"] == "ray.io/v1"]
    for d in docs:
        if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {}):
            out.append((d["metadata"]["name"], d["data"]["config.yaml"], ray_docs[0]))
    return out


EMBEDDED = [(p, name) for p in MANIFESTS for name, _, _ in _embedded(p)]


@pytest.mark.parametrize(("path", "name"), EMBEDDED, ids=[f"{p.name}:{n}" for p, n in EMBEDDED])
def test_embedded_config_loads_and_plans(path: Path, name: str, tmp_path: Path) -> None:
    (text, doc), = [(t, d) for n, t, d in _embedded(path) if n == name]
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(text)
    raw = yaml.safe_load(text)
    # in the cluster the checkpoint's own config.json gives the shape; here the bundled copy of it does
    model_json = REPO / "configs" / "models" / Path(raw["model"]["checkpoint"]).name / "config.json"
    assert model_json.is_file(), f"no bundled {model_json} for {raw['model']['checkpoint']}"
    cfg = load_config(cfg_path, [f"model.hf_config={model_json}"])
    plan = make_plan(cfg)
    assert plan.ok, plan.problems
    # the gang fits the worker pods: one host actor per accelerator pod, claiming all its devices
    hosts, per_pod = 0, set()
    for g in _cluster_spec(doc).get("workerGroupSpecs", []):
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        acc = [int(limits[a]) for a in ACCELERATORS if a in limits]
        if acc:
            hosts += g["replicas"] * g.get("numOfHosts", 1)
            per_pod.add(acc[0])
    # every gang the replicas section allows has its own hosts (one gang: replicas.max 1)
    assert hosts == cfg.cluster.num_hosts * cfg.replicas.max and per_pod == {cfg.cluster.devices_per_host}
    # the compile cache is one writable bucket mount shared by every host pod (not per-pod, not read-only)
    cache_dir = cfg.engine.compilation_cache_dir
    assert cache_dir and not cache_dir.startswith("/mnt/checkpoints"), cache_dir
    for role, pod in _pods(doc):
        if not role.startswith("worker"):
            continue
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounts = [m for c in pod["containers"] for m in c.get("volumeMounts", []) if m["mountPath"] == cache_dir]
        assert mounts and not mounts[0].get("readOnly"), f"{role}: {cache_dir} not mounted writable"
        vol = volumes[mounts[0]["name"]]
        assert vol.get("csi", {}).get("driver") == GCSFUSE and not vol["csi"].get("readOnly"), f"{role}: {vol}"
    # the config is mounted where the entry point reads it
    if doc["kind"] == "RayJob":
        assert "/etc/raydeploy/config.yaml" in doc["spec"]["entrypoint"]
        assert doc["spec"]["shutdownAfterJobFinishes"] is True
