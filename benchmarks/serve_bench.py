"""A real load client against the embedded default: every prompt sent at once, every request served.

Brings up the embedded default gang (2 host processes, dp=2, the real demo model) behind Ray Serve, then runs
guidellm (the load client from PyPI) against it over HTTP: streaming `/v1/completions`, synthetic prompts made
with the demo model's own tokenizer from its local directory, and the throughput profile with as many
concurrent requests as prompts (`--request-rate inf`: all at once). The server holds `engine.max_slots` +
`serving.max_queue` of them; the rest wait in the ingress's line (serving.max_waiting) instead of being
refused. Reports request success, TTFT p50/p99, ITL p50/p99 and output tok/s from guidellm's own JSON report,
with the machine (CPU flags, cores, jax version). Writes benchmarks/results/serve_bench.json.

    .venv/bin/python benchmarks/serve_bench.py                 # 200 prompts of 32 tokens, 32 tokens out
    .venv/bin/python benchmarks/serve_bench.py --requests 1000 --output-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "serve_bench.json"
DEMO_TOKENIZER = Path("~/.cache/raydeploy/models/smollm2-135m-instruct").expanduser()
"""The demo model's directory (tokenizer.json and its config): guidellm loads its tokenizer from here, offline."""


def guidellm_bin() -> str:
    """The guidellm command of this interpreter's environment."""
    exe = Path(sys.executable).parent / "guidellm"
    if not exe.exists():
        raise RuntimeError("guidellm is not installed (it is in the `test` extra: pip install -e '.[test]')")
    return str(exe)


def run_guidellm(url: str, model: str, *, requests: int, prompt_tokens: int, output_tokens: int, report: Path,
                 tokenizer: Path = DEMO_TOKENIZER, api_key: str | None = None, timeout_s: float = 1800.0,
                 log: Path | None = None) -> dict[str, Any]:
    """Run guidellm once against `url` (every request at once, streaming completions) and return `summary` of its
    JSON report, which it writes to `report`. Offline: the tokenizer comes from a local directory."""
    backend = f"kind=openai_http,target={url},model={model},request_format=/v1/completions,timeout={timeout_s:g}"
    if api_key:
        backend += f",api_key={api_key}"
    cmd = [guidellm_bin(), "run", "--backend", backend,
           "--profile", f"kind=throughput,max_concurrency={requests}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
           "--constraint", f"kind=max_requests,count={requests}",
           "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    report.unlink(missing_ok=True)
    with open(log or os.devnull, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s + 120)
    if proc.returncode != 0 or not report.exists():
        tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
        raise RuntimeError(f"guidellm exited {proc.returncode} without a report at {report}\n{tail}")
    return summary(json.loads(report.read_text()))


def _pct(dist: dict[str, Any], p: str) -> float | None:
    value = (dist.get("percentiles") or {}).get(p)
    return None if value is None else round(float(value), 2)


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The figures of guidellm's JSON report (its one benchmark): request counts, TTFT, ITL, TPOT and output
    tokens/s over the successful requests."""
    (bench,) = report["benchmarks"]
    m = bench["metrics"]
    ok = {k: m[k]["successful"] for k in ("time_to_first_token_ms", "inter_token_latency_ms",
                                           "time_per_output_token_ms", "output_token_count")}
    return {
        "requests": dict(m["request_totals"]),
        "duration_s": round(float(bench["duration"]), 2),
        "ttft_ms": {"p50": _pct(ok["time_to_first_token_ms"], "p50"),
                    "p99": _pct(ok["time_to_first_token_ms"], "p99"),
                    "count": ok["time_to_first_token_ms"]["count"]},
        "itl_ms": {"p50": _pct(ok["inter_token_latency_ms"], "p50"), "p99": _pct(ok["inter_token_latency_ms"], "p99"),
                   "count": ok["inter_token_latency_ms"]["count"]},
        "tpot_ms": {"p50": _pct(ok["time_per_output_token_ms"], "p50")},
        "output_tokens": float(ok["output_token_count"]["total_sum"]),
        "output_tok_per_s": round(float(m["output_tokens_per_second"]["successful"]["mean"]), 2),
        "output_tok_per_s_over_run": round(float(ok["output_token_count"]["total_sum"]) / float(bench["duration"]),
                                           2),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _machine() -> dict[str, Any]:
    import jax

    sys.path.insert(0, str(REPO / "benchmarks"))
    from machine import cpu_flags

    return {"cpu": platform.processor() or platform.machine(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(),
            "jax": jax.__version__, "python": platform.python_version()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--ready-timeout-s", type=float, default=900.0)
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(REPO))
    import ray

    from raydeploy.checkpoint.demo import resolve_checkpoint
    from raydeploy.config import load_config
    from raydeploy.serve.run import connect_ray, start_serving

    checkpoint = resolve_checkpoint("demo:smollm2-135m-instruct")
    # the embedded default, served on a free loopback port; requests time out well after the whole run
    cfg = load_config(None, [f"serving.port={_free_port()}", "serving.request_timeout_s=1800"])
    assert connect_ray(None, temp_dir=f"/tmp/rds-bench-{os.getpid()}", num_cpus=2)
    serving = None
    try:
        serving = start_serving(cfg, checkpoint_path=str(checkpoint))
        serving.wait_ready(args.ready_timeout_s)
        started = time.perf_counter()
        work = Path(f"/tmp/serve_bench-{os.getpid()}")
        work.mkdir(exist_ok=True)
        figures = run_guidellm(serving.url, checkpoint.name, requests=args.requests,
                               prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                               report=work / "guidellm.json", log=work / "guidellm.log")
        wall_s = time.perf_counter() - started
    finally:
        if serving is not None:
            serving.shutdown()
        ray.shutdown()
    result = {
        "benchmark": "guidellm against the embedded default (2 hosts x 1 CPU device, dp=2, demo model)",
        "client": {"name": "guidellm", "version": _version("guidellm"), "profile": "throughput, all at once",
                   "endpoint": "/v1/completions, streaming", "requests": args.requests,
                   "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens},
        "server": {"engine.max_slots": cfg.engine.max_slots, "serving.max_queue": cfg.serving.max_queue,
                   "serving.max_waiting": cfg.serving.max_waiting, "model.max_seq_len": cfg.model.max_seq_len},
        "figures": figures,
        "client_wall_s": round(wall_s, 1),
        "machine": _machine(),
        "when": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    ok = figures["requests"]
    return 0 if ok["successful"] == args.requests and not ok["errored"] else 1


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
