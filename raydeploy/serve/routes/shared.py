"""What the routers share: the `Ingress` an app's routes work with (the serving core, keys, body limit, the
tokenizer threads, the gang figures), and the steps every generating route takes.

Nothing expensive happens before admission: a request's counts are bounded in validation, its token ids are
checked against the model's vocabulary, and its sequences (prompts x n, known before tokenizing) take their
capacity (`Ingress.admitted`) before any tokenizer or chat-template call. Tokenizing and templating run on a
small thread pool, off the event loop, so a long prompt never holds up /health or other requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from raydeploy.constraints.spec import Constraint
from raydeploy.serve.auth import ApiKeyCheck
from raydeploy.serve.body import read_json_object
from raydeploy.serve.chat import ChatFormat
from raydeploy.serve.errors import APIError, InvalidRequest, Unauthorized, pydantic_error
from raydeploy.serve.generation import Job, Piece, ServingCore
from raydeploy.serve.limits import Admission
from raydeploy.serve.metrics import GangFigures
from raydeploy.serve.protocol import TooMany
from raydeploy.serve.responses import SSE_DONE, ChatBuilder, CompletionBuilder, sse
from raydeploy.serve.text import ChatTemplateError

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


@dataclass
class Ingress:
    """One app's serving state, as its routes see it (`app.state.ingress`; `ingress(request)`)."""

    core: ServingCore
    keys: ApiKeyCheck
    max_body_bytes: int
    info: ServerInfo
    figures: GangFigures
    chat: ChatFormat
    """How this deployment's model chats: its template (with tools), its tool-call and reasoning formats."""
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="raydeploy-tokenize"))

    def authorize(self, request: Request) -> None:
        if not self.keys.allows(request.headers.get("authorization"), request.headers.get("x-api-key")):
            raise Unauthorized()

    async def read_body(self, request: Request, model: type[BaseModel]) -> Any:
        data = await read_json_object(request, self.max_body_bytes)
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None

    def check_ids(self, ids: list[int], param: str) -> None:
        vocab_size = self.core.codec.vocab_size
        if ids and max(ids) >= vocab_size:
            bad = next(t for t in ids if t >= vocab_size)
            raise InvalidRequest(f"'{param}' holds token id {bad}, outside the vocabulary of this model ({vocab_size} "
                                 f"ids: 0 to {vocab_size - 1})", param=param, code="invalid_value")

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Tokenizer work, on the tokenizer threads."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    def chat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool, param: str,
                 tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None
                 ) -> tuple[str, list[int]]:
        """The rendered chat template (through the chat format: the model's template, with `tools` shown to the
        model when given) and its ids, on a tokenizer thread; a template that refuses is a 400."""
        codec = self.core.codec
        try:
            text = self.chat.render(messages, tools, add_generation_prompt, template_kwargs)
        except ChatTemplateError as e:
            raise InvalidRequest(f"the model's chat template refused '{param}': {e}", param=param,
                                 code="invalid_chat_template") from None
        return text, codec.encode_chat(text)

    async def admitted(self, n_jobs: int, work: Callable[[Admission], Awaitable[Response]]) -> Response:
        """Take capacity for `n_jobs` sequences, then do `work` (tokenize, build jobs, answer): the one place a
        request is admitted. Every failure after admission gives the capacity back at once."""
        ticket = await self.core.admit(n_jobs)
        try:
            return await work(ticket)
        except BaseException:
            ticket.release()
            raise

    def make_jobs(self, prompts: list[list[int]], n: int, *, max_tokens: int | None, prompt_param: str,
                  max_param: str, default_max: int | None, sampling_args: dict[str, Any], stop: list[str] | None,
                  stop_token_ids: list[int] | None, ignore_eos: bool, timeout_s: float | None,
                  request_id: str, constraint: Constraint | None = None) -> list[Job]:
        """`n` jobs per prompt, each with its sampling (`ServingCore.sampling`: the request's values over
        `engine.sampling`; choice k of a seeded request is seeded seed + k) and the request's constraint."""
        core = self.core
        jobs = []
        seed = sampling_args.pop("seed", None)
        for p, ids in enumerate(prompts):
            mt = core.max_tokens_for(len(ids), max_tokens, prompt_param=prompt_param, max_param=max_param,
                                     default=default_max)
            for k in range(n):
                sp = core.sampling(**sampling_args, seed=None if seed is None else seed + k)
                jobs.append(Job(index=p * n + k, prompt_ids=ids, max_tokens=mt, sampling=sp, stop=stop or [],
                                stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=ignore_eos,
                                timeout_s=core.timeout_for(timeout_s), request_id=f"{request_id}-{p * n + k}",
                                constraint=constraint))
        return jobs

    async def respond(self, ticket: Admission, jobs: list[Job], builder: CompletionBuilder | ChatBuilder,
                      prompt_tokens: int, stream: bool, include_usage: bool, arrived: float) -> Response:
        """The answer: one JSON body once every job is done, or an SSE stream (errors before the first token
        keep their HTTP status)."""
        core = self.core
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


def ingress(request: Request) -> Ingress:
    """The serving state of the app that received `request` (set by `create_app`)."""
    return request.app.state.ingress


async def _sse_body(first: tuple[int, list[Piece]], pieces: AsyncGenerator[tuple[int, list[Piece]], None],
                    builder: CompletionBuilder | ChatBuilder, prompt_tokens: int, include_usage: bool,
                    release: Callable[[], None]) -> AsyncIterator[str]:
    """The SSE stream: one event per piece (a token), the events of a batch (the tokens a gang step gave a job at
    once) in one body message, so the proxy and the connection handle one message per step, not per token."""
    n_tokens = 0

    def events(index: int, batch: list[Piece]) -> str:
        nonlocal n_tokens
        n_tokens += sum(p.token_id is not None for p in batch)
        return "".join(sse(chunk) for p in batch for chunk in builder.chunks(index, p, include_usage))

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


def validation_error(e: ValidationError) -> InvalidRequest:
    for err in e.errors(include_url=False, include_input=False):
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, TooMany):
            where = ".".join(str(p) for p in err.get("loc", ()))
            return InvalidRequest(f"'{where}' {cause}", param=where, code="too_many_items")
        param = getattr(cause, "param", None)
        if param:
            return InvalidRequest(str(cause), param=param, code=getattr(cause, "code", "unsupported_value"))
    return pydantic_error(e)


SCHEMA_REF = "#/components/schemas/{model}"


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI requestBody of a route that reads `model` itself (`Ingress.read_body`), for GET /openapi.json."""
    ref = SCHEMA_REF.format(model=model.__name__)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": ref}}}}}
