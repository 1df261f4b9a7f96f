"""Gang fingerprint: every host must run the same config, code and checkpoint before the gang forms.

Each host computes a fingerprint made of named parts (its config minus host-specific bits, the engine geometry
the config implies, the checkpoint index fingerprint, the versions of raydeploy/jax/jaxlib/flax). Rank 0's parts are the reference; any
host whose parts differ is refused with an error naming the host and the part, so a node with a stale
checkpoint or a different library version cannot silently join and compute wrong answers.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from raydeploy.config import Config
from raydeploy.engine.geometry import EngineGeometry
from raydeploy.model.sharding import merge_rules

# Config keys that may legitimately differ between hosts (or that do not change what is computed).
HOST_SPECIFIC_KEYS = ("cluster.env", "cluster.coordinator_bind_address", "cluster.coordinator_port",
                      "cluster.ray_address", "engine.compilation_cache_dir", "model.load_threads", "serving")


class FingerprintMismatchError(RuntimeError):
    """Hosts disagree on config, code or checkpoint; the gang is refused."""

    def __init__(self, message: str) -> None:
        super().__init__(message)

    def __reduce__(self):
        return (FingerprintMismatchError, (str(self),))


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_part(cfg: Config) -> dict[str, Any]:
    d = cfg.to_dict()
    for dotted in HOST_SPECIFIC_KEYS:
        node = d
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.get(p, {})
        node.pop(last, None)
    return d


def geometry_part(cfg: Config) -> dict[str, Any]:
    """The engine geometry (`EngineGeometry`) the config gives this host: groups, slots, pages, step tokens,
    token buckets, admission limits. Computed before JAX starts, so without what the device decides (the page
    buckets of the attention backend, the KV dtype it resolves): those follow from the same config and code."""
    e, m = cfg.engine, cfg.model
    kv_dtype = m.dtype if e.kv_dtype == "auto" else e.kv_dtype
    g = EngineGeometry.create(e, m, cfg.mesh_shape, merge_rules(cfg.mesh.rules), cfg.cluster.platform, kv_dtype,
                              False).to_dict()
    for device_decided in ("page_buckets", "kv_dtype"):
        g.pop(device_decided)
    return g


def host_fingerprint(cfg: Config, checkpoint_fingerprint: str, versions: dict[str, str]) -> dict[str, str]:
    """Named parts, each a short digest; compare them with :func:`check_fingerprints`."""
    conf = config_part(cfg)
    parts = {f"config.{section}": _digest(conf.get(section)) for section in ("cluster", "mesh", "model", "engine")}
    parts["engine.geometry"] = _digest(geometry_part(cfg))
    parts["checkpoint"] = checkpoint_fingerprint
    parts.update({f"version.{k}": v for k, v in versions.items()})
    return parts


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("raydeploy", "jax", "jaxlib", "flax"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def check_fingerprints(fingerprints: list[dict[str, str]]) -> None:
    """Raise :class:`FingerprintMismatchError` if any host's parts differ from rank 0's."""
    ref = fingerprints[0]
    problems = []
    for rank, fp in enumerate(fingerprints[1:], start=1):
        for key in sorted(set(ref) | set(fp)):
            if ref.get(key) != fp.get(key):
                problems.append(f"host {rank} differs from host 0 in {key} ({fp.get(key)} != {ref.get(key)})")
    if problems:
        raise FingerprintMismatchError("gang refused, hosts do not run the same config/code/checkpoint: "
                                       + "; ".join(problems))
