"""The HTTP routes: OpenAI-compatible /v1, the old EasyDeL JAXServer /chat and /instruct, probes, status,
metrics and the chat page.

`create_app(server)` builds a FastAPI app over a `ServingCore` (which talks to the gang through a
`Backend`); the Ray Serve deployment and the unit tests (with an in-process fake backend) both use it.
Bodies are read and strictly parsed by :mod:`raydeploy.serve.body` (content type, size limit, JSON rules),
validated with the pydantic models of :mod:`raydeploy.serve.protocol`, and every failure goes through
:mod:`raydeploy.serve.errors`.

Nothing expensive happens before admission: a request's counts are bounded in validation, its token ids are
checked against the model's vocabulary, and its sequences (prompts x n, known before tokenizing) take their
capacity before any tokenizer or chat-template call. Tokenizing and templating run on a small thread pool, off
the event loop, so a long prompt never holds up /health or other requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from raydeploy.serve.auth import ApiKeyCheck
from raydeploy.serve.body import read_json_object
from raydeploy.serve.errors import (
    APIError,
    InvalidRequest,
    NotFound,
    Unauthorized,
    error_response,
    pydantic_error,
)
from raydeploy.serve.generation import Job, Piece, ServingCore, new_id
from raydeploy.serve.limits import Admission, FrontDoor, FrontDoorLimits
from raydeploy.serve.metrics import GangFigures
from raydeploy.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LegacyChatRequest,
    LegacyInstructRequest,
    TooMany,
)
from raydeploy.serve.redact import without_addresses
from raydeploy.serve.responses import SSE_DONE, ChatBuilder, CompletionBuilder, sse
from raydeploy.serve.text import ChatTemplateError

STATIC_DIR = Path(__file__).with_name("static")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
TOKENIZER_THREADS = 4
"""Threads that tokenize and apply chat templates (admitted requests only, so their queue is bounded too)."""


@dataclass
class ServerInfo:
    """What /status and /v1/models show beside the live figures."""

    config: dict[str, Any] = field(default_factory=dict)
    devices: int = 0
    process_count: int = 0
    mesh: dict[str, int] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)


def create_app(core: ServingCore, *, api_keys: ApiKeyCheck | None = None, max_body_bytes: int = 1_048_576,
               info: ServerInfo | None = None, cors_origins: list[str] | None = None,
               front_door: FrontDoorLimits | None = None, metrics_refresh_s: float = 5.0) -> FastAPI:
    app = FastAPI(title="raydeploy", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    keys = api_keys or ApiKeyCheck(())
    info = info or ServerInfo()
    codec, limits, metrics = core.codec, core.limits, core.metrics
    vocab_size = codec.vocab_size
    tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="raydeploy-tokenize")
    figures = GangFigures(core.backend, metrics_refresh_s)
    metrics.admitted.set_function(lambda: core.in_flight)
    app.state.front_door = None  # the middleware instance, built by Starlette when the app first runs

    def front_door_app(inner: Any) -> FrontDoor:
        app.state.front_door = FrontDoor(inner, front_door or FrontDoorLimits(), keys)
        return app.state.front_door

    # innermost of the middlewares: the counts below see its refusals; every request's admissions end with it
    app.add_middleware(front_door_app)

    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-API-Key"])

    # -- plumbing --------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return error_response(NotFound("no such route", code="not_found"))
        err = APIError(str(exc.detail), status=exc.status_code, code="http_error")
        return error_response(err)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        return error_response(exc)

    class _CountResponses:
        """Pure ASGI (no body buffering, so streaming and disconnects pass straight through)."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
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
                metrics.count_response(getattr(scope.get("route"), "path", "other"), status[0])

    app.add_middleware(_CountResponses)

    def authorize(request: Request) -> None:
        if not keys.allows(request.headers.get("authorization"), request.headers.get("x-api-key")):
            raise Unauthorized()

    async def read_body(request: Request, model: type[BaseModel]) -> Any:
        data = await read_json_object(request, max_body_bytes)
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e) from None

    def check_ids(ids: list[int], param: str) -> None:
        if ids and max(ids) >= vocab_size:
            bad = next(t for t in ids if t >= vocab_size)
            raise InvalidRequest(f"'{param}' holds token id {bad}, outside the vocabulary of this model ({vocab_size} "
                                 f"ids: 0 to {vocab_size - 1})", param=param, code="invalid_value")

    async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        """Tokenizer work, on the tokenizer threads."""
        return await asyncio.get_running_loop().run_in_executor(tokenizer_pool, fn, *args)

    def chat_ids(messages: list[dict[str, str]], add_generation_prompt: bool, param: str) -> tuple[str, list[int]]:
        """The rendered chat template and its ids (on a tokenizer thread); a template that refuses is a 400."""
        try:
            text = codec.chat_prompt(messages, add_generation_prompt)
        except ChatTemplateError as e:
            raise InvalidRequest(f"the model's chat template refused '{param}': {e}", param=param,
                                 code="invalid_chat_template") from None
        return text, codec.encode_chat(text)

    async def admitted(n_jobs: int, work: Callable[[Admission], Awaitable[Response]]) -> Response:
        """Take capacity for `n_jobs` sequences, then do `work` (tokenize, build jobs, answer): the one place a
        request is admitted. Every failure after admission gives the capacity back at once."""
        ticket = await core.admit(n_jobs)
        try:
            return await work(ticket)
        except BaseException:
            ticket.release()
            raise

    def make_jobs(prompts: list[list[int]], n: int, *, max_tokens: int | None, prompt_param: str,
                  max_param: str, default_max: int | None, sampling_args: dict[str, Any], stop: list[str] | None,
                  stop_token_ids: list[int] | None, ignore_eos: bool, timeout_s: float | None,
                  request_id: str) -> list[Job]:
        jobs = []
        seed = sampling_args.pop("seed", None)
        for p, ids in enumerate(prompts):
            mt = core.max_tokens_for(len(ids), max_tokens, prompt_param=prompt_param, max_param=max_param,
                                     default=default_max)
            for k in range(n):
                sp = core.sampling(**sampling_args, seed=None if seed is None else seed + k)
                jobs.append(Job(index=p * n + k, prompt_ids=ids, max_tokens=mt, sampling=sp, stop=stop or [],
                                stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=ignore_eos,
                                timeout_s=core.timeout_for(timeout_s), request_id=f"{request_id}-{p * n + k}"))
        return jobs

    async def respond(ticket: Admission, jobs: list[Job], builder: CompletionBuilder | ChatBuilder,
                      prompt_tokens: int, stream: bool, include_usage: bool, arrived: float) -> Response:
        if not stream:
            try:
                choices = await core.run_all(jobs, arrived)
            finally:
                ticket.release()
            return JSONResponse(builder.whole(choices, prompt_tokens))
        pieces = core.merged(jobs, arrived)
        try:
            first = await anext(pieces)  # errors before the first token still get their HTTP status
        except BaseException:
            ticket.release()
            await pieces.aclose()
            raise
        # released by the body's end, or (if the client left before the body started) by the response's close
        return StreamingResponse(_sse_body(first, pieces, builder, prompt_tokens, include_usage, ticket.release),
                                 media_type="text/event-stream", background=BackgroundTask(_close, ticket, pieces),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- OpenAI API ------------------------------------------------------------------------------------
    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        arrived = time.perf_counter()
        authorize(request)
        body: CompletionRequest = await read_body(request, CompletionRequest)
        core.check_model(body.model)
        items = _prompt_items(body.prompt)
        for item in items:
            if not isinstance(item, str):
                check_ids(item, "prompt")
        check_ids(body.stop_token_ids or [], "stop_token_ids")

        async def work(ticket: Admission) -> Response:
            prompts = await off_loop(_encode_prompts, items, codec)
            jobs = make_jobs(prompts, body.n, max_tokens=body.max_tokens, prompt_param="prompt",
                             max_param="max_tokens", default_max=COMPLETIONS_DEFAULT_MAX_TOKENS,
                             sampling_args=_sampling_args(body), stop=_stops(body),
                             stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
                             timeout_s=body.timeout_s, request_id=new_id("cmpl"))
            builder = CompletionBuilder(jobs[0].request_id.rsplit("-", 1)[0], limits.model_name, codec,
                                        body.logprobs is not None)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await respond(ticket, jobs, builder, sum(len(p) for p in prompts), body.stream, include_usage,
                                 arrived)

        return await admitted(len(items) * body.n, work)

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        arrived = time.perf_counter()
        authorize(request)
        body: ChatCompletionRequest = await read_body(request, ChatCompletionRequest)
        core.check_model(body.model)
        if not body.messages:
            raise InvalidRequest("'messages' must hold at least one message", param="messages", code="empty_prompt")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        if not any(m["content"].strip() for m in messages):
            raise InvalidRequest("'messages' has no text in any message", param="messages", code="empty_prompt")
        check_ids(body.stop_token_ids or [], "stop_token_ids")

        async def work(ticket: Admission) -> Response:
            _, ids = await off_loop(chat_ids, messages, body.add_generation_prompt, "messages")
            param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
            jobs = make_jobs([ids], body.n, max_tokens=body.token_limit, prompt_param="messages", max_param=param,
                             default_max=None, sampling_args=_sampling_args(body), stop=_stops(body),
                             stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
                             timeout_s=body.timeout_s, request_id=new_id("chatcmpl"))
            builder = ChatBuilder(jobs[0].request_id.rsplit("-", 1)[0], limits.model_name, codec, body.logprobs)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await respond(ticket, jobs, builder, len(ids), body.stream, include_usage, arrived)

        return await admitted(body.n, work)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [_model_card(limits.model_name, limits.max_seq_len, info)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        authorize(request)
        core.check_model(model_id)
        return JSONResponse(_model_card(limits.model_name, limits.max_seq_len, info))

    # -- the old EasyDeL JAXServer API -----------------------------------------------------------------
    async def legacy(messages: list[dict[str, str]], body: LegacyChatRequest | LegacyInstructRequest,
                     prompt_param: str, arrived: float) -> Response:
        async def work(ticket: Admission) -> Response:
            text, ids = await off_loop(chat_ids, messages, True, prompt_param)
            sampling_args = {"temperature": 0.0 if body.greedy else body.temperature, "top_p": body.top_p,
                             "top_k": body.top_k, "repetition_penalty": None}
            jobs = make_jobs([ids], 1, max_tokens=body.max_new_tokens, prompt_param=prompt_param,
                             max_param="max_new_tokens", default_max=None, sampling_args=sampling_args, stop=None,
                             stop_token_ids=None, ignore_eos=False, timeout_s=None, request_id=new_id("legacy"))
            try:
                (choice,) = await core.run_all(jobs, arrived)
            finally:
                ticket.release()
            return JSONResponse({"input": text, "response": choice.text, "tokens_used": len(choice.token_ids)})

        return await admitted(1, work)

    @app.post("/chat", openapi_extra=_json_body(LegacyChatRequest))
    async def legacy_chat(request: Request) -> Response:
        arrived = time.perf_counter()
        authorize(request)
        body: LegacyChatRequest = await read_body(request, LegacyChatRequest)
        if not body.prompt.strip():
            raise InvalidRequest("'prompt' must not be empty", param="prompt", code="empty_prompt")
        messages = [{"role": "system", "content": body.system}] if body.system else []
        for user, assistant in body.history:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        messages.append({"role": "user", "content": body.prompt})
        return await legacy(messages, body, "prompt", arrived)

    @app.post("/instruct", openapi_extra=_json_body(LegacyInstructRequest))
    async def legacy_instruct(request: Request) -> Response:
        arrived = time.perf_counter()
        authorize(request)
        body: LegacyInstructRequest = await read_body(request, LegacyInstructRequest)
        if not body.instruction.strip():
            raise InvalidRequest("'instruction' must not be empty", param="instruction", code="empty_prompt")
        messages = [{"role": "system", "content": body.system}] if body.system else []
        messages.append({"role": "user", "content": body.instruction})
        return await legacy(messages, body, "instruction", arrived)

    app.openapi = lambda: _openapi_schema(app)  # type: ignore[method-assign]

    # -- probes, status, metrics, page -----------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        st = await core.backend.state()  # "ready" while at least one gang is
        state = st.get("state", "unknown")
        gangs = {"ready_gangs": st.get("ready_gangs"), "total_gangs": st.get("total_gangs")}
        if state == "ready":
            return JSONResponse({"ready": True, "state": state, **gangs})
        headers = {} if state == "failed" else {"Retry-After": "5"}
        return JSONResponse({"ready": False, "state": state, "restarts": st.get("restarts"), **gangs,
                             "error": {"message": f"no model gang is ready (state {state})", "type": "server_error",
                                       "param": None, "code": "not_ready"}},
                            status_code=503, headers=headers)

    @app.get("/status")
    async def status(request: Request) -> Response:
        authorize(request)
        st = await core.backend.state()
        gang = await core.backend.status()
        _, stats, age_s = await figures.read_now()  # fresh for operators (a key guards /status); /metrics caches
        served = metrics.requests_served
        return JSONResponse(without_addresses({  # no coordinator ip:port, node IPs or addresses in errors
            "status": "Ready" if st.get("state") == "ready" else str(st.get("state", "unknown")).capitalize(),
            "state": st.get("state"), "restarts": st.get("restarts"), "last_error": st.get("last_error"),
            "ready_gangs": st.get("ready_gangs"), "total_gangs": st.get("total_gangs"),
            "model": limits.model_name, "config": info.config, "devices": info.devices,
            "process_count": info.process_count, "mesh": info.mesh,
            "uptime_s": round(time.time() - info.started_at, 3),
            "number_of_served_request_until_last_up_time": served, "requests_served": served,
            "serving": metrics.snapshot() | {"queue_capacity": limits.max_queue, "admitted": core.in_flight},
            "front_door": app.state.front_door.snapshot() if app.state.front_door else None,
            "engine": stats if st.get("state") == "ready" else {}, "engine_age_s": age_s, "gang": gang,
        }))

    @app.get("/metrics")
    async def prometheus() -> Response:
        st, stats, age_s = await figures.get()  # cached: a scrape never waits on a gang or takes its locks
        return PlainTextResponse(metrics.render(st, stats, age_s), media_type="text/plain; version=0.0.4")

    @app.get("/")
    async def page() -> Response:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    return app


async def _sse_body(first: tuple[int, list[Piece]], pieces: AsyncGenerator[tuple[int, list[Piece]], None],
                    builder: CompletionBuilder | ChatBuilder, prompt_tokens: int, include_usage: bool,
                    release: Callable[[], None]) -> AsyncIterator[str]:
    """The SSE stream: one event per piece (a token), the events of a batch (the tokens a gang step gave a job at
    once) in one body message, so the proxy and the connection handle one message per step, not per token."""
    n_tokens = 0

    def events(index: int, batch: list[Piece]) -> str:
        nonlocal n_tokens
        n_tokens += sum(p.token_id is not None for p in batch)
        return "".join(sse(builder.chunk(index, p, include_usage)) for p in batch)

    try:
        yield events(*first)
        try:
            async for index, batch in pieces:
                yield events(index, batch)
        except APIError as e:  # the status line is gone: the error travels as an SSE event
            yield sse(e.body())
            yield SSE_DONE
            return
        if include_usage:
            yield sse(builder.usage_chunk(prompt_tokens, n_tokens))
        yield SSE_DONE
    finally:
        release()
        await pieces.aclose()


async def _close(ticket: Admission, pieces: AsyncGenerator) -> None:
    """A stream's response is done, however it ended: its capacity back, its jobs closed (aborting any left)."""
    ticket.release()
    await pieces.aclose()


def _validation_error(e: ValidationError) -> InvalidRequest:
    for err in e.errors(include_url=False, include_input=False):
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, TooMany):
            where = ".".join(str(p) for p in err.get("loc", ()))
            return InvalidRequest(f"'{where}' {cause}", param=where, code="too_many_items")
        param = getattr(cause, "param", None)
        if param:
            return InvalidRequest(str(cause), param=param, code="unsupported_value")
    return pydantic_error(e)


def _sampling_args(body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    return {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
            "repetition_penalty": body.repetition_penalty, "seed": body.seed}


def _stops(body: CompletionRequest | ChatCompletionRequest) -> list[str] | None:
    """`body.stop` as validated: the field accepts a string, but `_check_stop` has made it a list."""
    return cast("list[str] | None", body.stop)


def _prompt_items(prompt: Any) -> list[str | list[int]]:
    """A completions `prompt` (text, texts, ids, or lists of ids) as a list of prompts, each a text or a list of
    ids, without tokenizing anything; an empty one is an error."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items or any(len(item) == 0 for item in items):
        raise InvalidRequest("'prompt' must not be empty", param="prompt", code="empty_prompt")
    return items


def _encode_prompts(items: list[str | list[int]], codec: Any) -> list[list[int]]:
    """The prompts as ids (texts tokenized; run on a tokenizer thread)."""
    return [codec.encode(item) if isinstance(item, str) else [int(t) for t in item] for item in items]


_BODY_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest, LegacyChatRequest,
                                             LegacyInstructRequest)
_SCHEMA_REF = "#/components/schemas/{model}"


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI requestBody of a route that reads `model` itself (see `read_body`), for GET /openapi.json."""
    ref = _SCHEMA_REF.format(model=model.__name__)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": ref}}}}}


def _openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema of the routes plus the request bodies' pydantic schemas under components."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi
        from pydantic.json_schema import models_json_schema

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                             description="OpenAI-compatible completions and chat, the EasyDeL JAXServer "
                                         "/chat and /instruct, probes, status and metrics.")
        _, defs = models_json_schema([(m, "validation") for m in _BODY_MODELS], ref_template=_SCHEMA_REF)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        app.openapi_schema = schema
    return app.openapi_schema


def _model_card(name: str, max_seq_len: int, info: ServerInfo) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(info.started_at), "owned_by": "raydeploy",
            "max_model_len": max_seq_len}
