"""Speculative decoding end to end, as users run it: the embedded default gang shape (2 host processes with a
virtual CPU device each, dp=2, real jax.distributed), the real SmolLM2 demo model and Ray Serve HTTP, with
`--set engine.speculative.method=ngram`, called through the openai SDK.

- Greedy completions of a prompt where lookup helps (rewrite a paragraph fixing its spelling) and of an open one
  (a story) equal, token for token, those of the same config with speculation off. The peer is the engine of that
  config built in this process over a dp=2 mesh of two of its virtual devices (cheaper than a second server: no
  second gang, and it compiles only the plain step programs it runs); the texts are compared, and the token
  counts.
- /metrics shows drafts and accepted tokens (`vllm:spec_decode_*`).
- A stop string and a max_tokens that fall inside the copied paragraph (where proposals are accepted: the
  accepted-token counter grows over those requests) end the answer at the right token: the text is the peer's
  up to there.

One deployment is shared by every test of this module.
"""

from __future__ import annotations

import time

import httpx
import jax
import pytest
from live_http import free_port, live_serving
from prometheus_client.parser import text_string_to_metric_families

from raydeploy.config import load_config
from raydeploy.engine.local import LocalRunner
from raydeploy.engine.request import GenerationRequest
from raydeploy.engine.step import SamplingParams
from raydeploy.gang.gang import resolve_checkpoint_path
from raydeploy.gang.runtime import load_checkpoint_engine
from raydeploy.model.sharding import build_mesh
from raydeploy.serve.text import TextCodec

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.ray, pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
READY_TIMEOUT_S = 900
SIZES = ["model.max_seq_len=1024", "engine.max_new_tokens=200", "serving.request_timeout_s=600",
         "serving.metrics_refresh_s=0.1"]
"""What the served gang and the in-process peer share besides the embedded default (a shorter context than its
2048: fewer page buckets to compile)."""
PARAGRAPH = ("The quick brown fox jumpd over the lazy dog. It was a sunny day, and the feilds were full of "
             "flowers. The farmer walked slowley to the barn, carrying a bucket of water for the horses. "
             "Evrything seemed peaceful, untill a loud noise came from the forest behind the house.")
PROMPTS = {
    "rewrite": [{"role": "user", "content": "Rewrite this paragraph, fixing only the spelling mistakes. Output "
                                            f"only the paragraph.\n\n{PARAGRAPH}"}],
    "story": [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}],
}
MAX_TOKENS = 96
DRAFTS, ACCEPTED = "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"


@pytest.fixture(scope="module")
def live(demo_checkpoint):
    cfg = load_config(None, [*SIZES, "engine.speculative.method=ngram", f"serving.port={free_port()}"])
    with live_serving(cfg, str(demo_checkpoint), "rds", READY_TIMEOUT_S) as serving:
        yield serving


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", timeout=600, max_retries=0)


@pytest.fixture(scope="module")
def peer(live):
    """{workload: (prompt ids, greedy token ids)} of the same config with speculation off, run in this process
    (the served config's engine section with `method: none`, dp=2 over two virtual devices) after the tokenizer's
    chat template, as the server applies it."""
    cfg = load_config(None, SIZES)
    assert cfg.engine.speculative.method == "none" and cfg.mesh_shape == live.cfg.mesh_shape
    ckpt = resolve_checkpoint_path(live.cfg)
    codec = TextCodec.from_dir(ckpt)
    prompts = {n: tuple(codec.encode_chat(codec.chat_prompt(m))) for n, m in PROMPTS.items()}
    n = cfg.cluster.num_hosts * cfg.cluster.devices_per_host
    loaded = load_checkpoint_engine(cfg, build_mesh(cfg.mesh_shape, jax.devices()[:n]), ckpt)
    reqs = [GenerationRequest(f"peer-{name}", ids, MAX_TOKENS, SamplingParams()) for name, ids in prompts.items()]
    outs = LocalRunner(loaded.engine, loaded.make_scheduler()).generate(reqs, timeout_s=900)
    assert all(o.error is None for o in outs), outs
    return {name: (ids, o.token_ids) for (name, ids), o in zip(prompts.items(), outs, strict=True)}, codec


def _spec_counters(live, past: dict[str, float] | None = None) -> dict[str, float]:
    """The `vllm:spec_decode_*` counters on /metrics, by sample name. With `past`: read until the drafts counter
    has grown past it (the ingress refreshes the gangs' figures in the background; bounded: 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(live.url + "/metrics", timeout=30).text
        got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name.startswith("vllm:spec_decode_num_") and "position" not in s.labels}
        if past is None or got.get(DRAFTS, 0) > past.get(DRAFTS, 0) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _chat(client, name: str, **extra):
    return client.chat.completions.create(model=MODEL, messages=PROMPTS[name], temperature=0,
                                          max_tokens=extra.pop("max_tokens", MAX_TOKENS), **extra)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_answers_equal_those_without_speculation(live, client, peer, name):
    refs, codec = peer
    ids, want = refs[name]
    before = _spec_counters(live)
    r = _chat(client, name)
    assert r.usage.prompt_tokens == len(ids), r.usage
    assert r.usage.completion_tokens == len(want), (r.usage, len(want))
    assert r.choices[0].message.content == codec.decode(want)
    assert r.choices[0].finish_reason == ("length" if len(want) == MAX_TOKENS else "stop")
    after = _spec_counters(live, before)
    assert after[DRAFTS] > before.get(DRAFTS, 0), after  # this answer's rows were verified
    if name == "rewrite":  # the copied paragraph: most proposals are right
        accepted = after[ACCEPTED] - before.get(ACCEPTED, 0)
        assert accepted >= len(want) // 4, (accepted, len(want))


def test_metrics_show_drafts_and_accepted_tokens(live, client):
    before = _spec_counters(live)
    _chat(client, "rewrite", max_tokens=32)
    c = _spec_counters(live, before)
    assert c[DRAFTS] > 0, c
    assert c["vllm:spec_decode_num_draft_tokens_total"] >= c[DRAFTS], c
    assert 0 < c[ACCEPTED] <= c["vllm:spec_decode_num_draft_tokens_total"], c


def test_stop_string_and_max_tokens_inside_an_accepted_run_end_at_the_right_token(live, client, peer):
    """The rewrite's answer copies the paragraph, so its proposals are accepted in runs; a stop string and a
    max_tokens in the middle of it end the answer exactly where the peer's text ends there."""
    refs, codec = peer
    want = refs["rewrite"][1]
    full = codec.decode(want)
    stop = "barn"
    assert stop in full, full  # the model copies this part of the paragraph
    before = _spec_counters(live)
    r = _chat(client, "rewrite", stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[:full.index(stop)]
    cut = 2 * len(want) // 3 + 1  # past the paragraph's start, not at a multiple of k + 1
    r = _chat(client, "rewrite", max_tokens=cut)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == cut, r
    assert r.choices[0].message.content == codec.decode(want[:cut])
    assert _spec_counters(live, before)[ACCEPTED] > before.get(ACCEPTED, 0)
