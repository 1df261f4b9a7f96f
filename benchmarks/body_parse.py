"""What a hostile body costs the ingress, before and after the linear-time body check, each figure with its peer.

1. Parse time of the body that was worst for the old depth pre-scan (more brackets than MAX_DEPTH, then an
   unclosed string of escaped quotes), at 64 KiB and 1 MiB: the old check (raydeploy/serve/body.py at the
   commit given by --old-commit, loaded from git into a temporary module), the new one, and `json.loads` of the
   same bytes as the peer. The old check is quadratic: it is measured up to --old-max-kib and its 1 MiB time is
   extrapolated from the measured growth (marked as such; a run would take about half an hour).
2. /health latency (p50, p99, max) while 8 clients send worst-case 64 KiB bodies: the app served by uvicorn in
   a separate process over the in-process fake gang (tests/serve_fakes.py), once from this tree and once from
   a checkout of the old commit (`git worktree add /tmp/old <commit>`, passed as --old-tree), same script.

    .venv/bin/python benchmarks/body_parse.py [--old-commit 00a8deb] [--old-tree /tmp/old] \
        [--out benchmarks/results/body_parse.json]

Run it alone on the machine (it measures latency).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORST_HEAD = b'{"prompt": ' + b"[" * 40 + b'"'


def worst_body(size: int) -> bytes:
    return WORST_HEAD + b'\\"' * ((size - len(WORST_HEAD)) // 2)


def best_s(fn: Callable[[], Any], reps: int, budget_s: float = 5.0) -> float:
    times: list[float] = []
    while len(times) < reps and (sum(times) < budget_s or not times):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def old_body_module(commit: str) -> Any:
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:raydeploy/serve/body.py"], check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_body.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_body", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_figures(commit: str, old_max_kib: int) -> dict[str, Any]:
    from raydeploy.serve import body as new
    from raydeploy.serve.errors import InvalidRequest

    old = old_body_module(commit)

    def run(parse: Callable[[bytes], Any], raw: bytes) -> Callable[[], None]:
        def call() -> None:
            try:
                parse(raw)
            except (InvalidRequest, ValueError):
                pass
        return call

    out: dict[str, Any] = {"new_s": {}, "json_loads_s": {}, "old_s": {}}
    for kib in (64, 1024):
        raw = worst_body(kib * 1024)
        out["new_s"][f"{kib}KiB"] = best_s(run(new.parse_json_object, raw), 9)
        out["json_loads_s"][f"{kib}KiB"] = best_s(run(json.loads, raw), 9)
    sizes = [k for k in (16, 32, 64, 128, 256) if k <= old_max_kib]
    for kib in sizes:
        out["old_s"][f"{kib}KiB"] = best_s(run(old.parse_json_object, worst_body(kib * 1024)), 3, budget_s=1.0)
        print(f"old check, {kib} KiB: {out['old_s'][f'{kib}KiB']:.3f} s", flush=True)
    # growth exponent from the two largest sizes measured, then the 1 MiB time extrapolated with it
    a, b = sizes[-2], sizes[-1]
    exponent = (statistics.log(out["old_s"][f"{b}KiB"]) - statistics.log(out["old_s"][f"{a}KiB"])) / \
        (statistics.log(b) - statistics.log(a))
    out["old_growth_exponent"] = round(exponent, 2)
    out["old_s_1024KiB_extrapolated"] = out["old_s"][f"{b}KiB"] * (1024 / b) ** exponent
    out["ratio_new_to_json_loads"] = {k: round(out["new_s"][k] / out["json_loads_s"][k], 2) for k in out["new_s"]}
    if "64KiB" in out["old_s"]:
        out["ratio_old_to_new_64KiB"] = round(out["old_s"]["64KiB"] / out["new_s"]["64KiB"], 1)
    out["ratio_old_extrapolated_to_new_1024KiB"] = round(out["old_s_1024KiB_extrapolated"] / out["new_s"]["1024KiB"])
    return out


# -- /health under attack --------------------------------------------------------------------------------


def serve(port: int) -> None:
    """Server mode (a separate process): the app of whichever raydeploy is first on PYTHONPATH, over the fake gang."""
    import uvicorn
    from serve_fakes import FakeBackend, tokenizer_dir

    import raydeploy
    from raydeploy.config import load_config
    from raydeploy.serve.app import create_app
    from raydeploy.serve.generation import Limits, ServingCore
    from raydeploy.serve.text import TextCodec

    print(f"serving raydeploy from {Path(raydeploy.__file__).parent}", flush=True)
    cfg = load_config(None, ["model.max_seq_len=128", "engine.max_new_tokens=64"])
    codec = TextCodec.from_dir(tokenizer_dir())
    backend = FakeBackend(codec.encode(" Hello.") + list(codec.eos_token_ids), codec.eos_token_ids[0])
    core = ServingCore(backend, codec, Limits.from_config(cfg, "bench"))
    app = create_app(core, max_body_bytes=cfg.serving.max_body_bytes)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")


def health_under_attack(tree: Path, clients: int, body_kib: int, window_s: float) -> dict[str, Any]:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"PYTHONPATH": f"{tree}:{tree / 'tests'}", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", str(port)], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the server from {tree} did not start")
            time.sleep(0.2)
        global _PROBE
        _PROBE = None  # a new connection to this server
        idle = [_timed_get(url) for _ in range(50)]
        stop = threading.Event()
        sent: list[tuple[int, float]] = []
        raw = worst_body(body_kib * 1024)

        def attack() -> None:
            with httpx.Client(timeout=3600) as c:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    try:
                        r = c.post(url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
                    except httpx.TransportError:  # the server stopped at the end of the window
                        return
                    sent.append((r.status_code, time.perf_counter() - t0))

        threads = [threading.Thread(target=attack, daemon=True) for _ in range(clients)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        lat: list[float] = []
        end = time.monotonic() + window_s
        while time.monotonic() < end:
            lat.append(_timed_get(url))
            time.sleep(0.05)
        stop.set()
        return {"tree": str(tree), "clients": clients, "body_kib": body_kib, "window_s": window_s,
                "health_idle_ms": _summary(idle), "health_under_attack_ms": _summary(lat),
                "attack_bodies_answered": len(sent), "attack_statuses": sorted({s for s, _ in sent}),
                "attack_answer_s_median": round(statistics.median([d for _, d in sent]), 4) if sent else None}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


_PROBE: Any = None


def _timed_get(url: str) -> float:
    """One /health round trip on a kept-alive connection, in ms."""
    global _PROBE
    import httpx

    if _PROBE is None:
        _PROBE = httpx.Client(timeout=600)
    t0 = time.perf_counter()
    r = _PROBE.get(url + "/health")
    assert r.status_code == 200, r.text
    return (time.perf_counter() - t0) * 1000


def _summary(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    return {"n": len(s), "p50": round(s[len(s) // 2], 2), "p99": round(s[min(len(s) - 1, int(len(s) * 0.99))], 2),
            "max": round(s[-1], 2)}


def machine() -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    from machine import cpu_flags

    return {"cpu_flags": cpu_flags(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "load_average_1m": round(os.getloadavg()[0], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--old-commit", default="00a8deb")
    ap.add_argument("--old-tree", type=Path, default=Path("/tmp/old"))
    ap.add_argument("--old-max-kib", type=int, default=128)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--body-kib", type=int, default=64)
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--no-parse", action="store_true", help="only the /health figures")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/body_parse.json")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return
    res: dict[str, Any] = {"machine": machine(), "old_commit": args.old_commit}
    if not args.no_parse:
        res["parse"] = parse_figures(args.old_commit, args.old_max_kib)
        print(json.dumps(res["parse"], indent=1), flush=True)
    res["health"] = {"new": health_under_attack(ROOT, args.clients, args.body_kib, args.window_s)}
    print(json.dumps(res["health"]["new"], indent=1), flush=True)
    if args.old_tree.exists():
        res["health"]["old"] = health_under_attack(args.old_tree, args.clients, args.body_kib, args.window_s)
        print(json.dumps(res["health"]["old"], indent=1), flush=True)
    res["machine"]["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
