"""The Ray Serve binding: one light ingress deployment (no JAX, num_cpus=0) that serves `create_app`.

Each replica loads the tokenizer saved in the checkpoint directory, finds the gang supervisor by name, and
builds the FastAPI app at replica start (`__serve_build_asgi_app__`), so the app holds live objects
(backend, codec, metrics) rather than being pickled. `build_serve_app(cfg, checkpoint_dir)` returns the
bound application for `serve.run`.

With `ready_timeout_s` (the RayService path, `raydeploy.serve.builder`), each replica's constructor waits,
bounded, until the gang is ready: Serve then reports the application RUNNING only once the gang can serve, and
KubeRay marks the RayService ready (and moves traffic to a new cluster during an upgrade) only then. Without
it (`raydeploy serve`), HTTP answers at once and `/ready` tells when the gang is ready.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

from ray import serve

from raydeploy.config import Config
from raydeploy.serve.app import ServerInfo, create_app
from raydeploy.serve.auth import ApiKeyCheck, load_api_keys
from raydeploy.serve.backend import GangBackend
from raydeploy.serve.generation import Limits, ServingCore
from raydeploy.serve.metrics import ServingMetrics
from raydeploy.serve.text import TextCodec

log = logging.getLogger("raydeploy.serve")

APP_NAME = "raydeploy"
DEPLOYMENT_NAME = "raydeploy-ingress"


def model_name(cfg: Config, checkpoint_dir: str | Path) -> str:
    return cfg.model.name or Path(checkpoint_dir).name


def public_config(cfg: Config) -> dict[str, Any]:
    """The config as /status shows it: no key material, and key sources only as 'set'."""
    d = cfg.to_dict()
    s = d["serving"]
    for k in ("api_keys_env", "api_keys_file"):
        s[k] = "set" if s.get(k) else None
    d["cluster"]["env"] = sorted(d["cluster"].get("env") or {})  # names only: values may be secrets
    return d


@serve.deployment(name=DEPLOYMENT_NAME, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024,
                  health_check_period_s=10, graceful_shutdown_timeout_s=30)
@serve.ingress()
class ServeIngress:
    def __init__(self, cfg: Config, checkpoint_dir: str, ready_timeout_s: float | None = None) -> None:
        if ready_timeout_s is not None:
            wait_for_gang(cfg, ready_timeout_s)
        codec = TextCodec.from_dir(checkpoint_dir)
        keys = ApiKeyCheck(load_api_keys(cfg.serving))
        backend = GangBackend(rpc_timeout_s=min(cfg.cluster.rpc_timeout_s, 30.0))
        name = model_name(cfg, checkpoint_dir)
        self.core = ServingCore(backend, codec, Limits.from_config(cfg, name), ServingMetrics())
        info = ServerInfo(config=public_config(cfg), devices=cfg.total_devices, process_count=cfg.cluster.num_hosts,
                          mesh=cfg.mesh_shape)
        self._fastapi = create_app(self.core, api_keys=keys, max_body_bytes=cfg.serving.max_body_bytes, info=info,
                                   cors_origins=cfg.serving.cors_origins)
        log.info("raydeploy ingress ready: model %s, API keys %s", name, "on" if keys.enabled else "off")

    def __serve_build_asgi_app__(self) -> Any:
        return self._fastapi


def wait_for_gang(cfg: Config, timeout_s: float) -> dict[str, Any]:
    """Block until the gang supervisor reports `ready`; GangError on `failed`/`stopped` or after `timeout_s`."""
    import ray

    from raydeploy.gang.gang import Gang
    from raydeploy.serve.backend import NAMESPACE, SUPERVISOR_NAME

    log.info("raydeploy ingress waits up to %.0f s for the gang to be ready", timeout_s)
    return Gang(ray.get_actor(SUPERVISOR_NAME, namespace=NAMESPACE), cfg).wait_ready(timeout_s, poll_s=1.0)


def build_serve_app(cfg: Config, checkpoint_dir: str | Path, *, ready_timeout_s: float | None = None) -> Any:
    """The bound Serve application (pass to `serve.run(app, name=APP_NAME, route_prefix="/")`).

    `ready_timeout_s`: each replica starts serving only once the gang is ready (waiting at most that long)."""
    load_api_keys(cfg.serving)  # fail in the driver, with the config key named, before any replica starts
    # the decorators made the class a Deployment; mypy keeps the type of a decorated class
    ingress = cast(serve.Deployment, ServeIngress)
    return ingress.options(num_replicas=cfg.serving.ingress_replicas).bind(cfg, str(checkpoint_dir), ready_timeout_s)
