"""Logprobs beyond the sampled token's, on the real demo model against transformers' float32 log-softmax:
- the top-20 alternatives of each generated token: sorted, the greedy token first, equal to the reference within
  1e-3, over multi-pass decode plans; a smaller count is cut to it;
- prompt logprobs (each prompt token's logprob, rank and alternatives) equal to the reference within 1e-3 over a
  prefill in chunks of 16, and for a request whose prompt is in the prefix cache (it computes the prompt again:
  `cached_tokens` 0, while the same prompt without prompt logprobs reuses the cached pages);
- the plan's wire form keeps the new fields.

The engine runs the XLA matmul (`cpu_matmul: xla`): the native CPU kernel's AVX-512 build rounds to within 5e-3 of
the reference, which says nothing about these results.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_engine_paged import _build_engine

from raydeploy.engine.local import LocalRunner
from raydeploy.engine.request import GenerationRequest
from raydeploy.engine.scheduler import Paging, Scheduler
from raydeploy.engine.step import MAX_TOP_LOGPROBS, SeqStep, StepPlan

TOL = 1e-3
TEXT = ("The lighthouse keeper climbed the stairs every evening, counting the steps aloud, and lit the lamp "
        "before the ships came round the cape. On stormy nights he stayed awake until dawn, watching the beam "
        "sweep over the black water and listening for bells.")


@pytest.fixture(scope="module")
def engine(demo_checkpoint):
    return _build_engine(demo_checkpoint, {"dp": 1}, prefill_chunk=16, cpu_matmul="xla")


def _scheduler(engine) -> Scheduler:
    paging = Paging(engine.page_size, engine.pages_per_group, engine.groups, engine.max_step_tokens, True)
    return Scheduler(engine.max_slots, engine.max_seq_len, engine.eos_ids, 16, paging, slot_order=engine.slot_order,
                     decode_steps=engine.decode_steps, vocab_size=engine.vocab_size)


def _events(runner: LocalRunner, req: GenerationRequest) -> list:
    stream = runner.submit(req)
    runner.run_until_idle()
    return list(stream.events(5.0))


def _reference(demo_hf, ids: list[int]) -> np.ndarray:
    """transformers' log-softmax at every place of `ids` ([len(ids), vocab])."""
    model = demo_hf[0]
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()


@pytest.mark.model
def test_top_20_alternatives_are_sorted_start_with_the_greedy_token_and_match_transformers(engine, demo_hf):
    tok = demo_hf[1]
    prompt = tok(TEXT)["input_ids"]
    runner = LocalRunner(engine, _scheduler(engine))
    events = _events(runner, GenerationRequest("a", tuple(prompt), 10, ignore_eos=True,
                                               top_logprobs=MAX_TOP_LOGPROBS))
    tokens = [ev for ev in events if ev.token_id is not None]
    assert len(tokens) == 10
    ref = _reference(demo_hf, prompt + [ev.token_id for ev in tokens])
    for j, ev in enumerate(tokens):
        top = ev.top_logprobs
        assert top is not None and len(top) == MAX_TOP_LOGPROBS
        ids, lps = [t for t, _ in top], np.asarray([v for _, v in top])
        assert ids[0] == ev.token_id, f"token {j}: the greedy token {ev.token_id} is not the first alternative"
        assert np.all(np.diff(lps) <= 0), f"token {j}: alternatives not in descending order"
        assert len(set(ids)) == MAX_TOP_LOGPROBS
        place = ref[len(prompt) + j - 1]
        np.testing.assert_allclose(lps, place[ids], atol=TOL)
        np.testing.assert_allclose(lps, np.sort(place)[::-1][:MAX_TOP_LOGPROBS], atol=TOL)
        assert abs(ev.logprob - lps[0]) < 1e-5  # the sampled token's own logprob is under the same distribution
    # a smaller count is cut to it; a request without any gets none
    few = _events(runner, GenerationRequest("b", tuple(prompt), 3, ignore_eos=True, top_logprobs=3))
    none = _events(runner, GenerationRequest("c", tuple(prompt), 3, ignore_eos=True))
    assert [len(ev.top_logprobs) for ev in few if ev.token_id is not None] == [3, 3, 3]
    assert [ev.top_logprobs for ev in few if ev.token_id is not None][0] == tokens[0].top_logprobs[:3]
    assert all(ev.top_logprobs is None for ev in none)


def _check_prompt_logprobs(entries, prompt: list[int], ref: np.ndarray, k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    got = np.asarray([e.logprob for e in entries[1:]])
    want = np.asarray([ref[i - 1, prompt[i]] for i in range(1, len(prompt))])
    np.testing.assert_allclose(got, want, atol=TOL)
    for i, e in enumerate(entries[1:], start=1):
        assert e.token_id == prompt[i]
        place = ref[i - 1]
        assert e.rank == 1 + int(np.sum(place > place[prompt[i]])), f"prompt token {i}: rank"
        assert len(e.top) == k
        assert [t for t, _ in e.top] == list(np.argsort(-place, kind="stable")[:k]), f"prompt token {i}: top ids"
        np.testing.assert_allclose([v for _, v in e.top], np.sort(place)[::-1][:k], atol=TOL)


@pytest.mark.model
def test_prompt_logprobs_match_transformers_over_chunks_and_bypass_the_prefix_cache(engine, demo_hf):
    tok = demo_hf[1]
    prompt = tok(TEXT)["input_ids"]
    assert len(prompt) > 3 * engine.max_step_tokens  # prefilled in several chunks of 16
    ref = _reference(demo_hf, prompt)
    sched = _scheduler(engine)
    runner = LocalRunner(engine, sched)
    first = _events(runner, GenerationRequest("warm", tuple(prompt), 2))  # fills the prefix cache
    assert first[0].cached_tokens == 0 and first[0].prompt_logprobs is None
    again = _events(runner, GenerationRequest("hit", tuple(prompt), 2))
    cached = (len(prompt) - 1) // engine.page_size * engine.page_size
    assert again[0].cached_tokens == cached > 0  # the prompt's full pages were reused
    asked = _events(runner, GenerationRequest("lp", tuple(prompt), 2, prompt_logprobs=5))
    assert asked[0].cached_tokens == 0  # computed again: cached pages hold no logits
    _check_prompt_logprobs(asked[0].prompt_logprobs, prompt, ref, 5)
    assert all(ev.prompt_logprobs is None for ev in asked[1:])
    # the generated tokens are the same with and without prompt logprobs
    assert [ev.token_id for ev in asked] == [ev.token_id for ev in first]
    # without alternatives: the token's own logprob and rank only
    bare = _events(runner, GenerationRequest("bare", tuple(prompt), 1, prompt_logprobs=0))
    _check_prompt_logprobs(bare[0].prompt_logprobs, prompt, ref, 0)


@pytest.mark.model
def test_prompt_logprobs_beside_decoding_rows_and_a_one_token_prompt(engine, demo_hf):
    """A prompt chunk that asks shares its steps with decode rows of another request (which do not ask), and a
    prompt of one token has one entry, None."""
    tok = demo_hf[1]
    prompt = tok(TEXT)["input_ids"]
    ref = _reference(demo_hf, prompt)
    runner = LocalRunner(engine, _scheduler(engine))
    busy = runner.submit(GenerationRequest("busy", tuple(prompt[:5]), 30, ignore_eos=True))
    runner.step_once()
    runner.step_once()
    asked = runner.submit(GenerationRequest("lp", tuple(prompt), 1, prompt_logprobs=2, top_logprobs=2))
    runner.run_until_idle()
    events = list(asked.events(5.0))
    _check_prompt_logprobs(events[0].prompt_logprobs, prompt, ref, 2)
    assert all(ev.top_logprobs is None for ev in busy.events(5.0))
    one = _events(runner, GenerationRequest("one", (prompt[0],), 1, prompt_logprobs=3))
    assert one[0].prompt_logprobs == (None,)


def test_seq_step_wire_keeps_the_logprob_fields():
    q = SeqStep(3, np.asarray([5, 6, 7], np.int32), 16, False, top_logprobs=True, prompt_logprobs=True,
                next_token=42)
    back = StepPlan.from_bytes(StepPlan(1, seqs=(q,)).to_bytes()).seqs[0]
    assert (back.top_logprobs, back.prompt_logprobs, back.next_token) == (True, True, 42)
    plain = StepPlan.from_bytes(StepPlan(1, seqs=(SeqStep(0, np.zeros(0, np.int32), 4, True),)).to_bytes()).seqs[0]
    assert (plain.top_logprobs, plain.prompt_logprobs, plain.next_token) == (False, False, -1)


def test_requests_asking_for_more_than_20_alternatives_are_refused():
    from raydeploy.engine.request import RequestFailed

    sched = Scheduler(4, 256, (2,), 4, Paging(16, 64, 1, 64, True))
    for field in ("top_logprobs", "prompt_logprobs"):
        with pytest.raises(RequestFailed, match=f"{field} must be between 0 and 20, found 21"):
            sched.submit(GenerationRequest("x", (1, 2, 3), 4, **{field: 21}), lambda ev: None)


# -- over HTTP: the real engine behind the ASGI app ---------------------------------------------------------------


class RunnerBackend:
    """The HTTP layer's `Backend` over an in-process `LocalRunner` (its step loop in a thread): the real engine
    and scheduler without Ray."""

    def __init__(self, runner: LocalRunner) -> None:
        self.runner = runner
        self.requests: list[GenerationRequest] = []

    async def state(self) -> dict:
        return {"state": "ready", "restarts": 0, "last_error": None, "ready_gangs": 1, "total_gangs": 1}

    async def generate(self, req: GenerationRequest):
        import asyncio

        self.requests.append(req)
        events = self.runner.submit(req).events(60.0)
        while (ev := await asyncio.to_thread(next, events, None)) is not None:
            yield [ev]

    async def abort(self, request_id: str) -> bool:
        with self.runner.loop.lock:
            return self.runner.scheduler.abort(request_id)

    async def stats(self) -> dict:
        return {}

    async def status(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def served(engine):
    import httpx
    from serve_fakes import tokenizer_dir

    from raydeploy.config import load_config
    from raydeploy.serve.app import create_app
    from raydeploy.serve.generation import Limits, ServingCore
    from raydeploy.serve.text import TextCodec

    cfg = load_config(None, ["model.max_seq_len=256", "engine.max_slots=4", "engine.sampling.temperature=0"])
    codec = TextCodec.from_dir(tokenizer_dir())
    runner = LocalRunner(engine, _scheduler(engine)).start()
    backend = RunnerBackend(runner)
    app = create_app(ServingCore(backend, codec, Limits.from_config(cfg, "demo")))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)
    yield client, backend, codec
    runner.stop()


def _post(served, path: str, body: dict) -> dict:
    import asyncio

    client = served[0]
    resp = asyncio.run(client.post(path, json=body))
    assert resp.status_code == 200, resp.text
    return resp.json()


def _stream(served, path: str, body: dict) -> list[dict]:
    import asyncio
    import json

    async def go() -> list[dict]:
        async with served[0].stream("POST", path, json={**body, "stream": True}) as resp:
            assert resp.status_code == 200, await resp.aread()
            lines = [line async for line in resp.aiter_lines() if line.startswith("data: {")]
        return [json.loads(line[len("data: "):]) for line in lines]

    return asyncio.run(go())


@pytest.mark.model
def test_completions_echo_returns_the_prompt_and_its_logprobs_first(served, demo_hf):
    codec = served[2]
    ids = codec.encode(TEXT)
    ref = _reference(demo_hf, ids)
    body = _post(served, "/v1/completions", {"prompt": TEXT, "echo": True, "logprobs": 2, "max_tokens": 1,
                                              "temperature": 0})
    choice = body["choices"][0]
    assert choice["text"].startswith(TEXT) and len(choice["text"]) > len(TEXT)
    lp = choice["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 1
    assert lp["tokens"][:n] == [codec.token_text(t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing precedes the first token
    np.testing.assert_allclose(lp["token_logprobs"][1:n], [ref[i - 1, ids[i]] for i in range(1, n)], atol=TOL)
    for i in range(1, n):  # lm-eval's greedy check: the token's logprob against the best of top_logprobs
        top = lp["top_logprobs"][i]
        assert codec.token_text(ids[i]) in top and 2 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(float(ref[i - 1].max()), abs=TOL)
    assert lp["text_offset"][0] == 0 and lp["text_offset"][n] == len(TEXT)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    # the generated token: greedy, so its logprob is the best of its alternatives
    assert lp["token_logprobs"][n] == pytest.approx(max(lp["top_logprobs"][n].values()), abs=1e-6)
    # the prompt logprobs were asked with the echo's 2 alternatives
    assert served[1].requests[-1].prompt_logprobs == 2 and served[1].requests[-1].top_logprobs == 2

    # streamed: the prompt's chunk first, then the token's
    chunks = _stream(served, "/v1/completions", {"prompt": TEXT, "echo": True, "logprobs": 2, "max_tokens": 1,
                                                  "temperature": 0})
    first = chunks[0]["choices"][0]
    assert first["text"] == TEXT and first["logprobs"]["token_logprobs"][0] is None
    np.testing.assert_allclose(first["logprobs"]["token_logprobs"][1:], lp["token_logprobs"][1:n], atol=1e-6)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]


@pytest.mark.model
def test_completions_echo_without_generating(served, demo_hf):
    codec = served[2]
    ids = codec.encode(TEXT)
    body = _post(served, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0})
    choice = body["choices"][0]
    assert choice["logprobs"]["tokens"] == [codec.token_text(t) for t in ids]
    assert choice["logprobs"]["top_logprobs"] is None and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    ref = _reference(demo_hf, ids)
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][1:],
                               [ref[i - 1, ids[i]] for i in range(1, len(ids))], atol=TOL)


@pytest.mark.model
def test_vllm_prompt_logprobs_and_chat_alternatives(served, demo_hf):
    codec = served[2]
    ids = codec.encode(TEXT)
    ref = _reference(demo_hf, ids)
    body = _post(served, "/v1/completions", {"prompt": TEXT, "prompt_logprobs": 1, "max_tokens": 2})
    plp = body["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        mine = plp[i][str(ids[i])]
        assert mine["logprob"] == pytest.approx(float(ref[i - 1, ids[i]]), abs=TOL)
        assert mine["rank"] == 1 + int(np.sum(ref[i - 1] > ref[i - 1, ids[i]]))
        assert mine["decoded_token"] == codec.token_text(ids[i])
        best = str(int(np.argmax(ref[i - 1])))
        assert plp[i][best]["rank"] == 1 and len(plp[i]) == (1 if best == str(ids[i]) else 2)

    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "logprobs": True, "top_logprobs": 3,
            "max_tokens": 4, "temperature": 0}
    content = _post(served, "/v1/chat/completions", chat)["choices"][0]["logprobs"]["content"]
    assert len(content) >= 1
    for entry in content:
        tops = entry["top_logprobs"]
        assert len(tops) == 3 and tops[0]["token"] == entry["token"]
        assert tops[0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-5)
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert tops[0]["bytes"] == list(tops[0]["token"].encode("utf-8"))
    streamed = [c["choices"][0]["logprobs"] for c in _stream(served, "/v1/chat/completions", chat)
                if c["choices"] and c["choices"][0].get("logprobs")]
    assert [e for lp in streamed for e in lp["content"]] == content


# -- the device functions on fixed arrays -------------------------------------------------------------------------


def test_chunked_top_k_equals_one_top_k_and_place_blocks_cover_every_place():
    """The chunked top-k (a sharded vocabulary's) finds the plain top-k's ids and values, and `place_logprobs` over
    blocks that do not divide the places (padding), several groups, gives every place's target logprob, rank and
    alternatives as numpy computes them."""
    import jax
    import jax.numpy as jnp

    from raydeploy.engine.logprobs import place_logprobs, prompt_targets, top_k_chunked

    x = jax.random.normal(jax.random.key(1), (5, 1003)) * 4
    for chunks in (1, 4, 16):
        vals, ids = top_k_chunked(x, 20, chunks)
        want_vals, want_ids = jax.lax.top_k(x, 20)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
        np.testing.assert_allclose(np.asarray(vals), np.asarray(want_vals))

    g, t, d, v, k = 2, 11, 8, 300, 4
    h = jax.random.normal(jax.random.key(2), (g, t, d))
    w = jax.random.normal(jax.random.key(3), (d, v))
    targets = jax.random.randint(jax.random.key(4), (g, t), 0, v)
    out = np.asarray(place_logprobs(h, targets, lambda rows: rows @ w, k=k, chunks=4, block=4))
    assert out.shape == (2 + 2 * k, g * t)
    logits = np.asarray(h.reshape(g * t, d) @ w, np.float64)
    lsm = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    tg = np.asarray(targets).reshape(-1)
    np.testing.assert_allclose(out[0], lsm[np.arange(g * t), tg], atol=1e-4)
    np.testing.assert_array_equal(out[1], 1 + (logits > logits[np.arange(g * t), tg][:, None]).sum(-1))
    np.testing.assert_array_equal(out[2:2 + k].view(np.int32).T, np.argsort(-logits, axis=-1)[:, :k])
    np.testing.assert_allclose(out[2 + k:].T, np.sort(lsm, axis=-1)[:, ::-1][:, :k], atol=1e-4)
    # as the step runs it: a loop of as many blocks as `active` says (none when no chunk asks)
    on = place_logprobs(h, targets, lambda rows: rows @ w, k=k, chunks=4, block=4, active=jnp.asarray(True))
    np.testing.assert_array_equal(np.asarray(on), out)
    off = place_logprobs(h, targets, lambda rows: rows @ w, k=k, chunks=4, block=4, active=jnp.asarray(False))
    assert not np.asarray(off).any()

    # a group's targets: the next place's token, a row's last place its chunk's next prompt token (if it has one)
    tokens = jnp.asarray([10, 11, 12, 20, 21, 0, 0], jnp.int32)
    got = prompt_targets(tokens, jnp.asarray([2, 4, 0]), jnp.asarray([13, -1, -1]))
    # row 0 (places 0-2) continues with 13; row 1 (places 3-4) is a prompt's last chunk; row 2 is padding (its
    # logit index 0 and no next token: it writes nothing over row 0's first place)
    np.testing.assert_array_equal(np.asarray(got)[:5], [11, 12, 13, 21, 0])
