"""The OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/models.

Bodies are read and strictly parsed by :mod:`raydeploy.serve.body`, validated with the pydantic models of
:mod:`raydeploy.serve.protocol`; a request's sampling fields go to `ServingCore.sampling` by name, which
takes what a request leaves out from `engine.sampling`. Structured outputs and forced tool calls become the
request's constraint (:mod:`raydeploy.serve.structured`, checked after admission on a tokenizer thread); chat
prompts render through the deployment's `ChatFormat` (or the request's own `chat_template`), which also splits
the answer into content, reasoning and tool calls (:mod:`raydeploy.serve.responses`). Fields the schema did not
know are named in the response's `X-Raydeploy-Ignored-Fields` header.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from raydeploy.constraints.spec import KINDS
from raydeploy.serve.chat import ChatFormat
from raydeploy.serve.errors import InvalidRequest
from raydeploy.serve.generation import Job, new_id
from raydeploy.serve.limits import Admission
from raydeploy.serve.protocol import ChatCompletionRequest, CompletionRequest
from raydeploy.serve.responses import ChatBuilder, CompletionBuilder, Echo
from raydeploy.serve.routes import lora
from raydeploy.serve.routes.shared import ServerInfo, ingress, json_body
from raydeploy.serve.structured import chat_constraint, output_constraint, tool_dicts

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

router = APIRouter()
router.include_router(lora.router)  # /v1/load_lora_adapter, /v1/unload_lora_adapter


@router.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
async def completions(request: Request) -> Response:
    arrived = time.perf_counter()
    ing = ingress(request)
    ing.authorize(request)
    body: CompletionRequest = await ing.read_body(request, CompletionRequest)
    headers = ing.ignored_headers(body, "/v1/completions")
    core = ing.core
    adapter = await lora.resolve_model(ing, body.model)
    items = _prompt_items(body.prompt)
    for item in items:
        if not isinstance(item, str):
            ing.check_ids(item, "prompt")
    _check_token_fields(ing, body)

    async def work(ticket: Admission) -> Response:
        constraint = await ing.off_loop(output_constraint, body)
        prompts = await ing.off_loop(_encode_prompts, items, core.codec, body.add_special_tokens)
        jobs = ing.make_jobs(prompts, body.n, max_tokens=body.max_tokens, prompt_param="prompt",
                             max_param="max_tokens", default_max=COMPLETIONS_DEFAULT_MAX_TOKENS,
                             **_job_args(body), request_id=new_id("cmpl"), constraint=constraint, adapter=adapter)
        top = body.logprobs or 0
        echo = None
        if body.echo:  # each prompt as sent (ids decoded), and its logprobs when logprobs are asked for
            texts = [item if isinstance(item, str) else core.codec.decode(ids, False)
                     for item, ids in zip(items, prompts, strict=True)]
            echo = Echo(tuple((t, tuple(ids)) for t, ids in zip(texts, prompts, strict=True)), body.n)
        _ask_logprobs(jobs, top, _prompt_alternatives(top if body.echo and body.logprobs is not None else None,
                                                      body.prompt_logprobs), body.logprobs is not None)
        builder = CompletionBuilder(jobs[0].request_id.rsplit("-", 1)[0], adapter or core.limits.model_name, core.codec,
                                    body.logprobs is not None, top_logprobs=top, echo=echo,
                                    prompt_logprobs=body.prompt_logprobs)
        builder.system_fingerprint = ing.info.fingerprint()
        return await ing.respond(ticket, jobs, builder, sum(len(p) for p in prompts), body.stream,
                                 body.stream_usage, arrived, headers)

    return await ing.admitted(len(items) * body.n, work)


@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
async def chat_completions(request: Request) -> Response:
    arrived = time.perf_counter()
    ing = ingress(request)
    ing.authorize(request)
    body: ChatCompletionRequest = await ing.read_body(request, ChatCompletionRequest)
    headers = ing.ignored_headers(body, "/v1/chat/completions")
    core = ing.core
    adapter = await lora.resolve_model(ing, body.model)
    if not body.messages:
        raise InvalidRequest("'messages' must hold at least one message", param="messages", code="empty_prompt")
    if not any(m.text().strip() or m.tool_calls for m in body.messages):
        raise InvalidRequest("'messages' has no text in any message", param="messages", code="empty_prompt")
    messages = [m.as_template_message() for m in body.messages]
    tools = tool_dicts(body) if body.tools_on else None
    _check_token_fields(ing, body)

    async def work(ticket: Admission) -> Response:
        constraint = await ing.off_loop(chat_constraint, body, ing.chat)
        prompt, ids = await ing.off_loop(ing.chat_ids, messages, body.add_generation_prompt, "messages", tools,
                                         body.chat_template_kwargs, body.chat_template, body.continue_final_message,
                                         body.add_special_tokens)
        jobs = ing.make_jobs([ids], body.n, max_tokens=body.token_limit, prompt_param="messages",
                             max_param=body.token_limit_param, default_max=None, **_job_args(body),
                             request_id=new_id("chatcmpl"), constraint=constraint, adapter=adapter)
        top = (body.top_logprobs or 0) if body.logprobs else 0
        _ask_logprobs(jobs, top, body.prompt_logprobs, body.logprobs)
        builder = ChatBuilder(jobs[0].request_id.rsplit("-", 1)[0], adapter or core.limits.model_name, core.codec,
                              body.logprobs, chat=ing.chat, tools=body.tools_on, prompt=prompt, top_logprobs=top,
                              prompt_logprobs=body.prompt_logprobs)
        builder.system_fingerprint = ing.info.fingerprint()
        return await ing.respond(ticket, jobs, builder, len(ids), body.stream, body.stream_usage, arrived, headers)

    return await ing.admitted(body.n, work)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    ing = ingress(request)
    ing.authorize(request)
    lim = ing.core.limits
    base = _model_card(lim.model_name, lim.max_seq_len, ing.info, ing.chat)
    return lora.json_models([base, *await lora.adapter_cards(ing, base)])


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> Response:
    ing = ingress(request)
    ing.authorize(request)
    adapter = await lora.resolve_model(ing, model_id)
    lim = ing.core.limits
    base = _model_card(lim.model_name, lim.max_seq_len, ing.info, ing.chat)
    if adapter is not None:
        return JSONResponse(next(c for c in await lora.adapter_cards(ing, base) if c["id"] == adapter))
    return JSONResponse(base)


def _sampling_args(body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """The request's sampling fields by name, as `ServingCore.sampling` (and `SamplingParams.resolve`) take them;
    None (or a neutral value) where the request leaves one out."""
    return {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
            "repetition_penalty": body.repetition_penalty, "seed": body.engine_seed,
            "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
            "min_p": body.min_p, "logit_bias": body.logit_bias_ids or None, "min_tokens": body.min_tokens or None}


def _job_args(body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """What `Ingress.make_jobs` takes from either kind of request besides its prompts and length."""
    return {"sampling_args": _sampling_args(body), "stop": body.stops or None, "stop_token_ids": body.stop_token_ids,
            "ignore_eos": body.ignore_eos, "timeout_s": body.timeout_s,
            "include_stop_str": body.include_stop_str_in_output, "skip_special_tokens": body.skip_special_tokens}


def _prompt_alternatives(*asked: int | None) -> int | None:
    """The prompt logprobs the gang computes: the most alternatives any part of the answer shows (an echo's
    `logprobs`, vLLM's `prompt_logprobs`), None when none shows prompt logprobs."""
    given = [k for k in asked if k is not None]
    return max(given) if given else None


def _ask_logprobs(jobs: list[Job], top: int, prompt: int | None, logprobs: bool) -> None:
    """Each job asks the gang for `top` alternatives per generated token and the prompt logprobs with `prompt`
    alternatives (None: none), as `raydeploy.engine.request.GenerationRequest` takes them; with `logprobs` the
    stop token that ends a choice comes back too (its logprob is part of the answer's, as lm-eval reads it)."""
    for job in jobs:
        job.top_logprobs, job.prompt_logprobs, job.logprobs = top, prompt, logprobs


def _check_token_fields(ing: Any, body: CompletionRequest | ChatCompletionRequest) -> None:
    """Token ids a request names (stop_token_ids, logit_bias's keys) against the model's vocabulary."""
    ing.check_ids(body.stop_token_ids or [], "stop_token_ids")
    ing.check_ids(sorted(body.logit_bias_ids), "logit_bias")


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


def _encode_prompts(items: list[str | list[int]], codec: Any, add_special_tokens: bool = True) -> list[list[int]]:
    """The prompts as ids (texts tokenized; run on a tokenizer thread)."""
    return [codec.encode(item, add_special_tokens) if isinstance(item, str) else [int(t) for t in item]
            for item in items]


def _model_card(name: str, max_seq_len: int, info: ServerInfo, chat: ChatFormat) -> dict[str, Any]:
    """The model as /v1/models shows it, with what this deployment does beyond text: the structured outputs it
    enforces (`response_format` json_schema/json_object, `structured_outputs` regex/choice/grammar too), tool
    calls and the format it parses them in, and whether reasoning goes to `reasoning_content`."""
    return {"id": name, "object": "model", "created": int(info.started_at), "owned_by": "raydeploy",
            "max_model_len": max_seq_len,
            "capabilities": {"structured_outputs": list(KINDS), "tool_calling": True,
                             "tool_choice": ["none", "auto", "required", "function"], "parallel_tool_calls": True,
                             "tool_parser": chat.tool_format, "tools_in_template": chat.template_has_tools,
                             "reasoning": chat.reasoning is not None}}
