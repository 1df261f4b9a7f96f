"""Batch prediction submitted as a Ray job to a separately started local cluster (`ray start --head` with
the dashboard and Ray token auth on), both with `ray job submit` and with `raydeploy submit`.

The cluster gets its own temp dir and free ports; at the end only its own processes are stopped (found
by that temp dir), never with a blind `ray stop`. The job runs the gang with the stand-in engine (`--engine
toy`) so the whole round trip takes seconds; the real model's batch prediction is covered in
tests/test_predict_gang.py.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from raydeploy.testing.toy import toy_expected_tokens

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
pytestmark = [pytest.mark.ray, pytest.mark.model]


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _pids_using(marker: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker in (d / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def _stop_cluster(temp_dir: str) -> None:
    """Stop only the processes of the cluster we started (their command lines name its temp dir)."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        pids = _pids_using(temp_dir)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while _pids_using(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(demo_checkpoint):
    # a unique short dir: its path marks this cluster's processes (and nobody else's) for the teardown
    temp_dir = tempfile.mkdtemp(prefix="rdsub-", dir="/tmp")
    gcs, dash, client, agent, agent_grpc, metrics, rt_env, nm, om = _free_ports(9)
    token = secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RAY_ADDRESS")}
    env.update(PATH=f"{BIN}:{env.get('PATH', '')}", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token,
               RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    cmd = [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
           f"--runtime-env-agent-port={rt_env}", f"--node-manager-port={nm}", f"--object-manager-port={om}",
           f"--temp-dir={temp_dir}", "--num-cpus=2", "--disable-usage-stats"]
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        yield {"address": f"http://127.0.0.1:{dash}", "env": env, "token": token}
    finally:
        _stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _job_input(tmp_path: Path, n: int) -> tuple[Path, list[str]]:
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(n)]
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps({"prompt": t, "max_tokens": 4 + i % 5}) + "\n" for i, t in enumerate(prompts)))
    return p, prompts


def _check_output(out: Path, prompts: list[str], codec) -> None:
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(1, len(prompts) + 1))
    for i, r in enumerate(rows):
        assert r["token_ids"] == toy_expected_tokens(codec.encode(prompts[i]), 4 + i % 5)


@pytest.fixture(scope="module")
def codec(demo_checkpoint):
    from raydeploy.serve.text import TextCodec

    return TextCodec.from_dir(demo_checkpoint)


def _job_config(tmp_path: Path) -> Path:
    wd = tmp_path / "job"
    wd.mkdir()
    text = (REPO / "configs" / "predict-small.yaml").read_text()
    (wd / "config.yaml").write_text(text)
    return wd


def test_ray_job_submit_predict(cluster, codec, tmp_path: Path) -> None:
    """The documented `ray job submit` command line (docs/ray-job-submit.md), run as is."""
    wd = _job_config(tmp_path)
    inp, prompts = _job_input(tmp_path, 6)
    out = tmp_path / "predictions.jsonl"
    runtime_env = json.dumps({"env_vars": {"HF_HUB_OFFLINE": "1"}})
    cmd = [str(BIN / "ray"), "job", "submit", "--address", cluster["address"], "--working-dir", str(wd),
           "--runtime-env-json", runtime_env, "--submission-id", "predict-1", "--",
           "python", "-m", "raydeploy", "predict", "config.yaml", "--input", str(inp), "--output", str(out),
           "--engine", "toy"]
    r = subprocess.run(cmd, env=cluster["env"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "succeeded" in (r.stdout + r.stderr).lower()
    st = subprocess.run([str(BIN / "ray"), "job", "status", "--address", cluster["address"], "predict-1"],
                        env=cluster["env"], capture_output=True, text=True, timeout=60)
    assert "Job 'predict-1' succeeded" in st.stdout + st.stderr
    _check_output(out, prompts, codec)


def test_raydeploy_submit_predict(cluster, codec, tmp_path: Path) -> None:
    inp, prompts = _job_input(tmp_path, 5)
    out = tmp_path / "out.jsonl"
    cmd = [str(BIN / "raydeploy"), "submit", str(REPO / "configs" / "predict-small.yaml"),
           "--address", cluster["address"], "--timeout-s", "600", "--",
           "predict", "--input", str(inp), "--output", str(out), "--engine", "toy"]
    r = subprocess.run(cmd, env=cluster["env"], capture_output=True, text=True, timeout=660)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "submitted job raydeploy-predict-" in r.stdout
    assert f"follow logs: ray job logs --address {cluster['address']} --follow raydeploy-predict-" in r.stdout
    assert "SUCCEEDED" in r.stdout
    _check_output(out, prompts, codec)


def test_submit_without_token_is_refused_clearly(cluster, tmp_path: Path) -> None:
    env = {k: v for k, v in cluster["env"].items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE")}
    env["HOME"] = str(tmp_path)  # no token file either
    cmd = [str(BIN / "raydeploy"), "submit", str(REPO / "configs" / "predict-small.yaml"),
           "--address", cluster["address"], "--", "predict", "--input", "x", "--output", "y"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert f"cannot reach the Ray Jobs API at {cluster['address']}" in r.stderr
    assert "RAY_AUTH_MODE=token" in r.stderr
