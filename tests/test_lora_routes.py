"""The LoRA adapter routes (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`) over real HTTP (uvicorn on
loopback, the real tokenizer) in front of an in-process fake gang, where no gang is needed to answer: a server
with `lora.allow_runtime_loading: false` refuses both with a 400 naming that setting (before any gang is asked),
one with LoRA off says so, and without the API key both are a 401. The loads that reach real gangs are in
test_lora_serve_e2e.py."""

from __future__ import annotations

import httpx
import pytest
from serve_fakes import FakeBackend, ThreadedServer, tokenizer_dir

from raydeploy.config import load_config
from raydeploy.serve.app import ServerInfo, create_app
from raydeploy.serve.auth import ApiKeyCheck
from raydeploy.serve.generation import Limits, ServingCore
from raydeploy.serve.text import TextCodec

KEY = "sk-lora-routes-5a1e"
AUTH = {"Authorization": f"Bearer {KEY}"}
LOAD = {"lora_name": "alpha", "lora_path": "/adapters/alpha"}


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_dir(tokenizer_dir())


def _served(codec: TextCodec, sets: list[str]) -> tuple[ThreadedServer, FakeBackend]:
    cfg = load_config(None, ["model.max_seq_len=128", *sets])
    backend = FakeBackend(codec.encode(" Hello."), codec.eos_token_ids[0])
    core = ServingCore(backend, codec, Limits.from_config(cfg, "smollm2-135m-instruct"))
    app = create_app(core, api_keys=ApiKeyCheck((KEY,)),
                     info=ServerInfo(config={"lora": {"max_adapters": cfg.lora.max_adapters,
                                                      "allow_runtime_loading": cfg.lora.allow_runtime_loading}},
                                     devices=2, process_count=2, mesh={"dp": 2}))
    return ThreadedServer(app), backend


@pytest.mark.parametrize("route,body", [("load_lora_adapter", LOAD), ("unload_lora_adapter", {"lora_name": "alpha"})])
def test_runtime_loading_off_is_refused_naming_the_setting(codec, route, body):
    server, backend = _served(codec, ["lora.max_adapters=2", "lora.allow_runtime_loading=false"])
    with server:
        r = httpx.post(f"{server.url}/v1/{route}", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "lora.allow_runtime_loading" in err["message"] and err["code"] == "invalid_value", err
        assert httpx.post(f"{server.url}/v1/{route}", json=body, timeout=30).status_code == 401  # the key first
    assert backend.submits == 0


def test_lora_off_says_so(codec):
    server, _ = _served(codec, [])
    with server:
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json=LOAD, headers=AUTH, timeout=30)
    assert r.status_code == 400 and "lora.max_adapters is 0" in r.json()["error"]["message"], r.text
