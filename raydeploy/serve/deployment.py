"""The Ray Serve binding: a light HTTP ingress deployment over a deployment of gang replicas.

- `raydeploy-gangs` (raydeploy.serve.replica.GangReplica): each replica owns one gang in a placement group
  Serve reserves for it (`placement_group_bundles`: one bundle per host). Its count follows the config's
  `replicas` section: `min == max` runs exactly that many; otherwise Serve's autoscaler moves it between them
  on ongoing requests per gang (`target_ongoing_requests`). `max_ongoing_requests` is the gang's slot count,
  so the admitted requests beyond the free slots wait in Serve's router for the first free slot of any gang
  (admission itself is the ingress's `ServingCore`, from `Limits`: the requests beyond what the gangs can hold
  wait in the ingress, not here); its custom part (raydeploy.serve.routing) sends requests only to gangs that
  are ready.
- `raydeploy-ingress` (no JAX, num_cpus=0) serves `create_app` behind the front door of
  raydeploy.serve.limits (body-read deadline, a bound on the requests it holds, waiting ones included, the
  per-key limit; Serve's `max_ongoing_requests` for it is that bound plus room for probes): each replica loads
  the tokenizer saved in the checkpoint directory, holds a DeploymentHandle to the gangs and a directory of their
  supervisors (raydeploy.gang.directory), and builds the FastAPI app at replica start
  (`__serve_build_asgi_app__`).

`build_serve_app(cfg, checkpoint_dir)` returns the bound application for `serve.run`. With `ready_timeout_s`
(the RayService path, `raydeploy.serve.builder`), each gang replica's constructor waits, bounded, until its
gang is ready: Serve reports the application RUNNING only then, and KubeRay marks the RayService ready (and
moves traffic to a new cluster during an upgrade) only then. Without it (`raydeploy serve`), HTTP answers at
once and `/ready` turns 200 when the first gang is ready.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import ray
from ray import serve

from raydeploy.config import Config, ConfigError
from raydeploy.serve.app import ServerInfo, chat_format_for, create_app
from raydeploy.serve.auth import ApiKeyCheck, load_api_keys
from raydeploy.serve.backend import ReplicaBackend
from raydeploy.serve.generation import Limits, ServingCore
from raydeploy.serve.limits import PROBE_HEADROOM, FrontDoorLimits, ingress_bound
from raydeploy.serve.metrics import ServingMetrics, multiprocess_env
from raydeploy.serve.routes.shared import system_fingerprint
from raydeploy.serve.text import TextCodec

if TYPE_CHECKING:
    from raydeploy.gang.engines import EngineSource

log = logging.getLogger("raydeploy.serve")

APP_NAME = "raydeploy"
DEPLOYMENT_NAME = "raydeploy-ingress"
GANG_DEPLOYMENT_NAME = "raydeploy-gangs"


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
    def __init__(self, cfg: Config, checkpoint_dir: str, gangs: Any) -> None:
        from raydeploy.gang.directory import GangDirectory

        codec = TextCodec.from_dir(checkpoint_dir)
        keys = ApiKeyCheck(load_api_keys(cfg.serving))
        app_name = serve.get_replica_context().app_name
        backend = ReplicaBackend(gangs, GangDirectory(app_name, rpc_timeout_s=min(cfg.cluster.rpc_timeout_s, 30.0)))
        name = model_name(cfg, checkpoint_dir)
        self.core = ServingCore(backend, codec, Limits.from_config(cfg, name), ServingMetrics())
        info = ServerInfo(config=public_config(cfg), devices=cfg.total_devices, process_count=cfg.cluster.num_hosts,
                          mesh=cfg.mesh_shape, system_fingerprint=system_fingerprint(cfg, checkpoint_dir))
        self._fastapi = create_app(self.core, api_keys=keys, max_body_bytes=cfg.serving.max_body_bytes, info=info,
                                   cors_origins=cfg.serving.cors_origins, cors_allow_headers=cfg.serving.cors_allow_headers,
                                   cors_allow_methods=cfg.serving.cors_allow_methods,
                                   front_door=FrontDoorLimits.from_config(cfg),
                                   metrics_refresh_s=cfg.serving.metrics_refresh_s,
                                   chat=chat_format_for(cfg, checkpoint_dir, codec))
        log.info("raydeploy ingress ready: model %s, API keys %s", name, "on" if keys.enabled else "off")

    def __serve_build_asgi_app__(self) -> Any:
        return self._fastapi


def gang_deployment_options(cfg: Config) -> dict[str, Any]:
    """Serve options of the gang deployment, from the config: placement, replica count or autoscaling,
    admission (slots per replica, the router's queue), health checks and routing."""
    from raydeploy.compat import serve_request_router
    from raydeploy.gang.placement import host_bundles, pins_tpu_slice, placement_strategy
    from raydeploy.serve.routing import ReadyGangRouter

    r, limits = cfg.replicas, Limits.from_config(cfg, "")
    opts: dict[str, Any] = {
        "name": GANG_DEPLOYMENT_NAME,
        "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": limits.max_slots,
        # a backstop only, counted at each caller (each ingress replica's handle): an ingress admits at most
        # max_slots per ready gang + max_queue and Serve counts a request as queued until it is assigned, so a
        # burst that fits is never refused here (the requests beyond wait at the ingress, not here)
        "max_queued_requests": cfg.serving.ingress_replicas * (limits.max_queue + limits.max_slots * r.max),
        # a replica stopped by downscaling first finishes its requests (each bounded by request_timeout_s)
        "graceful_shutdown_timeout_s": limits.request_timeout_s + 30.0,
        "graceful_shutdown_wait_loop_s": 1.0,
        "health_check_period_s": r.health_check_period_s,
        "health_check_timeout_s": max(30.0, r.health_check_period_s),
        "request_router_config": serve_request_router().RequestRouterConfig(
            request_router_class=ReadyGangRouter, request_routing_stats_period_s=r.routing_stats_period_s,
            request_routing_stats_timeout_s=max(10.0, 2 * r.routing_stats_period_s)),
    }
    if not pins_tpu_slice(cfg.cluster):  # a TPU slice is pinned by the replica's supervisor (head first)
        bundles = host_bundles(cfg.cluster)
        empty = [i for i, b in enumerate(bundles) if not any(v > 0 for v in b.values())]
        if empty:
            raise ConfigError("a gang replica's placement group needs resources in every host bundle: set "
                              "cluster.host_num_cpus > 0 or cluster.host_resources", file=cfg.source,
                              key="cluster.host_num_cpus")
        opts["placement_group_bundles"] = bundles
        opts["placement_group_strategy"] = placement_strategy(cfg.cluster)
    if r.min == r.max and r.initial in (None, r.min):
        opts["num_replicas"] = r.min
    else:
        auto: dict[str, Any] = {
            "min_replicas": r.min, "max_replicas": r.max, "initial_replicas": r.initial,
            "target_ongoing_requests": r.target_ongoing_requests or float(limits.max_slots),
            "upscale_delay_s": r.upscale_delay_s, "downscale_delay_s": r.downscale_delay_s,
            "look_back_period_s": r.look_back_period_s}
        if r.upscaling_factor is not None:
            auto["upscaling_factor"] = r.upscaling_factor
        if r.downscaling_factor is not None:
            auto["downscaling_factor"] = r.downscaling_factor
        opts["autoscaling_config"] = auto
    return opts


def build_serve_app(cfg: Config, checkpoint_dir: str | Path, *, ready_timeout_s: float | None = None,
                    engine: str | EngineSource = "real") -> Any:
    """The bound Serve application (pass to `serve.run(app, name=APP_NAME, route_prefix="/")`): the ingress
    over the gang replicas.

    `ready_timeout_s`: each gang replica starts serving only once its gang is ready (waiting at most that long).
    engine "toy" runs the gangs' stand-in engine (no weights; the checkpoint still gives the tokenizer); tests
    inject faults into every gang replica's first gang with an engine source (raydeploy.testing.faults)."""
    keys = load_api_keys(cfg.serving)  # fail in the driver, with the config key named, before any replica starts
    if cfg.serving.max_concurrent_per_key and not keys:
        raise ConfigError("a per-key limit needs API keys: set serving.api_keys_env or serving.api_keys_file",
                          file=cfg.source, key="serving.max_concurrent_per_key")
    from raydeploy.gang.gang import check_engine
    from raydeploy.serve.replica import GangReplica

    source = check_engine(engine)
    gang_replica = cast(serve.Deployment, serve.deployment(GangReplica))  # a class becomes a Deployment
    gangs = gang_replica.options(**gang_deployment_options(cfg)).bind(
        cfg, str(checkpoint_dir) if source.reads_checkpoint else None, source, ready_timeout_s)
    # the decorators made the class a Deployment; mypy keeps the type of a decorated class
    ingress = cast(serve.Deployment, ServeIngress)
    # the front door refuses beyond ingress_bound at once (503), and that bound holds the admitted requests, the
    # line of those waiting for room (serving.max_waiting) and the bodies being read: Serve's own cap is above it,
    # so a burst of a thousand prompts waits in the ingress, and probes and the refusals themselves are never
    # queued in the proxy. The proxy's queue for the ingress is bounded too (it fills only if every ingress
    # replica is stuck): memory stays bounded whatever the load.
    bound = ingress_bound(cfg)
    # every ingress replica of this run writes its counters and histograms to one directory per node
    # (prometheus_client's multiprocess mode), so /metrics from any replica adds up all of them
    job_env = dict((ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}) if ray.is_initialized() else {}
    metrics_env = multiprocess_env(APP_NAME, {**os.environ, **job_env})
    actor_options = {"num_cpus": 0, "runtime_env": {"env_vars": metrics_env}}
    return ingress.options(num_replicas=cfg.serving.ingress_replicas, max_ongoing_requests=bound + PROBE_HEADROOM,
                           max_queued_requests=bound, ray_actor_options=actor_options).bind(
        cfg, str(checkpoint_dir), gangs)
