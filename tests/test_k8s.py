"""KubeRay manifests (k8s/): each validates against the KubeRay CRD schemas and keeps production habits.

The schemas live in tests/schemas/: KubeRay's CRDs (RayCluster, RayJob, RayService) and the Kubernetes
NetworkPolicy (networking.k8s.io/v1) as an OpenAPI v3 schema; a missing one fails the tests. Validation is
strict: besides the schema's types and enums, an unknown field anywhere (a typo Kubernetes would silently
prune) is an error. Every pod runs as the image's non-root user with no privilege escalation, no
capabilities and the runtime's seccomp profile. The network policies are checked for what they admit: each
Ray cluster's pods reach each other on every port (Ray, the jax.distributed coordinator), other pods reach
only Serve's 8000, and the KubeRay operator (and a RayJob's submitter) only the head's dashboard. The
raydeploy config embedded in each manifest must load and plan.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from raydeploy.config import load_config
from raydeploy.plan import make_plan

REPO = Path(__file__).resolve().parents[1]
SCHEMA_DIR = REPO / "tests" / "schemas"
CRD_FILES = ("ray.io_rayclusters.yaml", "ray.io_rayjobs.yaml", "ray.io_rayservices.yaml")
NETWORK_POLICY_SCHEMA = SCHEMA_DIR / "networking.k8s.io_v1_networkpolicy.json"
MANIFESTS = sorted((REPO / "k8s").glob("*.yaml"))
ACCELERATORS = ("google.com/tpu", "nvidia.com/gpu")
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.I)
COORDINATOR_PORT = 8476  # cluster.coordinator_port's default on real clusters
GCSFUSE = "gcsfuse.csi.storage.gke.io"
# checkpoint shards are read in ranges by many threads: cache whole files, download them in parallel, cache
# metadata for the life of the mount (the bucket is read-only here)
RANGE_READ = {"file-cache:max-size-mb:-1", "file-cache:cache-file-for-range-read:true",
              "file-cache:enable-parallel-downloads:true", "metadata-cache:ttl-secs:-1"}

NON_ROOT_UID = 1000  # the user `ray` of the rayproject/ray images ours build on (group users, 100)
SERVE_PORT = 8000
RAY_PORTS = {6379: "GCS", 8265: "dashboard", 10001: "client server", 52365: "dashboard agent",
             COORDINATOR_PORT: "jax.distributed coordinator", 10002: "a Ray worker", 41733: "a random port (NCCL)"}


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

    missing = [str(p) for p in [*(SCHEMA_DIR / f for f in CRD_FILES), NETWORK_POLICY_SCHEMA] if not p.is_file()]
    assert not missing, f"schemas missing (they belong in the repository): {missing}"
    out = {}
    for name in CRD_FILES:
        crd = yaml.load((SCHEMA_DIR / name).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        kind = crd["spec"]["names"]["kind"]
        (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        schema = _strict(v1["schema"]["openAPIV3Schema"])
        out[kind] = jsonschema.Draft7Validator(schema)
    netpol = json.loads(NETWORK_POLICY_SCHEMA.read_text())
    out[netpol["kind"]] = jsonschema.Draft7Validator(_strict(netpol["openAPIV3Schema"]))
    assert {"RayCluster", "RayJob", "RayService", "NetworkPolicy"} <= set(out)
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
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validators[doc["kind"]].iter_errors(doc)]
    return errors + (_network_policy_errors(doc) if doc["kind"] == "NetworkPolicy" and not errors else [])


def _network_policy_errors(doc: dict[str, Any]) -> list[str]:
    """What the API server checks in a NetworkPolicy beyond its schema."""
    bad = []
    spec = doc["spec"]
    for direction, peers_key in (("ingress", "from"), ("egress", "to")):
        for i, rule in enumerate(spec.get(direction, [])):
            for j, peer in enumerate(rule.get(peers_key, [])):
                where = f"spec/{direction}/{i}/{peers_key}/{j}"
                if not peer:
                    bad.append(f"{where}: must specify a peer")
                if "ipBlock" in peer and len(peer) > 1:
                    bad.append(f"{where}: ipBlock may not be combined with other peer fields")
            for j, port in enumerate(rule.get("ports", [])):
                if "endPort" in port and not (isinstance(port.get("port"), int) and port["endPort"] >= port["port"]):
                    bad.append(f"spec/{direction}/{i}/ports/{j}: endPort needs a numerical port <= endPort")
    return bad


def test_manifests_exist() -> None:
    kinds = {d["kind"] for p in MANIFESTS for d in _ray_docs(p)}
    assert kinds == {"RayCluster", "RayJob", "RayService"}
    names = {p.name for p in MANIFESTS}
    assert {"rayservice-tpu-v5e.yaml", "rayservice-gpu.yaml", "rayjob-convert.yaml", "rayjob-predict.yaml"} <= names


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_validates_against_crd(path: Path, validators: dict[str, Any]) -> None:
    for doc in _ray_docs(path):
        assert _errors(validators, doc) == []
    policies = [d for d in _docs(path) if d["kind"] == "NetworkPolicy"]
    assert policies, f"{path.name} ships no NetworkPolicy"
    for doc in policies:
        assert _errors(validators, doc) == [], doc["metadata"]["name"]


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
    bad = copy.deepcopy(doc)
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["securityContext"][
        "capabilities"] = {"drop": "ALL"}  # a list in the schema
    assert any("capabilities/drop" in e for e in _errors(validators, bad))
    policy = next(d for d in _docs(REPO / "k8s" / "rayservice-tpu-v5e.yaml") if d["kind"] == "NetworkPolicy")
    for change, expected in [
        (lambda p: p["spec"].update(podSelectr=p["spec"].pop("podSelector")), "podSelector"),
        (lambda p: p["spec"].update(policyTypes=["Inbound"]), "policyTypes/0"),
        (lambda p: p["spec"]["ingress"][0]["from"][0]["podSelector"].update(matchLabel={}), "matchLabel"),
        (lambda p: p["spec"]["ingress"].append({"ports": [{"protocol": "HTTP", "port": 80}]}), "protocol"),
        (lambda p: p["spec"]["ingress"].append({"ports": [{"port": 70000}]}), "ports/0/port"),
        (lambda p: p["spec"]["ingress"].append({"from": [{}]}), "must specify a peer"),
        (lambda p: p["spec"]["ingress"].append({"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}),
         "ipBlock may not be combined"),
        (lambda p: p["spec"]["ingress"].append({"ports": [{"port": "serve", "endPort": 9000}]}), "endPort"),
    ]:
        bad = copy.deepcopy(policy)
        change(bad)
        assert any(expected in e for e in _errors(validators, bad)), (expected, _errors(validators, bad))


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
                bad += _security_context_violations(pod, c, f"{where} {role}")
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


def _security_context_violations(pod: dict[str, Any], c: dict[str, Any], where: str) -> list[str]:
    """Non-root (the image's user), no privilege escalation, no capabilities, the runtime's seccomp profile."""
    pod_sc, sc = pod.get("securityContext", {}), c.get("securityContext", {})

    def get(key: str) -> Any:  # a container's setting wins over the pod's
        return sc.get(key, pod_sc.get(key))

    bad = []
    if sc.get("privileged"):
        bad.append(f"{where}: privileged container")
    if get("runAsNonRoot") is not True or get("runAsUser") != NON_ROOT_UID:
        bad.append(f"{where}: must run as non-root (runAsNonRoot: true, runAsUser: {NON_ROOT_UID})")
    if sc.get("allowPrivilegeEscalation") is not False:
        bad.append(f"{where}: allowPrivilegeEscalation must be false")
    caps = sc.get("capabilities", {})
    if "ALL" not in caps.get("drop", []) or caps.get("add"):
        bad.append(f"{where}: capabilities must drop ALL and add none")
    if (get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        bad.append(f"{where}: seccompProfile must be RuntimeDefault")
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
    head_sc = head["containers"][0]["securityContext"]
    head_sc.update(privileged=True, runAsNonRoot=False, allowPrivilegeEscalation=True)
    del head_sc["seccompProfile"]
    worker_sc = rs["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["securityContext"]
    worker_sc["capabilities"] = {"add": ["SYS_ADMIN"]}
    del worker_sc["runAsUser"]
    del rs["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["requests"]
    docs.append({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "dash"},
                 "spec": {"type": "NodePort", "ports": [{"port": 8265}]}})
    text = "\n".join(_habit_violations(docs, "x"))
    for expected in ("token auth must be on", "head service exposed", "hostNetwork", "accelerators on the head",
                     "RAY_AUTH_TOKEN must come from a Secret", "bucket mount or a volume claim",
                     "resources.requests needs cpu and memory", "Service dash exposed",
                     "head: privileged container", "head: must run as non-root",
                     "head: allowPrivilegeEscalation must be false", "head: seccompProfile must be RuntimeDefault",
                     "worker h100x8: capabilities must drop ALL", "worker h100x8: must run as non-root"):
        assert expected in text, text


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


# -- what the network policies admit -----------------------------------------------------------------------


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector against a pod's (or namespace's) labels; {} matches everything."""
    for k, v in selector.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions", []):
        has, values = e["key"] in labels, e.get("values", [])
        if not {"In": has and labels.get(e["key"]) in values, "NotIn": not has or labels[e["key"]] not in values,
                "Exists": has, "DoesNotExist": not has}[e["operator"]]:
            return False
    return True


def _admits(policies: list[dict[str, Any]], dst: dict[str, str], src: dict[str, str], port: int,
            src_namespace: dict[str, str] | None = None) -> bool:
    """Whether TCP traffic from a pod labelled `src` (in the policies' namespace unless `src_namespace` gives
    another's labels) to a pod labelled `dst` on `port` is admitted: Kubernetes' rules for ingress."""
    selecting = [p for p in policies if _matches(p["spec"]["podSelector"], dst)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True  # a pod no policy selects is not isolated

    def peer_ok(peer: dict[str, Any]) -> bool:
        if "ipBlock" in peer:
            return False  # pods here are addressed by labels only
        if "namespaceSelector" in peer:
            ns_ok = src_namespace is not None and _matches(peer["namespaceSelector"], src_namespace) or (
                src_namespace is None and _matches(peer["namespaceSelector"], {"kubernetes.io/metadata.name": "ns"}))
        else:
            ns_ok = src_namespace is None  # podSelector alone: the policy's own namespace
        return ns_ok and _matches(peer.get("podSelector", {}), src)

    def port_ok(p: dict[str, Any]) -> bool:
        if p.get("protocol", "TCP") != "TCP":
            return False
        if "port" not in p:
            return True
        return p["port"] <= port <= p.get("endPort", p["port"])

    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            if (not rule.get("from") or any(peer_ok(x) for x in rule["from"])) and (
                    not rule.get("ports") or any(port_ok(x) for x in rule["ports"])):
                return True
    return False


def _pod_labels(doc: dict[str, Any], role: str, template: dict[str, Any]) -> dict[str, str]:
    """The labels KubeRay gives a pod of `doc` (the template's, plus its own); a RayService's or RayJob's
    cluster name is generated, so ray.io/cluster gets a stand-in."""
    labels = dict(template.get("metadata", {}).get("labels", {}))
    if role == "submitter":
        return labels
    cluster = doc["metadata"]["name"] if doc["kind"] == "RayCluster" else f"{doc['metadata']['name']}-x7k2p"
    return {**labels, "ray.io/cluster": cluster, "ray.io/node-type": "head" if role == "head" else "worker",
            "app.kubernetes.io/name": "kuberay", "app.kubernetes.io/created-by": "kuberay-operator"}


def _templates(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    cs = _cluster_spec(doc)
    out = [("head", cs["headGroupSpec"]["template"])]
    out += [(f"worker {g['groupName']}", g["template"]) for g in cs.get("workerGroupSpecs", [])]
    if doc["kind"] == "RayJob" and "submitterPodTemplate" in doc["spec"]:
        out.append(("submitter", doc["spec"]["submitterPodTemplate"]))
    return out


OPERATOR = {"app.kubernetes.io/component": "kuberay-operator", "app.kubernetes.io/name": "kuberay-operator"}
STRANGER = {"app": "some-other-app"}


def _policy_violations(path: Path) -> list[str]:
    docs = _docs(path)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    (doc,) = _ray_docs(path)
    serves = any(p.get("containerPort") == SERVE_PORT for _, pod in _pods(doc) for c in pod["containers"]
                 for p in c.get("ports", []))
    pods = {role: _pod_labels(doc, role, t) for role, t in _templates(doc)}
    members = {r: labels for r, labels in pods.items() if r != "submitter"}
    # the pods of every other manifest's cluster: a neighbour in the same namespace
    others = [_pod_labels(d, r, t) for p in MANIFESTS if p.name != path.name for d in _ray_docs(p) for r, t in _templates(d)
              if r != "submitter"]
    bad = []
    for role, dst in members.items():
        if not any(_matches(p["spec"]["podSelector"], dst) for p in policies):
            bad.append(f"{path.name} {role}: no NetworkPolicy selects it")
        for port, what in RAY_PORTS.items():
            for src_role, src in members.items():
                if not _admits(policies, dst, src, port):
                    bad.append(f"{path.name} {role}: {what} port {port} refused to {src_role} of the same cluster")
            dashboard = role == "head" and port == 8265  # the operator's and the submitter's way in
            outsiders = [("a stranger pod", STRANGER, None), ("another cluster's pod", others[0], None)]
            if not dashboard:
                outsiders.append(("the KubeRay operator", OPERATOR, {"kubernetes.io/metadata.name": "kuberay"}))
                if "submitter" in pods:
                    outsiders.append(("the submitter", pods["submitter"], None))
            for name, src, ns in outsiders:
                if _admits(policies, dst, src, port, ns):
                    bad.append(f"{path.name} {role}: {what} port {port} open to {name}")
        if _admits(policies, dst, STRANGER, SERVE_PORT) != serves:
            bad.append(f"{path.name} {role}: Serve port {SERVE_PORT} {'closed to' if serves else 'open to'} clients")
    head = members["head"]
    if not _admits(policies, head, OPERATOR, 8265, {"kubernetes.io/metadata.name": "kuberay"}):
        bad.append(f"{path.name} head: dashboard 8265 refused to the KubeRay operator")
    if "submitter" in pods and not _admits(policies, head, pods["submitter"], 8265):
        bad.append(f"{path.name} head: dashboard 8265 refused to the job's submitter")
    return bad


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_network_policies_admit_only_the_cluster_to_ray_and_the_coordinator(path: Path) -> None:
    assert _policy_violations(path) == []
    for _, pod in _pods(_ray_docs(path)[0]):  # the coordinator's port is JAX's default, fixed, not random
        for c in pod["containers"]:
            assert all(p["containerPort"] in (*RAY_PORTS, SERVE_PORT) for p in c.get("ports", [])), c["ports"]


def test_network_policy_checks_can_fail(tmp_path: Path) -> None:
    text = (REPO / "k8s" / "rayjob-predict.yaml").read_text()
    for change, expected in [
        # the intra-cluster rule opened to every pod
        (lambda t: t.replace("  ingress:\n    - from:\n        - podSelector:\n            matchLabels: "
                             "{app.kubernetes.io/instance: raydeploy-predict}\n", "  ingress:\n    - {}\n", 1),
         "jax.distributed coordinator port 8476 open to a stranger pod"),
        # a policy that selects pods of another name: nothing isolates this cluster's pods
        (lambda t: t.replace("podSelector:\n    matchLabels: {app.kubernetes.io/instance: raydeploy-predict}",
                             "podSelector:\n    matchLabels: {app.kubernetes.io/instance: raydeploy-predic}"),
         "worker tpu-v5e-16: no NetworkPolicy selects it"),
        # the operator rule widened to every pod: the dashboard is open to all
        (lambda t: t.replace("matchLabels: {app.kubernetes.io/component: kuberay-operator}", "matchLabels: {}"),
         "head: dashboard port 8265 open to a stranger pod"),
        # the submitter's label lost: it cannot reach the dashboard
        (lambda t: t.replace("{app.kubernetes.io/instance: raydeploy-predict-submitter}\n", "{}\n", 1),
         "dashboard 8265 refused to the job's submitter"),
        # the worker pods' label lost: the hosts cannot reach each other
        (lambda t: t.replace("            labels: {app.kubernetes.io/instance: raydeploy-predict}\n", "", 1),
         "head: jax.distributed coordinator port 8476 refused to worker tpu-v5e-16 of the same cluster"),
    ]:
        changed = change(text)
        assert changed != text, expected
        (tmp_path / "rayjob-predict.yaml").write_text(changed)
        violations = "\n".join(_policy_violations(tmp_path / "rayjob-predict.yaml"))
        assert expected in violations, (expected, violations)

