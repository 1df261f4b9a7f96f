"""LoRA adapters over HTTP, as vLLM serves them: `model: <adapter name>` picks one, /v1/models lists them (with
`parent`, the base model), and `POST /v1/load_lora_adapter` {lora_name, lora_path} / `POST /v1/unload_lora_adapter`
{lora_name} manage them (behind the API key like every /v1 route; refused with a 400 when
`lora.allow_runtime_loading` is false or LoRA is off).

The adapters live in the gangs (`raydeploy.lora`; each gang's rank 0 owns its table): a load or unload goes to
the coordinator of every gang there is now, each of which sends it through its dispatcher to every host of its
gang between two steps, and to every gang's supervisor, so that a gang that restarts loads them again after
`lora.adapters` (a new replica, a new gang, loads only `lora.adapters`). The
ingress keeps the names the gangs know (`AdapterNames`) for model-name resolution and /v1/models: read again at
most every `NAMES_TTL_S`, and at once for a name it does not know, so an adapter loaded through another ingress
replica is found; a name no gang knows is a 404 naming it. A bad adapter file is a 400 naming the tensor or file
(`raydeploy.lora.peft.AdapterError`, from the gang's check before anything is sent to its hosts).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from raydeploy.lora.peft import AdapterError
from raydeploy.lora.slots import AdapterConflict, AdapterSlotsBusy, UnknownAdapter
from raydeploy.serve.errors import APIError, InvalidRequest, NotFound, ServiceUnavailable
from raydeploy.serve.routes.shared import ingress

NAMES_TTL_S = 2.0
"""Longest the ingress trusts its list of the gangs' adapter names."""
COMMAND_TIMEOUT_S = 120.0
"""Longest a load or unload may take in one gang (the step in flight, reading the adapter, writing its slot)."""

router = APIRouter()


class AdapterNames:
    """The adapter names the gangs know, read through the backend's gang directory (`GangDirectory`); see the
    module docstring."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.names: set[str] = set()
        self._read_at = -1e9

    def _directory(self) -> Any:
        directory = getattr(self.backend, "directory", None)
        if directory is None:
            raise ServiceUnavailable("this server's backend reaches no gang coordinators for LoRA adapters", None)
        return directory

    async def coordinators(self) -> list[Any]:
        """The rank-0 host actor of every gang there is now."""
        directory = self._directory()
        sups = list((await directory.handles()).values())
        refs = await asyncio.gather(*[asyncio.wait_for(_await(s.get_coordinator.remote()), directory.rpc_timeout_s)
                                      for s in sups], return_exceptions=True)
        return [r for r in refs if r is not None and not isinstance(r, BaseException)]

    async def refresh(self) -> set[str]:
        coords = await self.coordinators()
        timeout = self._directory().rpc_timeout_s
        lists = await asyncio.gather(*[asyncio.wait_for(_await(c.adapters.remote()), timeout) for c in coords],
                                     return_exceptions=True)
        self.names = {n for names in lists if isinstance(names, list) for n in names}
        self._read_at = time.monotonic()
        return self.names

    async def known(self, name: str | None = None) -> set[str]:
        """The known names, read again when stale or when `name` is not among them."""
        if time.monotonic() - self._read_at > NAMES_TTL_S or (name is not None and name not in self.names):
            await self.refresh()
        return self.names

    async def each(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every gang's coordinator; the first gang error raised (after every gang answered)."""
        coords = await self.coordinators()
        if not coords:
            raise ServiceUnavailable("no model gang is ready to change its LoRA adapters; retry shortly", 5.0)
        results = await asyncio.gather(*[asyncio.wait_for(_await(getattr(c, method).remote(*args)), COMMAND_TIMEOUT_S)
                                         for c in coords], return_exceptions=True)
        self._read_at = -1e9  # read the names again next time
        for r in results:
            if isinstance(r, BaseException):
                raise _http_error(r)
        return list(results)


    async def remember(self, name: str, path: str | None) -> None:
        """Tell every gang's supervisor that `name` was loaded from `path` (None: unloaded), so that a gang that
        restarts loads it again; a supervisor that does not answer in time is skipped (its gang then restarts
        with what it knew)."""
        directory = self._directory()
        sups = list((await directory.handles()).values())
        await asyncio.gather(*[asyncio.wait_for(_await(s.remember_adapter.remote(name, path)), directory.rpc_timeout_s)
                               for s in sups], return_exceptions=True)


async def _await(ref: Any) -> Any:
    return await ref


def _cause(e: BaseException) -> BaseException:
    """The gang's own exception inside a Ray task error (Ray raises a class derived from both)."""
    return getattr(e, "cause", None) or e


def _http_error(e: BaseException) -> APIError:
    c = _cause(e)
    if isinstance(e, APIError):
        return e
    if isinstance(c, UnknownAdapter):
        return NotFound(f"The lora adapter '{c.name}' does not exist", param="lora_name", code="model_not_found")
    for kind in (AdapterError, AdapterConflict):
        if isinstance(c, kind):
            return InvalidRequest(str(c), param="lora_path" if kind is AdapterError else "lora_name",
                                  code="invalid_value")
    if isinstance(c, AdapterSlotsBusy):
        return ServiceUnavailable(f"{c}; retry shortly", 5.0)
    if isinstance(e, TimeoutError):
        return ServiceUnavailable("a model gang did not change its LoRA adapters in time; retry shortly", 5.0)
    raise e


def adapter_names(ing: Any) -> AdapterNames:
    """The ingress's `AdapterNames` (made on first use)."""
    names = getattr(ing, "_adapter_names", None)
    if names is None:
        names = AdapterNames(ing.core.backend)
        ing._adapter_names = names
    return names


async def resolve_model(ing: Any, model: str | None) -> str | None:
    """The adapter a request's `model` names, None for the base model; 404 naming it when it is neither (with LoRA
    off, every other name is)."""
    core = ing.core
    if model is None or model == core.limits.model_name or not core.limits.lora:
        return core.check_model(model)
    return core.check_model(model, await adapter_names(ing).known(model))


def _runtime_loading(ing: Any) -> None:
    lora = ing.info.config.get("lora") or {}
    if not ing.core.limits.lora:
        raise InvalidRequest("this server serves no LoRA adapters (lora.max_adapters is 0)", code="invalid_value")
    if not lora.get("allow_runtime_loading", False):
        raise InvalidRequest("loading and unloading LoRA adapters at runtime is off on this server "
                             "(lora.allow_runtime_loading: false)", code="invalid_value")


def _name(body: dict[str, Any], key: str) -> str:
    v = body.get(key)
    if not isinstance(v, str) or not v.strip():
        raise InvalidRequest(f"'{key}' must be a non-empty string", param=key, code="invalid_value")
    return v


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    ing = ingress(request)
    ing.authorize(request)
    body = await ing.read_json(request)
    _runtime_loading(ing)
    name, path = _name(body, "lora_name"), _name(body, "lora_path")
    if name == ing.core.limits.model_name:
        raise InvalidRequest(f"'{name}' is the base model's name", param="lora_name", code="invalid_value")
    names = adapter_names(ing)
    await names.each("load_adapter", name, path)
    await names.remember(name, path)
    return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    ing = ingress(request)
    ing.authorize(request)
    body = await ing.read_json(request)
    _runtime_loading(ing)
    name = _name(body, "lora_name")
    names = adapter_names(ing)
    await names.each("unload_adapter", name)
    await names.remember(name, None)
    return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")


async def adapter_cards(ing: Any, base: dict[str, Any]) -> list[dict[str, Any]]:
    """/v1/models entries of the known adapters: vLLM's form, `parent` the base model."""
    if not ing.core.limits.lora:
        return []
    names = await adapter_names(ing).known()
    return [{"id": n, "object": "model", "created": base["created"], "owned_by": base["owned_by"],
             "root": n, "parent": base["id"], "max_model_len": base["max_model_len"]} for n in sorted(names)]


def json_models(cards: list[dict[str, Any]]) -> JSONResponse:
    return JSONResponse({"object": "list", "data": cards})
