"""What the routers share: the `Ingress` an app's routes work with (the serving core, keys, body limit, the
tokenizer threads, the gang figures), and the steps every generating route takes.

Nothing expensive happens before admission: a request's counts are bounded in validation, its token ids are
checked against the model's vocabulary, and its sequences (prompts x n, known before tokenizing) take their
capacity (`Ingress.admitted`) before any tokenizer or chat-template call. Tokenizing and templating run on a
small thread pool, off the event loop, so a long prompt never holds up /health or other requests.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from raydeploy.checkpoint.reader import CheckpointReader
from raydeploy.config import Config
from raydeploy.constraints.spec import Constraint
from raydeploy.gang.fingerprint import config_part
from raydeploy.serve.auth import ApiKeyCheck
from raydeploy.serve.body import read_json_object
from raydeploy.serve.chat import ChatFormat
from raydeploy.serve.chat.format import template_renders_tools
from raydeploy.serve.errors import APIError, InvalidRequest, Unauthorized, pydantic_error
from raydeploy.serve.generation import Job, Piece, ServingCore
from raydeploy.serve.limits import Admission
from raydeploy.serve.metrics import GangFigures
from raydeploy.serve.protocol import TooMany
from raydeploy.serve.responses import SSE_DONE, ChatBuilder, CompletionBuilder, sse, usage
from raydeploy.serve.text import ChatTemplateError

log = logging.getLogger("raydeploy.serve")

TOKENIZER_THREADS = 4
"""Threads that tokenize and apply chat templates (admitted requests only, so their queue is bounded too)."""
IGNORED_FIELDS_HEADER = "X-Raydeploy-Ignored-Fields"
"""Response header naming the request's fields this server did not know and ignored."""
MAX_IGNORED_HEADER_CHARS = 512
SEED_SPACE = 2**64
"""Seeds wrap around here (choice k of a seeded request is seed + k)."""


def system_fingerprint(cfg: Config, checkpoint_dir: str | Path) -> str:
    """OpenAI's `system_fingerprint`: a short digest of what decides the outputs, the gang's config (without its
    host-specific and serving keys, as the gang's own fingerprint takes it) and the checkpoint's fingerprint (its
    index and config.json, as every host computes it). It changes when the model or the engine's configuration
    does, so a client can tell two deployments apart; the ingress computes it once (no JAX, no weights read)."""
    checkpoint = CheckpointReader(checkpoint_dir).fingerprint()
    blob = json.dumps({"config": config_part(cfg), "checkpoint": checkpoint}, sort_keys=True, default=str)
    return "fp_" + hashlib.sha256(blob.encode()).hexdigest()[:12]


@dataclass
class ServerInfo:
    """What /status and /v1/models show beside the live figures."""

    config: dict[str, Any] = field(default_factory=dict)
    devices: int = 0
    process_count: int = 0
    mesh: dict[str, int] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    system_fingerprint: str = ""
    """`system_fingerprint(cfg, checkpoint)`; empty: a digest of `config` stands in."""

    def fingerprint(self) -> str:
        """The `system_fingerprint` of every completion and chunk."""
        if self.system_fingerprint:
            return self.system_fingerprint
        blob = json.dumps(self.config, sort_keys=True, default=str)
        return "fp_" + hashlib.sha256(blob.encode()).hexdigest()[:12]


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
        return self.validate_body(await self.read_json(request), model)

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object, read within the body limit (`raydeploy.serve.body`)."""
        return await read_json_object(request, self.max_body_bytes)

    def validate_body(self, data: dict[str, Any], model: type[BaseModel]) -> Any:
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None

    def ignored_headers(self, body: Any, route: str) -> dict[str, str]:
        """The header naming the fields of `body` this server did not know (and a debug log line); none when
        every field was known. Bounded: at most `MAX_IGNORED_HEADER_CHARS` characters, cut at a name."""
        names = body.ignored_fields()
        if not names:
            return {}
        log.debug("%s: ignored unknown fields %s", route, ", ".join(names))
        value = ""
        for name in names:
            safe = "".join(ch for ch in name if ch.isascii() and ch.isprintable() and ch != ",")[:64]
            if len(value) + len(safe) + 1 > MAX_IGNORED_HEADER_CHARS:
                value += ",..."
                break
            value = f"{value},{safe}" if value else safe
        return {IGNORED_FIELDS_HEADER: value}

    def check_ids(self, ids: Any, param: str) -> None:
        vocab_size = self.core.codec.vocab_size
        if ids and max(ids) >= vocab_size:
            bad = next(t for t in ids if t >= vocab_size)
            raise InvalidRequest(f"'{param}' holds token id {bad}, outside the vocabulary of this model ({vocab_size} "
                                 f"ids: 0 to {vocab_size - 1})", param=param, code="invalid_value")

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Tokenizer work, on the tokenizer threads."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    def chat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool, param: str,
                 tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None,
                 chat_template: str | None = None, continue_final_message: bool = False,
                 add_special_tokens: bool = False) -> tuple[str, list[int]]:
        """The rendered chat template (through the chat format: the model's template, or the request's own
        `chat_template`, with `tools` shown to the model when given) and its ids, on a tokenizer thread; a
        template that refuses (or fails to parse) is a 400 with its message."""
        codec = self.core.codec
        chat = self.chat
        if chat_template is not None or continue_final_message:
            has_tools = template_renders_tools(chat_template) if chat_template is not None \
                else chat.template_has_tools
            chat = ChatFormat(codec.rendering(chat_template, continue_final_message), chat.tool_format,
                              chat.reasoning, has_tools)
        whose = "the request's 'chat_template'" if chat_template is not None else "the model's chat template"
        try:
            text = chat.render(messages, tools, add_generation_prompt, template_kwargs)
        except ChatTemplateError as e:
            raise InvalidRequest(f"{whose} refused '{param}': {e}", param=param,
                                 code="invalid_chat_template") from None
        return text, codec.encode_chat(text, add_special_tokens)

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
                  request_id: str, constraint: Constraint | None = None, include_stop_str: bool = False,
                  skip_special_tokens: bool = True, adapter: str | None = None) -> list[Job]:
        """`n` jobs per prompt, each with its sampling (`ServingCore.sampling`: the request's values over
        `engine.sampling`; choice k of a seeded request is seeded seed + k, modulo 2**64) and the request's
        constraint."""
        core = self.core
        jobs = []
        seed = sampling_args.pop("seed", None)
        for p, ids in enumerate(prompts):
            mt = core.max_tokens_for(len(ids), max_tokens, prompt_param=prompt_param, max_param=max_param,
                                     default=default_max)
            for k in range(n):
                sp = core.sampling(**sampling_args, seed=None if seed is None else (seed + k) % SEED_SPACE)
                jobs.append(Job(index=p * n + k, prompt_ids=ids, max_tokens=mt, sampling=sp, stop=stop or [],
                                stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=ignore_eos,
                                timeout_s=core.timeout_for(timeout_s), request_id=f"{request_id}-{p * n + k}",
                                constraint=constraint, include_stop_str=include_stop_str,
                                skip_special_tokens=skip_special_tokens, adapter=adapter))
        return jobs

    async def respond(self, ticket: Admission, jobs: list[Job], builder: CompletionBuilder | ChatBuilder,
                      prompt_tokens: int, stream: bool, stream_usage: tuple[bool, bool], arrived: float,
                      headers: dict[str, str] | None = None) -> Response:
        """The answer: one JSON body once every job is done, or an SSE stream (errors before the first token
        keep their HTTP status). `stream_usage`: (a last chunk with the usage, the usage so far on every chunk).
        `headers`: added to the response (the ignored fields)."""
        core = self.core
        leaders = _leaders(jobs)
        if not stream:
            try:
                choices = await core.run_all(jobs, arrived)
            finally:
                ticket.release()
            cached = sum(c.cached_tokens or 0 for c in choices if c.index in leaders)
            return JSONResponse(builder.whole(choices, prompt_tokens, cached), headers=headers)
        pieces = core.merged(jobs, arrived)
        try:
            first = await anext(pieces)  # errors before the first token still get their HTTP status
        except BaseException:
            ticket.release()
            await pieces.aclose()
            raise
        # released by the body's end, or (if the client left before the body started) by the response's close
        body = _sse_body(first, pieces, builder, _StreamUsage(prompt_tokens, leaders, *stream_usage), ticket.release)
        return StreamingResponse(body, media_type="text/event-stream", background=BackgroundTask(_close, ticket, pieces),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})


def _leaders(jobs: list[Job]) -> set[int]:
    """The index of each prompt's first job: its prompt is counted (and its cached tokens) once, not n times."""
    seen: dict[int, int] = {}
    for j in jobs:
        seen.setdefault(id(j.prompt_ids), j.index)
    return set(seen.values())


@dataclass
class _StreamUsage:
    """A stream's token counts, for its usage chunks."""

    prompt_tokens: int
    leaders: set[int]
    final: bool
    """A last chunk with the whole request's usage (`include_usage`)."""
    continuous: bool
    """The usage so far on every chunk (vLLM's `continuous_usage_stats`)."""
    completion_tokens: int = 0
    cached_tokens: int = 0

    def note(self, index: int, batch: list[Piece]) -> None:
        self.completion_tokens += sum(p.token_id is not None for p in batch)
        if index in self.leaders:
            self.cached_tokens += sum(p.cached_tokens or 0 for p in batch)

    def now(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


def ingress(request: Request) -> Ingress:
    """The serving state of the app that received `request` (set by `create_app`)."""
    return request.app.state.ingress


async def _sse_body(first: tuple[int, list[Piece]], pieces: AsyncGenerator[tuple[int, list[Piece]], None],
                    builder: CompletionBuilder | ChatBuilder, counts: _StreamUsage,
                    release: Callable[[], None]) -> AsyncIterator[str]:
    """The SSE stream: one event per piece (a token), the events of a batch (the tokens a gang step gave a job at
    once) in one body message, so the proxy and the connection handle one message per step, not per token."""
    with_usage = counts.final or counts.continuous

    def events(index: int, batch: list[Piece]) -> str:
        out = []
        for piece in batch:
            counts.note(index, [piece])
            so_far = counts.now() if counts.continuous else None
            for chunk in builder.chunks(index, piece, with_usage):
                if so_far is not None:
                    chunk["usage"] = so_far
                out.append(sse(chunk))
        return "".join(out)

    try:
        yield events(*first)
        try:
            async for index, batch in pieces:
                yield events(index, batch)
        except APIError as e:  # the status line is gone: the error travels as an SSE event
            yield sse(e.body())
            yield SSE_DONE
            return
        if with_usage:
            yield sse(builder.usage_chunk(counts.now()))
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
