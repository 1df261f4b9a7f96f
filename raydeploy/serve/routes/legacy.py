"""The old EasyDeL JAXServer API: /chat and /instruct, answered through the same admission, jobs and sampling
as the OpenAI routes (`greedy: true` is temperature 0; otherwise `engine.sampling` fills what a body leaves out)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from raydeploy.serve.errors import InvalidRequest
from raydeploy.serve.generation import new_id
from raydeploy.serve.limits import Admission
from raydeploy.serve.protocol import LegacyChatRequest, LegacyInstructRequest
from raydeploy.serve.routes.shared import Ingress, ingress, json_body

router = APIRouter()


@router.post("/chat", openapi_extra=json_body(LegacyChatRequest))
async def legacy_chat(request: Request) -> Response:
    arrived = time.perf_counter()
    ing = ingress(request)
    ing.authorize(request)
    body: LegacyChatRequest = await ing.read_body(request, LegacyChatRequest)
    if not body.prompt.strip():
        raise InvalidRequest("'prompt' must not be empty", param="prompt", code="empty_prompt")
    messages = [{"role": "system", "content": body.system}] if body.system else []
    for user, assistant in body.history:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    messages.append({"role": "user", "content": body.prompt})
    return await _answer(ing, messages, body, "prompt", arrived)


@router.post("/instruct", openapi_extra=json_body(LegacyInstructRequest))
async def legacy_instruct(request: Request) -> Response:
    arrived = time.perf_counter()
    ing = ingress(request)
    ing.authorize(request)
    body: LegacyInstructRequest = await ing.read_body(request, LegacyInstructRequest)
    if not body.instruction.strip():
        raise InvalidRequest("'instruction' must not be empty", param="instruction", code="empty_prompt")
    messages = [{"role": "system", "content": body.system}] if body.system else []
    messages.append({"role": "user", "content": body.instruction})
    return await _answer(ing, messages, body, "instruction", arrived)


async def _answer(ing: Ingress, messages: list[dict[str, str]], body: LegacyChatRequest | LegacyInstructRequest,
                  prompt_param: str, arrived: float) -> Response:
    async def work(ticket: Admission) -> Response:
        text, ids = await ing.off_loop(ing.chat_ids, messages, True, prompt_param)
        sampling_args = {"temperature": 0.0 if body.greedy else body.temperature, "top_p": body.top_p,
                         "top_k": body.top_k, "repetition_penalty": None}
        jobs = ing.make_jobs([ids], 1, max_tokens=body.max_new_tokens, prompt_param=prompt_param,
                             max_param="max_new_tokens", default_max=None, sampling_args=sampling_args, stop=None,
                             stop_token_ids=None, ignore_eos=False, timeout_s=None, request_id=new_id("legacy"))
        try:
            (choice,) = await ing.core.run_all(jobs, arrived)
        finally:
            ticket.release()
        return JSONResponse({"input": text, "response": choice.text, "tokens_used": len(choice.token_ids)})

    return await ing.admitted(1, work)
