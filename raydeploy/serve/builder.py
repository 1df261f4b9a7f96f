"""The Serve application builder for config-driven deploys (KubeRay RayService `serveConfigV2`,
`serve deploy`): `import_path: raydeploy.serve.builder:app_builder` with `args: {config: PATH}`.

Serve calls the builder in a task on the cluster; it loads the raydeploy config (optionally with
`overrides: ["a.b=value", ...]`), starts the gang supervisor detached (so it outlives the builder task)
and returns the bound ingress application. With `ready_timeout_s: SECONDS` (k8s/rayservice-*.yaml) each
ingress replica waits, bounded, for the gang to be ready before it serves, so the Serve application (and the
RayService) turns ready when the gang does.
"""

from __future__ import annotations

from typing import Any

from raydeploy.config import ConfigError, load_config


def app_builder(args: dict[str, Any]) -> Any:
    """Build the raydeploy Serve application from `{"config": PATH, "overrides": [...]}`."""
    from raydeploy.gang.gang import resolve_checkpoint_path, start_gang
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
    # build_serve_app checks the API key source before the gang starts
    app = build_serve_app(cfg, path, ready_timeout_s=None if ready_timeout_s is None else float(ready_timeout_s))
    start_gang(cfg, checkpoint_path=path, detached=True)
    return app
