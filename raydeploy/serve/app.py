"""The HTTP app: OpenAI-compatible /v1, the old EasyDeL JAXServer /chat and /instruct, probes, status, metrics
and the chat page, assembled from their routers.

`create_app(core)` builds a FastAPI app over a `ServingCore` (which talks to the gang through a `Backend`); the
Ray Serve deployment and the unit tests (with an in-process fake backend) both use it. The routes live in
:mod:`raydeploy.serve.routes`: `openai` (/v1), `tokens` (/tokenize, /detokenize, /version), `legacy` (/chat,
/instruct) and `ops` (probes, /status, /metrics, the page), sharing one `Ingress` (`routes.shared`: the core, keys, body limit, tokenizer threads, and
the deployment's `ChatFormat`, built once here: `chat_format_for`).
This module adds what wraps every route: the front door (`raydeploy.serve.limits`), CORS, the response
counts, and the error mapping (every failure an OpenAI-shaped JSON error, `raydeploy.serve.errors`). Nothing
here imports JAX.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from raydeploy.config import Config
from raydeploy.serve.auth import ApiKeyCheck
from raydeploy.serve.chat import ChatFormat
from raydeploy.serve.errors import APIError, NotFound, error_response
from raydeploy.serve.generation import ServingCore
from raydeploy.serve.limits import FrontDoor, FrontDoorLimits
from raydeploy.serve.metrics import GangFigures, ServingMetrics
from raydeploy.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LegacyChatRequest,
    LegacyInstructRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from raydeploy.serve.routes import legacy, openai, ops, tokens
from raydeploy.serve.routes.shared import IGNORED_FIELDS_HEADER, SCHEMA_REF, Ingress, ServerInfo
from raydeploy.serve.text import TextCodec, configured_chat_template

__all__ = ["DEFAULT_CORS_HEADERS", "DEFAULT_CORS_METHODS", "ServerInfo", "chat_format_for", "create_app"]

DEFAULT_CORS_METHODS = ["GET", "POST", "OPTIONS"]
"""Methods a browser may use across origins when `serving.cors_allow_methods` is not set."""
DEFAULT_CORS_HEADERS = ["Authorization", "Content-Type", "X-API-Key", "OpenAI-Organization", "OpenAI-Project",
                        "OpenAI-Beta", "X-Stainless-Lang", "X-Stainless-Package-Version", "X-Stainless-OS",
                        "X-Stainless-Arch", "X-Stainless-Runtime", "X-Stainless-Runtime-Version",
                        "X-Stainless-Retry-Count", "X-Stainless-Timeout", "X-Stainless-Async",
                        "X-Stainless-Helper-Method", "X-Stainless-Poll-Helper", "X-Stainless-Custom-Poll-Interval"]
"""Request headers a browser may send across origins by default: the openai JS SDK's (its `X-Stainless-*`
telemetry and retry headers, sent on every request), keys and JSON."""

log = logging.getLogger("raydeploy.serve")


def create_app(core: ServingCore, *, api_keys: ApiKeyCheck | None = None, max_body_bytes: int = 1_048_576,
               info: ServerInfo | None = None, cors_origins: list[str] | None = None,
               front_door: FrontDoorLimits | None = None, metrics_refresh_s: float = 5.0,
               chat: ChatFormat | None = None, cors_allow_headers: list[str] | None = None,
               cors_allow_methods: list[str] | None = None) -> FastAPI:
    """The app over `core`. `chat`: the deployment's chat format (`chat_format_for`); None takes the codec's
    template with the fallback tool format, as for a model of unknown family. CORS is on when `cors_origins`
    names any; `cors_allow_headers` / `cors_allow_methods` (`*` allowed) default to `DEFAULT_CORS_HEADERS` /
    `DEFAULT_CORS_METHODS`, which let the openai JS SDK's preflight through."""
    app = FastAPI(title="raydeploy", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    keys = api_keys or ApiKeyCheck(())
    app.state.ingress = Ingress(core, keys, max_body_bytes, info or ServerInfo(),
                                GangFigures(core.backend, metrics_refresh_s),
                                chat or ChatFormat.create(core.codec, None))
    core.metrics.admitted.set_function(lambda: core.in_flight)
    app.state.front_door = None  # the middleware instance, built by Starlette when the app first runs

    def front_door_app(inner: Any) -> FrontDoor:
        app.state.front_door = FrontDoor(inner, front_door or FrontDoorLimits(), keys)
        return app.state.front_door

    # innermost of the middlewares: the counts below see its refusals; every request's admissions end with it
    app.add_middleware(front_door_app)
    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=cors_origins,
                           allow_methods=cors_allow_methods or DEFAULT_CORS_METHODS,
                           allow_headers=cors_allow_headers or DEFAULT_CORS_HEADERS,
                           expose_headers=[IGNORED_FIELDS_HEADER, "Retry-After"])
    app.add_middleware(CountResponses, metrics=core.metrics)

    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)

    for module in (openai, tokens, legacy, ops):
        app.include_router(module.router)
    app.openapi = lambda: _openapi_schema(app)  # type: ignore[method-assign]
    return app


def chat_format_for(cfg: Config, checkpoint_dir: str | Path, codec: TextCodec) -> ChatFormat:
    """The deployment's chat format: the checkpoint's model_type (config.json) picks the family's tool-call and
    reasoning formats, `model.tool_parser` / `model.reasoning_parser` override them. `model.chat_template` (a
    file or inline Jinja) replaces the tokenizer's template first (`codec.use_chat_template`), so the format and
    every route render with it. A ValueError names a parser the template cannot serve, or a template file that
    is not there."""
    template = getattr(cfg.model, "chat_template", None)
    if template:
        try:
            codec.use_chat_template(configured_chat_template(template, cfg.source))
        except ValueError as e:
            raise ValueError(f"model.chat_template {e}") from None
    return ChatFormat.create(codec, checkpoint_model_type(checkpoint_dir),
                             tool_parser=getattr(cfg.model, "tool_parser", "auto"),
                             reasoning_parser=getattr(cfg.model, "reasoning_parser", "auto"))


def checkpoint_model_type(checkpoint_dir: str | Path) -> str | None:
    """`model_type` of the checkpoint's config.json (None when it has none: the chat format falls back)."""
    path = Path(checkpoint_dir) / "config.json"
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        log.warning("no model_type in %s (%s); tool calls use the fallback format", path.name, type(e).__name__)
        return None
    return model_type if isinstance(model_type, str) else None


class CountResponses:
    """Counts every response by route and status (pure ASGI: no body buffering, so streaming and disconnects pass
    straight through)."""

    def __init__(self, inner: Any, metrics: ServingMetrics) -> None:
        self.inner = inner
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.inner(scope, receive, send)
            return
        status = [500]

        async def send_and_note(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.inner(scope, receive, send_and_note)
        finally:
            self.metrics.count_response(getattr(scope.get("route"), "path", "other"), status[0])


async def _api_error(_: Request, exc: Exception) -> Response:
    return error_response(exc)


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        return error_response(NotFound("no such route", code="not_found"))
    return error_response(APIError(str(exc.detail), status=exc.status_code, code="http_error"))


async def _unexpected(_: Request, exc: Exception) -> Response:
    return error_response(exc)


_BODY_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest,
                                             TokenizeChatRequest, DetokenizeRequest, LegacyChatRequest,
                                             LegacyInstructRequest)


def _openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema of the routes plus the request bodies' pydantic schemas under components."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi
        from pydantic.json_schema import models_json_schema

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                             description="OpenAI-compatible completions and chat, the EasyDeL JAXServer "
                                         "/chat and /instruct, probes, status and metrics.")
        _, defs = models_json_schema([(m, "validation") for m in _BODY_MODELS], ref_template=SCHEMA_REF)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        app.openapi_schema = schema
    return app.openapi_schema
