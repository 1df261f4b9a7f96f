"""Serving load benchmark: output tokens/s, time to first token and time per output token over HTTP at
1, 4 and 16 concurrent streams, and the HTTP layer's overhead against the engine's own step time.

Brings up the embedded default gang shape (2 host processes x 2 virtual CPU devices, the real demo model)
behind Ray Serve, streams chat completions with the official `openai` client, and reads the coordinator's
step clock over the same windows. Writes a JSON of the figures and a PNG plot.

    .venv/bin/python benchmarks/serve_load.py [--rounds 2] [--max-tokens 64] [--out docs/serve_load]

With `--replicas N` it compares gangs behind one endpoint instead, in one run: the same load (16 streams) on
1 gang and on N gangs (each one host with one device), then, on the N gangs, a host of one gang killed while a
client sends requests continuously: how many requests submitted after the failure succeeded, and how long the
gang took to come back. Writes OUT.json (default docs/serve_replicas.json).

    .venv/bin/python benchmarks/serve_load.py --replicas 2 [--max-tokens 32] [--rounds 1]
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
        before = serving.gangs.ready_gang().status()["stats"]
        for r in range(rounds):
            res, w = asyncio.run(_round(serving.url, None, model, c, max_tokens, temperature, r * c))
            reqs += res
            wall += w
            tokens += sum(x["tokens"] for x in res)
        after = serving.gangs.ready_gang().status()["stats"]
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


def _gang_requests(serving) -> dict[str, int]:
    return {g["gang"]: (g.get("stats") or {}).get("requests_done", 0) for g in serving.gangs.status()["gangs"]}


def measure_streams(serving, model: str, concurrency: int, rounds: int, max_tokens: int, temperature: float) -> dict:
    """Aggregate output tokens/s of `concurrency` streams over every gang, and how the requests spread."""
    asyncio.run(_round(serving.url, None, model, 2, 8, temperature, 0))  # warm the HTTP path
    before = _gang_requests(serving)
    tokens, wall, n = 0, 0.0, 0
    for r in range(rounds):
        res, w = asyncio.run(_round(serving.url, None, model, concurrency, max_tokens, temperature, r * concurrency))
        tokens += sum(x["tokens"] for x in res)
        wall += w
        n += len(res)
    after = _gang_requests(serving)
    return {"concurrency": concurrency, "requests": n, "tokens": tokens, "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 2),
            "requests_per_gang": {k: after.get(k, 0) - before.get(k, 0) for k in after}}


def failure_run(serving, model: str, max_tokens: int, after_s: float, ready_timeout_s: float, gangs: int) -> dict:
    """A client sends requests continuously (2 at a time); a host of one gang is killed; returns the success
    of the requests submitted after the kill (until `after_s` later) and the time to the gang's return."""
    import signal
    import threading

    import httpx

    sent: list[tuple[float, int]] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=600) as c:
            while not stop.is_set():
                at = time.monotonic()
                try:
                    r = c.post(serving.url + "/v1/chat/completions", json={
                        "model": model, "messages": [{"role": "user", "content": "Name a colour."}],
                        "max_tokens": max_tokens, "temperature": 0})
                    sent.append((at, r.status_code))
                except httpx.HTTPError:
                    sent.append((at, 0))

    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 300
        while len(sent) < 4:
            if time.monotonic() > deadline:
                raise RuntimeError("the client got no answers before the kill")
            time.sleep(0.1)
        victim = serving.gangs.status()["gangs"][0]
        pid = victim["host_status"][0]["pid"]
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        seen_down_s = back_s = None
        while time.monotonic() < killed + after_s:  # when the gang left the ready set, and when it came back
            ready = serving.gangs.state()["ready_gangs"]
            if seen_down_s is None and ready < gangs:
                seen_down_s = time.monotonic() - killed
            elif seen_down_s is not None and back_s is None and ready == gangs:
                back_s = time.monotonic() - killed
            time.sleep(0.25)
        window_end = time.monotonic()
        back = serving.wait_ready(ready_timeout_s, count=gangs)
        if back_s is None:
            back_s = time.monotonic() - killed
    finally:
        stop.set()
        for t in threads:
            t.join(600)
    after = [status for at, status in sent if killed < at <= window_end]
    return {"victim": victim["gang"], "requests_after_kill": len(after), "succeeded": after.count(200),
            "success_pct": round(100.0 * after.count(200) / max(1, len(after)), 2),
            "statuses_after_kill": {str(s): after.count(s) for s in sorted(set(after))},
            "window_s": after_s, "gang_not_ready_after_s": None if seen_down_s is None else round(seen_down_s, 1),
            "ready_gangs_back_after_s": round(back_s, 1),
            "ready_gangs_at_end": back["ready_gangs"]}


def compare_replicas(args: argparse.Namespace) -> dict:
    """1 gang, then `args.replicas` gangs, each one host with one device; the N-gang run also loses a host."""
    import ray

    from raydeploy.serve.run import connect_ray, start_serving

    one_host = ["cluster.num_hosts=1", "cluster.devices_per_host=1", "mesh.axes={dp: 1}",
                "cluster.heartbeat_timeout_s=5"]
    out: dict = {"runs": {}}
    connect_ray(None, temp_dir=f"/tmp/rdb-{os.getpid()}")
    try:
        for n in (1, args.replicas):
            cfg = load_config(None, [*args.overrides, *one_host, f"replicas.min={n}", f"replicas.max={n}",
                                     f"serving.port={_free_port()}"])
            t0 = time.perf_counter()
            serving = start_serving(cfg, engine=args.engine)
            try:
                serving.wait_ready(1800, count=n)
                run = {"gangs": n, "ready_s": round(time.perf_counter() - t0, 1)}
                run["load"] = measure_streams(serving, cfg.model.name or "model", 16, args.rounds, args.max_tokens,
                                              args.temperature)
                print(json.dumps(run), flush=True)
                if n > 1:
                    run["failure"] = failure_run(serving, cfg.model.name or "model", 8, args.failure_window_s, 1800, n)
                    print(json.dumps(run["failure"]), flush=True)
                out["runs"][n] = run
            finally:
                serving.shutdown()
    finally:
        ray.shutdown()
    one, many = out["runs"][1]["load"], out["runs"][args.replicas]["load"]
    out["tokens_per_s_ratio"] = round(many["tokens_per_s"] / one["tokens_per_s"], 3)
    out["config_overrides"] = args.overrides
    out["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    out["cpu_count"] = os.cpu_count()
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
    p.add_argument("--out", default=None, help="writes OUT.json and OUT.png (default docs/serve_load; with "
                                               "--replicas docs/serve_replicas, JSON only)")
    p.add_argument("--replicas", type=int, default=None,
                   help="compare this many gangs (one 1-device host each) with one, and lose a host of one")
    p.add_argument("--failure-window-s", type=float, default=60.0,
                   help="with --replicas: seconds of requests counted after the host is killed")
    args = p.parse_args()
    if args.replicas is not None:
        if args.replicas < 2:
            p.error(f"--replicas compares N >= 2 gangs with 1, found {args.replicas}")
        res = compare_replicas(args)
        out = Path(args.out or "docs/serve_replicas").with_suffix(".json")
        out.write_text(json.dumps(res, indent=2) + "\n")
        print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=2))
        return 0

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
        out = Path(args.out or "docs/serve_load")
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
