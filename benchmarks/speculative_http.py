"""Speculative decoding (prompt lookup, `engine.speculative.method: ngram`) over HTTP on the embedded default, against
the same server without it, same run.

Brings up `raydeploy serve` (the embedded default: the real gang of 2 host processes, dp=2, the demo model, Ray
Serve HTTP) twice, one after the other: as it is but with `engine.max_slots` 16, so that 16 streams decode
together (the peer), then the same with `--set engine.speculative.method=ngram`.
Against each, through the openai SDK (streaming /v1/chat/completions, temperature 0), on the prompts of
benchmarks/speculative.py (its WORKLOADS: rewrite a paragraph fixing only its spelling and rename a variable in a
piece of code, where lookup helps; an open-ended story, where it does not):

- one stream at a time, max_tokens 128: TPOT = (arrival of the last token - arrival of the first) / (tokens - 1),
  over --rounds rounds, after one untimed warm request per workload. Each answer ends at the model's eos (what a
  user asking for the rewrite gets; benchmarks/results/speculative.json says why eos is not ignored there).
  Goals (issue 50): >= 1.8x faster where lookup helps, >= 0.95x where it does not;
- 16 concurrent streams (story and rewrite alternating, max_tokens 64, vLLM's `ignore_eos` so all 16 run to the
  end): aggregate tok/s over the window in which all 16 stream (from the last stream's first token to the first
  stream's last), after one untimed warm round. Goal >= 0.95x.

Arrivals are taken per SSE chunk: the server writes one chunk per piece (a plan's pieces in one message), a piece
per token, and one more piece without a token where the finish comes apart from the last token
(`one_chunk_per_token` in the results says whether every answer had exactly as many chunks as tokens). TPOT divides
by usage.completion_tokens; the 16-stream window counts chunks (a token-less finish chunk lands at its stream's end,
so at most the first stream to end adds one to the window's count). Every ngram answer's text must equal the plain answer's of the same
round (greedy decoding; verification draws each token as plain decoding would): a mismatch is recorded in the
results file and stops the run. After the runs the ngram server's /metrics (`vllm:spec_decode_*`) gives the
acceptance figures. Writes benchmarks/results/speculative_http.json.

    .venv/bin/python benchmarks/speculative_http.py
    .venv/bin/python benchmarks/speculative_http.py --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from bringup import get_json, stop, wait_ready  # noqa: E402  (benchmarks/ on sys.path, as every script here)
from machine import cpu_flags  # noqa: E402
from serve_bench import _free_port  # noqa: E402
from speculative import WORKLOADS  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "speculative_http.json"
SHARED = ["engine.max_slots=16"]
"""Both servers' overrides besides the port: 16 slots (8 per dp group; the default 8 would hold 8 of the 16 streams
in the queue), as benchmarks/serve_load.py serves the embedded default."""
ARMS = {"plain": [*SHARED], "ngram": [*SHARED, "engine.speculative.method=ngram"]}
"""The two servers: the embedded default, and the same with prompt lookup on (their `--set` overrides)."""
ONE_STREAM_TOKENS = 128
MANY_STREAMS, MANY_TOKENS = 16, 64


class Mismatch(RuntimeError):
    """An ngram answer's text differs from the plain one's."""


def serve(port: int, sets: list[str], ray_tmp: str, log: Path) -> subprocess.Popen:
    """`raydeploy serve` on `port` with these overrides, in a session of its own (stopped with `bringup.stop`)."""
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0", JAX_PLATFORMS="cpu",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "raydeploy", "serve", "--set", f"serving.port={port}"]
    for s in sets:
        cmd += ["--set", s]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)


async def stream_one(client: Any, model: str, prompt: str, max_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    """One streamed greedy chat completion: each token chunk's arrival, the text, the usage's token count."""
    extra = {"ignore_eos": True} if ignore_eos else None
    sent = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body=extra)
    arrivals: list[float] = []
    parts: list[str] = []
    usage, finish = None, None
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:
            choice = chunk.choices[0]
            arrivals.append(now)  # one chunk per token (the first also carries the role)
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return {"sent": sent, "arrivals": arrivals, "text": "".join(parts), "tokens": usage, "finish": finish}


def tpot(answer: dict[str, Any]) -> float:
    t = answer["arrivals"]
    return (t[-1] - t[0]) / max(answer["tokens"] - 1, 1)


def window_tok_s(answers: list[dict[str, Any]]) -> tuple[float, float, int]:
    """Tokens per second over the window in which all streams stream, the window's seconds and its tokens."""
    t0 = max(a["arrivals"][0] for a in answers)
    t1 = min(a["arrivals"][-1] for a in answers)
    inside = sum(1 for a in answers for t in a["arrivals"] if t0 < t <= t1)
    return (inside / (t1 - t0) if t1 > t0 else float("nan")), t1 - t0, inside


def spec_metrics(base: str) -> dict[str, Any]:
    """The `spec_decode` series of /metrics, by name (per-position counters as a list), and the acceptance rate and
    mean accepted length that follow from them."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=30).text
    out: dict[str, Any] = {}
    per_pos: dict[int, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "spec_decode" not in s.name:
                continue
            if "position" in s.labels:
                per_pos[int(s.labels["position"])] = s.value
            else:
                out[s.name] = s.value
    if per_pos:
        out["vllm:spec_decode_num_accepted_tokens_per_pos_total"] = [per_pos[i] for i in sorted(per_pos)]
    drafts = out.get("vllm:spec_decode_num_drafts_total")
    proposed = out.get("vllm:spec_decode_num_draft_tokens_total")
    accepted = out.get("vllm:spec_decode_num_accepted_tokens_total")
    if proposed:
        out["acceptance_rate"] = accepted / proposed
    if drafts:
        out["mean_accepted_length"] = 1 + accepted / drafts  # vLLM's: the bonus token plus the accepted ones
    return out


async def measure(base: str, arm: str, rounds: int, want: dict[str, list] | None, mismatches: list) -> dict:
    """Every measurement against one server; `want` (the plain arm's answers) checks the ngram texts."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    many_names = [("story", "rewrite")[i % 2] for i in range(MANY_STREAMS)]

    async def many() -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(stream_one(client, model, WORKLOADS[n], MANY_TOKENS, True)
                                           for n in many_names)))

    for name in WORKLOADS:  # untimed: each workload's first request
        await stream_one(client, model, WORKLOADS[name], ONE_STREAM_TOKENS, False)
    await many()
    rows: dict[str, list[float]] = {}
    answers: dict[str, list] = {}
    counts_ok = True

    def check(key: str, r: int, got: list[str]) -> None:
        answers.setdefault(key, []).append(got)
        if want is None:
            return
        for i, (g, w) in enumerate(zip(got, want[key][r], strict=True)):
            if g != w:
                at = next((j for j, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w)))
                mismatches.append({"what": key, "round": r, "stream": i, "first_differing_char": at,
                                   "plain": w, arm: g})
        if mismatches:
            raise Mismatch(f"{key}, round {r}: the {arm} text differs from the plain one")

    for r in range(rounds):
        for name in WORKLOADS:
            a = await stream_one(client, model, WORKLOADS[name], ONE_STREAM_TOKENS, False)
            counts_ok &= a["tokens"] == len(a["arrivals"])
            rows.setdefault(f"tpot_{name}_s", []).append(tpot(a))
            rows.setdefault(f"tokens_{name}", []).append(a["tokens"])
            check(name, r, [a["text"]])
        out = await many()
        counts_ok &= all(a["tokens"] == len(a["arrivals"]) == MANY_TOKENS for a in out)
        tok_s, window_s, inside = window_tok_s(out)
        rows.setdefault("tok_s_16", []).append(tok_s)
        rows.setdefault("window_s_16", []).append(window_s)
        rows.setdefault("window_tokens_16", []).append(inside)
        check("16_streams", r, [a["text"] for a in out])
        print(f"{arm} round {r}: " + ", ".join(f"{k} {v[-1]:.4g}" for k, v in rows.items()), flush=True)
    await client.close()
    return {"rows": rows, "answers": answers, "chunk_per_token": counts_ok}


def run_arm(arm: str, rounds: int, ready_s: float, work: Path, want: dict | None, mismatches: list) -> dict:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    # Ray's temp dir short: its socket paths must fit a Unix socket's 107 characters
    proc = serve(port, ARMS[arm], f"/tmp/rsh{os.getpid()}{arm[0]}", work / f"serve-{arm}.log")
    try:
        wait_ready(base, ready_s, proc)
        ready = time.perf_counter() - t0
        print(f"{arm}: ready in {ready:.0f} s", flush=True)
        try:
            got = asyncio.run(measure(base, arm, rounds, want, mismatches))
        finally:
            if arm != "plain":
                time.sleep(3)  # the ingress refreshes its gang figures every serving.metrics_refresh_s
                spec = spec_metrics(base)
        if arm != "plain":
            got["spec_decode"] = spec
        got["ready_s"] = round(ready, 1)
        got["load_average_1m"] = {"before_start": load_before, "after_runs": os.getloadavg()[0]}
        _, st = get_json(base + "/status", 30.0)
        got["status_spec"] = _spec_status(st)
        return got
    finally:
        stop(proc)


def _spec_status(st: Any) -> dict[str, Any]:
    """The `spec_decode*` figures anywhere in /status (the gangs' stats)."""
    found: dict[str, Any] = {}

    def walk(x: Any, path: str) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if isinstance(k, str) and k.startswith("spec_decode"):
                    found[f"{path}{k}"] = v
                else:
                    walk(v, f"{path}{k}.")
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{path}{i}.")

    walk(st, "")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ready-timeout-s", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    import jax

    work = Path(tempfile.mkdtemp(prefix="speculative_http-"))
    mismatches: list[dict] = []
    arms: dict[str, dict] = {}
    error = None
    try:
        for arm in ARMS:
            want = arms["plain"]["answers"] if arm != "plain" else None
            arms[arm] = run_arm(arm, args.rounds, args.ready_timeout_s, work, want, mismatches)
    except Mismatch as e:
        error = str(e)
    med = {f"{k}_{arm}": statistics.median(v) for arm, got in arms.items() for k, v in got["rows"].items()}
    ratios = {}
    if not error:
        ratios = {f"tpot_{n}_plain_over_ngram": med[f"tpot_{n}_s_plain"] / med[f"tpot_{n}_s_ngram"] for n in WORKLOADS}
        ratios["tok_s_16_ngram_over_plain"] = med["tok_s_16_ngram"] / med["tok_s_16_plain"]
    result = {
        "benchmark": "speculative decoding (ngram) over HTTP: the embedded default (raydeploy serve: 2 hosts x 1 CPU "
                     "device, dp=2, demo model, Ray Serve) with engine.speculative.method=ngram against without",
        "machine": {"cpu": platform.processor() or platform.machine(), "cpu_flags": cpu_flags(),
                    "cores": os.cpu_count(), "jax": jax.__version__, "python": platform.python_version()},
        "config": {"arms": {arm: ["serving.port=<free>", *sets] for arm, sets in ARMS.items()},
                   "client": "openai AsyncOpenAI, streaming /v1/chat/completions, temperature 0",
                   "one_stream": {"max_tokens": ONE_STREAM_TOKENS, "ends_at": "the model's eos or max_tokens",
                                  "tpot": "(last token's arrival - first's) / (tokens - 1)"},
                   "many_streams": {"streams": MANY_STREAMS, "max_tokens": MANY_TOKENS, "ignore_eos": True,
                                    "workloads": "story and rewrite alternating",
                                    "tok_s": "tokens arrived in the window where all stream / its seconds"},
                   "rounds": args.rounds, "warm": "one untimed request per workload and one 16-stream round"},
        "prompts": WORKLOADS,
        "error": error, "mismatches": mismatches,
        "median": med, "ratios": ratios,
        "goals": {"tpot_rewrite_plain_over_ngram": ">= 1.8", "tpot_code_plain_over_ngram": ">= 1.8",
                  "tpot_story_plain_over_ngram": ">= 0.95", "tok_s_16_ngram_over_plain": ">= 0.95"},
        "all": {arm: got["rows"] for arm, got in arms.items()},
        "one_chunk_per_token": {arm: got["chunk_per_token"] for arm, got in arms.items()},
        "ready_s": {arm: got["ready_s"] for arm, got in arms.items()},
        "load_average_1m": {arm: got["load_average_1m"] for arm, got in arms.items()},
        "acceptance": arms.get("ngram", {}).get("spec_decode"),
        "status_spec_decode": {arm: got.get("status_spec") for arm, got in arms.items()},
        "answers_last_round": {k: v[-1][:2] for k, v in arms.get("ngram", arms.get("plain", {})).get(
            "answers", {}).items()},
        "when": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"median": med, "ratios": ratios, "acceptance": result["acceptance"], "error": error},
                     indent=2))
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
