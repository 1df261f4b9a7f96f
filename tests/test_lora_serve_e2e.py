"""LoRA adapters end to end, as users call them: the embedded default gang shape (2 host processes with a virtual
CPU device each, dp=2, real jax.distributed), the real SmolLM2 demo model, Ray Serve HTTP, and PEFT adapters made
on transformers' float32 copy of the same model (random non-zero B; one rank 8 on every projection, preloaded by
`lora.adapters`, one rank 4 on q/k/v/o, loaded over HTTP).

- Each adapter's greedy tokens through HTTP equal PEFT's (over the steps whose top-1/top-2 gap is not a near tie),
  and /v1/models lists both with the base model as parent.
- Load, use, unload and reload while a base-model stream runs: the stream's text equals the same request run
  alone, the unloaded adapter is a 404 naming it, the reloaded one answers as before; no gang restart.
- A bad adapter file is a 400 naming the tensor; an unknown model a 404 naming it; the load route needs the key.
- The prefix cache keeps adapters apart: a prompt cached under one adapter is cached again under the other, and
  reused under the first.

One deployment is shared by every test of this module.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import threading
import time

import httpx
import pytest
from live_http import free_port, live_serving

from raydeploy.config import load_config

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = [pytest.mark.ray, pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

KEY = "sk-lora-7c2d"
KEYS_ENV = "RAYDEPLOY_LORA_E2E_API_KEYS"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "smollm2-135m-instruct"
READY_TIMEOUT_S = 900
STEPS = 24
PROMPT = "The three most useful things to know about the ocean are"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PRECISION = ("engine.cpu_matmul=xla", "engine.kv_dtype=auto")
"""The engine's float32 paths, as transformers computes (the default's native CPU matmul and float16 KV cache
round differently)."""


def make_adapter(base, dst, rank: int, targets: list[str], seed: int):
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0)
    model = peft.get_peft_model(copy.deepcopy(base), cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(dst)
    return model


def greedy(model, ids: list[int], steps: int) -> tuple[list[int], int]:
    """PEFT/transformers greedy tokens and how many leading steps are clear of near ties."""
    from hf_reference import hf_greedy, trusted_steps

    toks, gaps = hf_greedy(model, ids, steps)
    return toks, trusted_steps(gaps)


@pytest.fixture(scope="module")
def adapters(demo_hf, tmp_path_factory):
    model, tok = demo_hf
    tmp = tmp_path_factory.mktemp("lora-e2e")
    ids = [int(i) for i in tok(PROMPT)["input_ids"]]
    out = {"ids": ids, "dirs": {}, "refs": {}}
    for name, rank, targets, seed in (("alpha", 8, ALL, 1), ("beta", 4, ALL[:4], 2)):
        out["dirs"][name] = tmp / name
        out["refs"][name] = greedy(make_adapter(model, tmp / name, rank, targets, seed), ids, STEPS)
    out["refs"]["base"] = greedy(model, ids, STEPS)
    # a bad adapter: beta's files with one tensor of the wrong shape
    bad = tmp / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((tmp / "beta" / "adapter_config.json").read_text())
    tensors = safetensors_torch.load_file(str(tmp / "beta" / "adapter_model.safetensors"))
    name = next(k for k in sorted(tensors) if k.endswith("layers.3.self_attn.k_proj.lora_A.weight"))
    tensors[name] = torch.zeros(4, 100)
    safetensors_torch.save_file(tensors, str(bad / "adapter_model.safetensors"))
    out["bad"], out["bad_tensor"] = bad, name
    return out


@pytest.fixture(scope="module")
def live(demo_checkpoint, adapters):
    os.environ[KEYS_ENV] = KEY  # before Ray starts: the ingress replica reads it
    cfg = load_config(None, [*PRECISION, "model.max_seq_len=512", "engine.max_new_tokens=200", "engine.max_slots=4",
                             "lora.max_adapters=2", "lora.max_rank=8", "lora.allow_runtime_loading=true",
                             f"lora.adapters={{alpha: {adapters['dirs']['alpha']}}}", f"serving.port={free_port()}",
                             f"serving.api_keys_env={KEYS_ENV}", "serving.request_timeout_s=600",
                             "cluster.heartbeat_timeout_s=5", "cluster.restart_backoff_s=0.5",
                             "cluster.max_restarts=2"])
    with live_serving(cfg, str(demo_checkpoint), "rdl", READY_TIMEOUT_S) as serving:
        yield serving


def complete(live, model: str, ids: list[int], max_tokens: int = STEPS, **extra) -> dict:
    r = httpx.post(f"{live.url}/v1/completions", headers=AUTH, timeout=600,
                   json={"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def text(body: dict) -> str:
    return body["choices"][0]["text"]


def check_tokens(body: dict, ref: tuple[list[int], int], tok) -> None:
    """The answer starts with the reference's greedy tokens up to its first near tie (decoded: byte-level BPE
    decodes a prefix of the tokens to a prefix of the text)."""
    want, trusted = ref
    assert trusted >= 8, "the reference has a near tie too early to compare"
    assert text(body).startswith(tok.decode(want[:trusted])), (text(body), tok.decode(want))


def admin(live, route: str, body: dict, auth: bool = True) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/{route}", headers=AUTH if auth else {}, json=body, timeout=600)


def test_preloaded_adapter_matches_peft_and_models_lists_it(live, adapters, demo_hf):
    ids, tok = adapters["ids"], demo_hf[1]
    body = complete(live, "alpha", ids)
    assert body["model"] == "alpha"
    check_tokens(body, adapters["refs"]["alpha"], tok)
    check_tokens(complete(live, MODEL, ids), adapters["refs"]["base"], tok)
    models = httpx.get(f"{live.url}/v1/models", headers=AUTH, timeout=60).json()["data"]
    assert [m["id"] for m in models] == [MODEL, "alpha"]
    assert models[1]["parent"] == MODEL
    assert adapters["refs"]["alpha"][0] != adapters["refs"]["base"][0]  # the adapter changes the answer


def test_load_use_unload_reload_while_a_stream_runs(live, adapters, demo_hf):
    ids, tok = adapters["ids"], demo_hf[1]
    alone = complete(live, MODEL, ids, max_tokens=160)["choices"][0]["text"]
    restarts = live.gangs.state()["restarts"]
    streamed: dict = {}

    def stream() -> None:
        with httpx.stream("POST", f"{live.url}/v1/completions", headers=AUTH, timeout=600,
                          json={"model": MODEL, "prompt": ids, "max_tokens": 160, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as r:
            streamed["text"] = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                                       if line.startswith("data: {"))

    t = threading.Thread(target=stream)
    t.start()
    r = admin(live, "load_lora_adapter", {"lora_name": "beta", "lora_path": str(adapters["dirs"]["beta"])})
    assert r.status_code == 200, r.text
    first = complete(live, "beta", ids)
    check_tokens(first, adapters["refs"]["beta"], tok)
    assert admin(live, "unload_lora_adapter", {"lora_name": "beta"}).status_code == 200
    gone = httpx.post(f"{live.url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": "beta", "prompt": ids, "max_tokens": 4})
    assert gone.status_code == 404 and "beta" in gone.json()["error"]["message"]
    r = admin(live, "load_lora_adapter", {"lora_name": "beta", "lora_path": str(adapters["dirs"]["beta"])})
    assert r.status_code == 200, r.text
    again = complete(live, "beta", ids)
    assert text(again) == text(first)
    t.join(600)
    assert not t.is_alive()
    assert streamed["text"] == alone  # the stream beside the loads and unloads changed in nothing
    assert live.gangs.state()["restarts"] == restarts  # no restart


def test_errors_name_the_adapter_and_the_tensor(live, adapters):
    r = httpx.post(f"{live.url}/v1/completions", headers=AUTH, timeout=60,
                   json={"model": "no-such-adapter", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404 and "no-such-adapter" in r.json()["error"]["message"], r.text
    r = admin(live, "load_lora_adapter", {"lora_name": "bad", "lora_path": str(adapters["bad"])})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert adapters["bad_tensor"] in msg and "[4, 100]" in msg, msg
    assert admin(live, "load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}, auth=False).status_code == 401
    r = admin(live, "load_lora_adapter", {"lora_name": "alpha", "lora_path": str(adapters["dirs"]["alpha"])})
    assert r.status_code == 400 and "'alpha' has already been loaded" in r.json()["error"]["message"], r.text
    r = admin(live, "unload_lora_adapter", {"lora_name": "no-such-adapter"})
    assert r.status_code == 404 and "no-such-adapter" in r.json()["error"]["message"], r.text
    models = [m["id"] for m in httpx.get(f"{live.url}/v1/models", headers=AUTH, timeout=60).json()["data"]]
    assert "bad" not in models  # a refused adapter is not known


def test_prefix_cache_keeps_adapters_apart(live, adapters):
    """A long prompt cached under the base model is not reused under alpha, nor alpha's under a third adapter;
    each reuses its own."""
    ids = adapters["ids"] * 6  # several full pages

    def cached(model: str) -> int:
        return complete(live, model, ids, max_tokens=2)["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(MODEL) == 0
    assert cached(MODEL) > 0  # the same prompt under the same model reuses its pages
    assert cached("alpha") == 0
    assert cached("alpha") > 0
    r = admin(live, "load_lora_adapter", {"lora_name": "gamma", "lora_path": str(adapters["dirs"]["beta"])})
    assert r.status_code == 200, r.text
    assert cached("gamma") == 0


def test_a_restarted_gang_loads_again_the_adapters_loaded_at_runtime(live, adapters):
    """Last in the module (it restarts the gang): an adapter loaded over HTTP outlives a host's death. The gang's
    supervisor remembers it, the restarted gang lists it and answers with it exactly as before, with no second
    load; one unloaded before the death stays unknown."""
    ids = adapters["ids"]
    for name in ("delta", "epsilon"):
        r = admin(live, "load_lora_adapter", {"lora_name": name, "lora_path": str(adapters["dirs"]["beta"])})
        assert r.status_code == 200, r.text
    before = text(complete(live, "delta", ids))
    assert admin(live, "unload_lora_adapter", {"lora_name": "epsilon"}).status_code == 200
    restarts = live.gangs.state()["restarts"]
    (gang,) = live.gangs.state()["gangs"]
    pids = [h["pid"] for h in gang["hosts"]]
    assert len(pids) == 2 and all(pids), gang["hosts"]
    os.kill(int(pids[1]), signal.SIGKILL)
    deadline = time.monotonic() + 120
    while live.gangs.state()["restarts"] == restarts:
        assert time.monotonic() < deadline, "the gang did not notice its dead host"
        time.sleep(0.5)
    live.wait_ready(READY_TIMEOUT_S)
    deadline = time.monotonic() + 60  # rank 0 loads the adapters as its loop starts, just after "ready"
    while True:
        models = [m["id"] for m in httpx.get(f"{live.url}/v1/models", headers=AUTH, timeout=60).json()["data"]]
        if "alpha" in models or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "delta" in models and "alpha" in models and "epsilon" not in models, models
    assert text(complete(live, "delta", ids)) == before
