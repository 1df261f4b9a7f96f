"""The Serve application builder for config-driven deploys (KubeRay RayService `serveConfigV2`,
`serve deploy`): `import_path: raydeploy.serve.builder:app_builder` with `args: {config: PATH}`.

Serve calls the builder in a task on the cluster; it loads the raydeploy config (optionally with
`overrides: ["a.b=value", ...]`) and returns the bound application: the ingress over the gang replicas, each
of which starts its own gang in the placement group Serve reserves for it (the config's `replicas` section
sets how many). With `ready_timeout_s: SECONDS` (k8s/rayservice-*.yaml) each gang replica waits, bounded,
for its gang to be ready before it serves, so the Serve application (and the RayService) turns ready when
the gangs do.
"""

from __future__ import annotations

from typing import Any

from raydeploy.config import ConfigError, load_config


def app_builder(args: dict[str, Any]) -> Any:
    """Build the raydeploy Serve application from `{"config": PATH, "overrides": [...]}`."""
    from raydeploy.gang.gang import resolve_checkpoint_path
    from raydeploy.serve.deployment import build_serve_app

    if not isinstance(args, dict) or not isinstance(args.get("config"), str):
        raise ConfigError(f"the Serve application args must be {{config: PATH}}, found {args!r}")
    ready_timeout_s = args.get("ready_timeout_s")
    if ready_timeout_s is not None and (isinstance(ready_timeout_s, bool) or not isinstance(ready_timeout_s, int | float)
                                        or ready_timeout_s <= 0):
        raise ConfigError(f"the Serve application arg ready_timeout_s must be a number of seconds > 0, "
                          f"found {ready_timeout_s!r}")
    cfg = load_config(args["config"], list(args.get("overrides") or []))
    path = resolve_checkpoint_path(cfg)
    # build_serve_app checks the API key source before any gang starts
    return build_serve_app(cfg, path, ready_timeout_s=None if ready_timeout_s is None else float(ready_timeout_s))
