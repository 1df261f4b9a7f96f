"""Bring-up time of the embedded default as a user meets it, phase by phase, and the TPU compile report.

Runs `raydeploy serve` (the embedded default: 2 simulated hosts, the demo model) with its own compilation
cache directory and Ray temp dir, and times until `GET /ready` answers 200:
- cold: empty compile cache (the demo checkpoint already converted);
- warm: a second start with the cache the cold start wrote;
- restart: one host process killed while serving, until ready again;
then `raydeploy compile configs/tpu-v5e-16.yaml` (deviceless through libtpu) with its total and per-program
seconds. Each start reports the gang's phases (placement, actors, init, load, compile) and per host how many
programs were loaded from the cache and how many compiled, from `GET /status`.

Peer, measured in the same run: the engine alone in one process (`Engine` built from the same checkpoint on
one CPU device, then `warmup()`), cold and warm, which is the floor the served gang adds its processes to.

    python benchmarks/bringup.py [--port 8123] [--json] [--out benchmarks/results/bringup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from machine import cpu_flags  # benchmarks/machine.py (scripts run with benchmarks/ on sys.path)

REPO = Path(__file__).resolve().parents[1]


def get_json(url: str, timeout_s: float = 5.0) -> tuple[int, dict | None]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None
    except (OSError, ValueError):
        return 0, None


def wait_ready(base: str, limit_s: float, proc: subprocess.Popen | None = None) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"raydeploy serve exited with {proc.returncode} before it was ready")
        if get_json(base + "/ready")[0] == 200:
            return time.perf_counter() - t0
        time.sleep(0.2)
    raise SystemExit(f"not ready within {limit_s:.0f} s")


def gang_figures(base: str) -> dict:
    _, st = get_json(base + "/status", 30.0)
    gang = (st or {}).get("gang", st or {})
    if isinstance(gang.get("gangs"), list) and gang["gangs"]:  # gangs behind the endpoint: the first one
        gang = gang["gangs"][0]
    hosts = gang.get("host_status", [])
    return {"phase_s": gang.get("phase_s"), "restarts": gang.get("restarts"),
            "hosts": [{"rank": h.get("rank"), "pid": h.get("pid"), "loaded": h.get("programs_loaded"),
                       "compiled": h.get("programs_compiled"), "phase_s": h.get("phase_s")} for h in hosts]}


def serve(port: int, cache: str, ray_tmp: str) -> subprocess.Popen:
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, "-m", "raydeploy", "serve", "--set", f"serving.port={port}",
           "--set", f"engine.compilation_cache_dir={cache}"]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def run_start(port: int, cache: str, ray_tmp: str, restart: bool) -> dict:
    base = f"http://127.0.0.1:{port}"
    proc = serve(port, cache, ray_tmp)
    try:
        ready_s = wait_ready(base, 900, proc)
        out = {"ready_s": round(ready_s, 1), **gang_figures(base)}
        if restart:
            victim = next(h for h in out["hosts"] if h["rank"] == 1)
            os.kill(victim["pid"], signal.SIGKILL)
            t1 = time.perf_counter()
            while get_json(base + "/ready")[0] == 200 and time.perf_counter() - t1 < 60:
                time.sleep(0.05)  # until the supervisor notices
            again = wait_ready(base, 600, proc)
            out["restart"] = {"ready_again_s": round(time.perf_counter() - t1, 1), "noticed_s":
                              round(time.perf_counter() - t1 - again, 1), **gang_figures(base)}
        return out
    finally:
        stop(proc)


def engine_alone(cache: str) -> float:
    """Seconds to build the engine from the demo checkpoint and warm it up, in a fresh process."""
    code = f"""
import time, jax
t0 = time.perf_counter()
from raydeploy.checkpoint.demo import resolve_checkpoint
from raydeploy.checkpoint.reader import CheckpointReader
from raydeploy.config import load_config
from raydeploy.engine.engine import Engine
from raydeploy.model.registry import from_hf_config
from raydeploy.model.sharding import build_mesh, merge_rules
from raydeploy.model.spec import param_specs
cfg = load_config("configs/local.yaml", ["engine.compilation_cache_dir={cache}"])
mesh = build_mesh({{"dp": 1}}, jax.devices()[:1])
rules = merge_rules(cfg.mesh.rules)
reader = CheckpointReader(resolve_checkpoint(cfg.model.checkpoint))
params, _ = reader.load(reader.param_specs(), mesh, rules, cfg.model.param_dtype, 2, progress=False)
engine = Engine(*from_hf_config(reader.hf_config), params, mesh, rules, cfg.model, cfg.engine)
engine.warmup()
print(time.perf_counter() - t0, engine.program_counts())
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise SystemExit(r.stderr[-2000:])
    return round(float(r.stdout.split()[0]), 1)


def compile_report() -> dict:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "raydeploy", "compile", "configs/tpu-v5e-16.yaml", "--json"],
                       cwd=REPO, capture_output=True, text=True, timeout=3600)
    if r.returncode:
        raise SystemExit(r.stderr[-2000:])
    rep = json.loads(r.stdout)
    return {"wall_s": round(time.perf_counter() - t0, 1), "total_compile_s": rep["total_compile_s"],
            "programs": {p["name"]: p["compile_s"] for p in rep["programs"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/bringup.json"))
    ap.add_argument("--skip-compile-report", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rd-bringup-") as tmp:
        cache, ray_tmp, peer_cache = f"{tmp}/cache", f"{tmp}/ray", f"{tmp}/peer-cache"
        os.makedirs(ray_tmp)
        res: dict = {"cpu_flags": cpu_flags(), "cores": os.cpu_count()}
        res["cold"] = run_start(args.port, cache, ray_tmp, restart=False)
        res["warm"] = run_start(args.port, cache, ray_tmp, restart=True)
        res["engine_alone"] = {"cold_s": engine_alone(peer_cache), "warm_s": engine_alone(peer_cache)}
        if not args.skip_compile_report:
            res["compile_tpu_v5e_16"] = compile_report()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"CPU flags: {res['cpu_flags']} ({res['cores']} cores)")
    for k in ("cold", "warm"):
        r = res[k]
        print(f"{k:>8}: ready in {r['ready_s']} s; gang phases {r['phase_s']}; programs per host "
              f"{[(h['loaded'], h['compiled']) for h in r['hosts']]} (loaded, compiled)")
    r = res["warm"]["restart"]
    print(f" restart: ready again {r['ready_again_s']} s after the kill (noticed after {r['noticed_s']} s); "
          f"phases {r['phase_s']}; programs {[(h['loaded'], h['compiled']) for h in r['hosts']]}")
    print(f"  peer, engine alone in one process: cold {res['engine_alone']['cold_s']} s, "
          f"warm {res['engine_alone']['warm_s']} s")
    if "compile_tpu_v5e_16" in res:
        c = res["compile_tpu_v5e_16"]
        print(f"compile tpu-v5e-16: {len(c['programs'])} programs in {c['total_compile_s']} s "
              f"(slowest: {sorted(c['programs'].items(), key=lambda kv: -kv[1])[:3]})")


if __name__ == "__main__":
    main()
