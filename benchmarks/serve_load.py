"""Serving load benchmark: output tokens/s, time to first token and time per output token over HTTP at
1, 4 and 16 concurrent streams, and the HTTP layer's overhead against the engine's own step time.

Brings up the embedded default gang shape (2 host processes x 2 virtual CPU devices, the real demo model)
behind Ray Serve, streams chat completions with the official `openai` client, and reads the coordinator's
step clock over the same windows. Writes a JSON of the figures and a PNG plot.

    .venv/bin/python benchmarks/serve_load.py [--rounds 2] [--max-tokens 64] [--out docs/serve_load]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raydeploy.config import load_config  # noqa: E402

PROMPTS = ["Tell me about the sea.", "Describe a cat.", "What is rain?", "Write about the moon.",
           "How is bread made?", "Why do trains run on rails?", "Describe winter.", "Plan a small garden.",
           "What is music?", "Describe a mountain.", "How is coffee brewed?", "What is a library for?",
           "Where does wind come from?", "How does a bicycle work?", "What is fire?", "Follow a river."]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _window_step_ms(before: dict, after: dict) -> tuple[float, int]:
    """Mean engine step time (rank 0's step clock, broadcast included) over the steps between two snapshots."""
    n0, n1 = before["steps_done"], after["steps_done"]
    t0 = (before["mean_step_ms"] or 0.0) * n0
    t1 = (after["mean_step_ms"] or 0.0) * n1
    return ((t1 - t0) / (n1 - n0) if n1 > n0 else float("nan")), n1 - n0


async def _stream_one(client, model: str, prompt: str, max_tokens: int, temperature: float) -> dict:
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=temperature, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    first = last = None
    n_chunks, usage = 0, None
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].finish_reason is None:
            n_chunks += 1
            first = first or now
            last = now
        if chunk.usage:
            usage = chunk.usage
    tokens = usage.completion_tokens
    return {"ttft_s": first - t0, "tpot_s": (last - first) / max(1, n_chunks - 1), "tokens": tokens,
            "total_s": time.perf_counter() - t0}


async def _round(url: str, key: str | None, model: str, concurrency: int, max_tokens: int, temperature: float,
                 offset: int) -> tuple[list[dict], float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key=key or "none", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    results = await asyncio.gather(*[
        _stream_one(client, model, PROMPTS[(offset + i) % len(PROMPTS)], max_tokens, temperature)
        for i in range(concurrency)])
    wall = time.perf_counter() - t0
    await client.close()
    return list(results), wall


def measure(serving, model: str, levels: list[int], rounds: int, max_tokens: int, temperature: float) -> dict:
    out: dict = {"levels": {}}
    asyncio.run(_round(serving.url, None, model, 2, 8, temperature, 0))  # warm the HTTP path
    for c in levels:
        reqs, tokens, wall = [], 0, 0.0
        before = serving.gang.status()["stats"]
        for r in range(rounds):
            res, w = asyncio.run(_round(serving.url, None, model, c, max_tokens, temperature, r * c))
            reqs += res
            wall += w
            tokens += sum(x["tokens"] for x in res)
        after = serving.gang.status()["stats"]
        step_ms, steps = _window_step_ms(before, after)
        ttft = [x["ttft_s"] for x in reqs]
        tpot = [x["tpot_s"] for x in reqs]
        out["levels"][c] = {
            "concurrency": c, "requests": len(reqs), "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2),
            "ttft_ms": {"p50": round(1e3 * statistics.median(ttft), 1), "p99": round(1e3 * _pct(ttft, 0.99), 1)},
            "tpot_ms": {"p50": round(1e3 * statistics.median(tpot), 2), "p99": round(1e3 * _pct(tpot, 0.99), 2)},
            "engine_step_ms": round(step_ms, 2), "engine_steps": steps,
            "tokens_per_step": round(tokens / steps, 2) if steps else None,
        }
        print(json.dumps(out["levels"][c]), flush=True)
    one = out["levels"][levels[0]]
    top = out["levels"][levels[-1]]
    out["speedup_top_vs_single"] = round(top["tokens_per_s"] / one["tokens_per_s"], 2)
    out["http_overhead_single_stream"] = round(one["tpot_ms"]["p50"] / one["engine_step_ms"] - 1.0, 4)
    return out


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(int(c) for c in results["levels"])
    rows = [results["levels"][c] for c in levels]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(levels, [r["tokens_per_s"] for r in rows], "o-", label="over HTTP")
    a.plot(levels, [levels[0] and rows[0]["tokens_per_s"] * c for c in levels], ":", color="gray",
           label="linear from 1 stream")
    a.set_xlabel("concurrent streams")
    a.set_ylabel("output tokens/s (all streams)")
    a.set_xscale("log", base=2)
    a.set_xticks(levels, [str(c) for c in levels])
    a.legend()
    a.set_title("Throughput")
    b.plot(levels, [r["tpot_ms"]["p50"] for r in rows], "o-", label="time/output token p50")
    b.plot(levels, [r["tpot_ms"]["p99"] for r in rows], "o--", label="time/output token p99")
    b.plot(levels, [r["engine_step_ms"] for r in rows], "s:", label="engine step (in-process)")
    b2 = b.twinx()
    b2.plot(levels, [r["ttft_ms"]["p50"] for r in rows], "^-", color="tab:red", label="TTFT p50")
    b2.plot(levels, [r["ttft_ms"]["p99"] for r in rows], "^--", color="tab:red", alpha=0.5, label="TTFT p99")
    b.set_xlabel("concurrent streams")
    b.set_ylabel("ms per token")
    b2.set_ylabel("time to first token, ms")
    b.set_xscale("log", base=2)
    b.set_xticks(levels, [str(c) for c in levels])
    lines = b.get_legend_handles_labels()
    lines2 = b2.get_legend_handles_labels()
    b.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="upper left")
    b.set_title("Latency")
    fig.suptitle(results.get("title", "raydeploy serving"), fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="1,4,16")
    p.add_argument("--rounds", type=int, default=2, help="rounds per concurrency level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--engine", choices=["real", "toy"], default="real")
    p.add_argument("--set", dest="overrides", action="append",
                   default=["model.max_seq_len=512", "engine.prefill_buckets=[64,512]", "engine.max_slots=16",
                            "engine.max_new_tokens=128", "serving.max_queue=64"])
    p.add_argument("--out", default="docs/serve_load", help="writes OUT.json and OUT.png")
    args = p.parse_args()

    import ray

    from raydeploy.serve.run import connect_ray, start_serving

    cfg = load_config(None, [*args.overrides, f"serving.port={_free_port()}"])
    connect_ray(None, temp_dir=f"/tmp/rdb-{os.getpid()}")
    serving = None
    try:
        t0 = time.perf_counter()
        serving = start_serving(cfg, engine=args.engine)
        serving.wait_ready(1200)
        print(f"gang ready in {time.perf_counter() - t0:.1f}s", flush=True)
        levels = [int(x) for x in args.levels.split(",")]
        res = measure(serving, cfg.model.name or "model", levels, args.rounds, args.max_tokens, args.temperature)
        res["title"] = (f"{cfg.model.name}, {cfg.cluster.num_hosts} hosts x {cfg.cluster.devices_per_host} CPU "
                        f"devices, mesh {cfg.mesh_shape}, max_slots {cfg.engine.max_slots}, "
                        f"{args.max_tokens} tokens/request, engine {args.engine}")
        res["config_overrides"] = args.overrides
        res["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)  # other work on the machine skews figures
        res["cpu_count"] = os.cpu_count()
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
        plot(res, out.with_suffix(".png"))
        print(json.dumps({k: v for k, v in res.items() if k != "levels"}, indent=2))
    finally:
        if serving is not None:
            serving.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
