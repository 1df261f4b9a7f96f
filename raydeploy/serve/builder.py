"""The Serve application builder for config-driven deploys (KubeRay RayService `serveConfigV2`,
`serve deploy`): `import_path: raydeploy.serve.builder:app_builder` with `args: {config: PATH}`.

Serve calls the builder in a task on the cluster; it loads the raydeploy config (optionally with
`overrides: ["a.b=value", ...]`), starts the gang supervisor detached (so it outlives the builder task)
and returns the bound ingress application. The HTTP app answers `/health` at once and `/ready` with 200
when the gang is ready, which is what the RayService pods' readiness probes ask.
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
    cfg = load_config(args["config"], list(args.get("overrides") or []))
    path = resolve_checkpoint_path(cfg)
    app = build_serve_app(cfg, path)  # checks the API key source before the gang starts
    start_gang(cfg, checkpoint_path=path, detached=True)
    return app
