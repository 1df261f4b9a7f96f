"""lm-eval-harness itself (`lm_eval` from PyPI, its `local-completions` model) against the real server: a real local
Ray cluster, the embedded default gang shape (2 host processes, dp=2), the demo model, Ray Serve HTTP.

Two tasks defined in tests/data/lm_eval with local data: a multiple-choice task scored by loglikelihood (every
choice one `/v1/completions` request with `echo: true, logprobs: 1, max_tokens: 1`, read back from the echoed
prompt's `token_logprobs`) and a `generate_until` task. Both must finish with their metrics; the loglikelihoods
lm-eval logged must equal transformers' on the same model (float32, from the same GGUF) within 1e-3 per token,
and the greedy answers must be transformers' greedy answers. The server runs the engine's float32 paths
(`EVAL_PRECISION`), as an evaluation should.

lm-eval gets the demo tokenizer from its local path (`tokenizer_backend=huggingface`) to count context tokens,
and sends text prompts (`tokenized_requests=False`), which the server tokenizes again: the test checks that the
prompts survive that round trip, since lm-eval's slicing of the echoed logprobs relies on it.
"""

from __future__ import annotations

import math
import os
import string
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hf_reference import hf_greedy, trusted_steps
from live_http import free_port, live_serving

from raydeploy.config import load_config

pytestmark = [pytest.mark.ray, pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

KEY = "sk-lm-eval-3f1a"
KEYS_ENV = "RAYDEPLOY_LM_EVAL_API_KEYS"
MODEL = "smollm2-135m-instruct"
TASKS_DIR = Path(__file__).resolve().parent / "data" / "lm_eval"
MC_TASK = "raydeploy_science_mc"
GEN_TASK = "raydeploy_short_qa"
MAX_SEQ_LEN = 256
READY_TIMEOUT_S = 600
PER_TOKEN_TOL = 1e-3
"""Allowed |server - transformers| of a continuation's loglikelihood, per continuation token."""
EVAL_PRECISION = ("engine.cpu_matmul=xla", "engine.kv_dtype=auto")
"""The engine's float32 paths: the default's native CPU matmul and float16 KV cache put prompt logprobs up to
3.7e-3 from transformers' (measured on the demo model: native + float16 KV 3.7e-3, native + float32 KV 3.3e-3,
XLA + float16 KV 2.0e-3, XLA + float32 KV 2.3e-5), over the 1e-3 an eval needs."""
GREEDY_MIN_GAP = 0.05
"""A reference top-1/top-2 logprob gap below this may flip either way: is_greedy is not compared there."""


@pytest.fixture(scope="module")
def server(demo_checkpoint):
    os.environ[KEYS_ENV] = KEY  # before Ray starts: the ingress replica reads it
    cfg = load_config(None, [
        f"model.max_seq_len={MAX_SEQ_LEN}", "engine.max_new_tokens=64", "engine.max_slots=8", "serving.max_queue=16",
        *EVAL_PRECISION, f"serving.port={free_port()}", f"serving.api_keys_env={KEYS_ENV}",
        "serving.request_timeout_s=600"])
    with live_serving(cfg, str(demo_checkpoint), "rdl", READY_TIMEOUT_S) as serving:
        yield serving


def _tokenizer_dir(server) -> str:
    from raydeploy.gang.gang import resolve_checkpoint_path

    return resolve_checkpoint_path(server.cfg)


def _tokenizer(server) -> Any:
    """The demo tokenizer from the same local folder lm-eval is given."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_tokenizer_dir(server), local_files_only=True)


def _evaluate(server, task: str, monkeypatch) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` with `local-completions` pointed at the server, samples logged."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # local-completions sends it as the bearer token
    model_args = ",".join([
        f"base_url={server.url}/v1/completions", f"model={MODEL}", f"tokenizer={_tokenizer_dir(server)}",
        "tokenizer_backend=huggingface", "tokenized_requests=False", f"max_length={MAX_SEQ_LEN}",
        "num_concurrent=4", "max_retries=1", "max_gen_toks=24", "timeout=600"])
    results = lm_eval.simple_evaluate(
        model="local-completions", model_args=model_args, tasks=[task],
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
        log_samples=True, bootstrap_iters=0, cache_requests=False)
    assert results is not None
    return results


def _encode_pair(tok: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a loglikelihood request into context and continuation ids (`TemplateLM._encode_pair`
    for a causal model: trailing context spaces move to the continuation; the whole text is encoded once)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return whole[:len(ctx)], whole[len(ctx):]


def _reference_loglikelihood(model: Any, ctx: list[int], cont: list[int]) -> tuple[float, bool, float]:
    """transformers' (sum of the continuation tokens' logprobs, whether each was the argmax, the smallest
    top-1/top-2 logprob gap over the continuation)."""
    ids = ctx + cont
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    total, greedy, gap = 0.0, True, math.inf
    for pos in range(len(ctx), len(ids)):
        row = logprobs[pos - 1]
        total += float(row[ids[pos]])
        top2 = torch.topk(row, 2)
        greedy = greedy and int(top2.indices[0]) == ids[pos]
        gap = min(gap, float(top2.values[0] - top2.values[1]))
    return total, greedy, gap


def test_generate_until_task_answers_as_transformers_greedy(server, demo_hf, monkeypatch):
    results = _evaluate(server, GEN_TASK, monkeypatch)
    metrics = results["results"][GEN_TASK]
    assert 0.0 <= metrics["exact_match,strip"] <= 1.0, metrics
    samples = results["samples"][GEN_TASK]
    assert len(samples) == 6

    model, _ = demo_hf
    tok = _tokenizer(server)
    compared, matches = 0, 0
    for s in samples:
        (context, gen_kwargs), = s["arguments"]
        (answer,), = s["resps"]
        assert isinstance(answer, str) and "\n" not in answer, s
        assert context.startswith("Question: What is two plus two?") and context.endswith("\nAnswer:"), context
        tokens, gaps = hf_greedy(model, tok.encode(context, add_special_tokens=False), gen_kwargs["max_gen_toks"])
        steps = _steps_to_stop(tok, tokens)
        want = tok.decode(tokens[:steps], skip_special_tokens=True).split("\n")[0]
        trusted = trusted_steps(gaps)
        if steps <= trusted:  # every draw up to the stop had a clear winner: the answer is determined
            assert answer == want, (context, answer, want)
            compared += 1
            matches += _normalized(want) == _normalized(s["target"])
        else:
            prefix = tok.decode(tokens[:trusted], skip_special_tokens=True).split("\n")[0]
            assert answer.startswith(prefix), (context, answer, prefix)
    assert compared >= len(samples) // 2, "too few answers were fully comparable with the reference"
    if compared == len(samples):  # the metric is the reference's answers scored
        assert metrics["exact_match,strip"] == pytest.approx(matches / len(samples)), (metrics, matches)
    print(f"lm-eval generate_until: exact_match {metrics['exact_match,strip']:.3f}, {compared} of {len(samples)} "
          f"answers compared whole with transformers' greedy: {[s['resps'][0][0] for s in samples]}")


def _normalized(text: str) -> str:
    """The task's exact_match comparison: surrounding spaces stripped (its filter), case and punctuation ignored."""
    return text.strip().lower().translate(str.maketrans("", "", string.punctuation))


def _steps_to_stop(tok: Any, tokens: list[int]) -> int:
    """Greedy steps up to and including the one that stops the answer (eos, or a token that completes a newline)."""
    for i, t in enumerate(tokens):
        if t == tok.eos_token_id or "\n" in tok.decode(tokens[:i + 1], skip_special_tokens=True):
            return i + 1
    return len(tokens)


@pytest.mark.parametrize("prompt", ["Question: Which gas do plants take in from the air to make their food?\nAnswer: "
                                    "oxygen", "Question: What state of matter is ice?\nAnswer: solid"],
                         ids=["eos-drawn", "word-drawn"])
def test_echo_gives_every_prompt_token_and_the_drawn_one(server, demo_hf, prompt):
    """The body local-completions sends for one loglikelihood request, and what it relies on in the answer: one
    entry per prompt token (the first null) and one for the drawn token, also when that token is eos (the demo
    model ends the text after "oxygen"): lm-eval drops the last entry and sums the continuation's before it."""
    model, _ = demo_hf
    tok = _tokenizer(server)
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    (choice,) = out["choices"]
    lp = choice["logprobs"]
    ids = tok.encode(prompt, add_special_tokens=False)
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 1, out
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1, out
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None, lp
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))] + [float(ref[-1].max())]
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], want, strict=True)) <= PER_TOKEN_TOL, (lp, want)
    assert choice["text"].startswith(prompt), choice


def test_multiple_choice_loglikelihoods_equal_transformers(server, demo_hf, monkeypatch):
    results = _evaluate(server, MC_TASK, monkeypatch)
    metrics = results["results"][MC_TASK]
    assert 0.0 <= metrics["acc,none"] <= 1.0 and 0.0 <= metrics["acc_norm,none"] <= 1.0, metrics
    samples = results["samples"][MC_TASK]
    assert len(samples) == 8

    model, _ = demo_hf
    tok = _tokenizer(server)
    worst, requests, decided = 0.0, 0, 0
    for s in samples:
        assert len(s["arguments"]) == len(s["doc"]["choices"]) == len(s["resps"]) == 4, s
        refs = []
        for (context, continuation), ((ll, is_greedy),) in zip(s["arguments"], s["resps"], strict=True):
            ctx, cont = _encode_pair(tok, context, continuation)
            # the server tokenizes the text lm-eval sends (its decoded ids) again: lm-eval's slice of the echoed
            # logprobs is right only if that gives the same ids
            assert tok.encode(tok.decode(ctx + cont), add_special_tokens=False) == ctx + cont, (context, continuation)
            want, want_greedy, gap = _reference_loglikelihood(model, ctx, cont)
            err = abs(ll - want)
            assert err <= PER_TOKEN_TOL * len(cont), (context, continuation, ll, want, len(cont))
            worst = max(worst, err / len(cont))
            if gap >= GREEDY_MIN_GAP:
                assert is_greedy == want_greedy, (context, continuation, is_greedy, want_greedy, gap)
            refs.append((want, len(cont)))
            requests += 1
        assert len({r for r, _ in refs}) == 4, refs  # the choices were really scored apart
        # the doc's acc is the reference's pick wherever the tolerance cannot swap the top two choices
        ranked = sorted(range(4), key=lambda i: refs[i][0], reverse=True)
        first, second = refs[ranked[0]], refs[ranked[1]]
        if first[0] - second[0] > PER_TOKEN_TOL * (first[1] + second[1]):
            assert s["acc"] == float(ranked[0] == s["target"]), (s["doc"], refs, s["acc"])
            decided += 1
    assert requests == 32 and decided >= len(samples) // 2, (requests, decided)
    print(f"lm-eval loglikelihoods vs transformers: worst |diff| per token {worst:.2e} over {requests} requests")
