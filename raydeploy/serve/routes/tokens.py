"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, and GET /version.

Clients (lm-eval-harness, benchmark tools) probe them to count a prompt's tokens against the context, or to
turn ids back into text, with the deployment's own tokenizer and chat template. /tokenize takes either a text
`prompt` (tokenized as /v1/completions tokenizes it) or `messages` (rendered as /v1/chat/completions renders
them, tools and template options included); the answer is `{count, max_model_len, tokens, token_strs}`. The
routes take the API key as /v1 does; the work runs on the tokenizer threads, never on the event loop.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from raydeploy.serve.errors import InvalidRequest
from raydeploy.serve.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from raydeploy.serve.routes import lora
from raydeploy.serve.routes.shared import Ingress, ingress, json_body
from raydeploy.serve.structured import tool_dicts

router = APIRouter()


def server_version() -> str:
    """raydeploy's installed version ("unknown" when run from a tree that is not installed)."""
    try:
        return version("raydeploy")
    except PackageNotFoundError:
        return "unknown"


@router.post("/tokenize", openapi_extra=json_body(TokenizeCompletionRequest))
async def tokenize(request: Request) -> Response:
    ing = ingress(request)
    ing.authorize(request)
    data = await ing.read_json(request)
    model = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
    body: Any = ing.validate_body(data, model)
    headers = ing.ignored_headers(body, "/tokenize")
    await lora.resolve_model(ing, body.model)  # an adapter shares the base model's tokenizer
    codec = ing.core.codec
    if isinstance(body, TokenizeChatRequest):
        if not body.messages:
            raise InvalidRequest("'messages' must hold at least one message", param="messages", code="empty_prompt")
        messages = [m.as_template_message() for m in body.messages]
        tools = tool_dicts(body) if body.tools else None  # type: ignore[arg-type]
        _, ids = await ing.off_loop(ing.chat_ids, messages, body.add_generation_prompt, "messages", tools,
                                    body.chat_template_kwargs, body.chat_template, body.continue_final_message,
                                    body.add_special_tokens)
    else:
        ids = await ing.off_loop(codec.encode, body.prompt, body.add_special_tokens)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": ing.core.limits.max_seq_len, "tokens": ids,
                           "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = await ing.off_loop(_token_strs, ing, ids)
    return JSONResponse(out, headers=headers)


@router.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
async def detokenize(request: Request) -> Response:
    ing = ingress(request)
    ing.authorize(request)
    body: DetokenizeRequest = await ing.read_body(request, DetokenizeRequest)
    headers = ing.ignored_headers(body, "/detokenize")
    await lora.resolve_model(ing, body.model)  # an adapter shares the base model's tokenizer
    ing.check_ids(body.tokens, "tokens")
    text = await ing.off_loop(ing.core.codec.decode, body.tokens, False)
    return JSONResponse({"prompt": text}, headers=headers)


@router.get("/version")
async def server_version_route(request: Request) -> Response:
    ingress(request).authorize(request)
    return JSONResponse({"version": server_version()})


def _token_strs(ing: Ingress, ids: list[int]) -> list[str]:
    tok = ing.core.codec.tokenizer
    return [str(t) for t in tok.convert_ids_to_tokens(ids)]
