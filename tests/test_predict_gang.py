"""`raydeploy predict` over a real gang (2 host processes, real jax.distributed, local Ray cluster).

With the stand-in engine (fast, its tokens are predictable): every prompt's output equals the oracle,
order is kept under continuous batching, a malformed line mid-file gets an error row and the run completes,
and an interrupted run -- a torn output, or the `raydeploy predict` process killed with SIGKILL -- resumes
with exactly one row per input line, in order. With the real demo model: batch prediction equals per-prompt
greedy generation on the same gang.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from raydeploy.config import load_config
from raydeploy.predict import run_predict
from raydeploy.testing.toy import toy_expected_tokens

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.ray, pytest.mark.model]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    temp_dir = tempfile.mkdtemp(prefix="rdp-", dir="/tmp")
    ray.init(num_cpus=2, _temp_dir=temp_dir, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def codec(demo_checkpoint: Path):
    from raydeploy.serve.text import TextCodec

    return TextCodec.from_dir(demo_checkpoint)


def _args(inp: Path, out: Path, max_tokens: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(input=str(inp), output=str(out), max_tokens=max_tokens, temperature=0.0,
                              on_error="skip", address=None)


PROMPTS = [f"Prompt number {i}: tell me about {w}." for i, w in
           enumerate(["cats", "rivers", "the moon", "jazz", "bread", "glaciers", "chess", "rain", "maps", "owls",
                      "tea", "wind"])]


def _input(tmp_path: Path) -> Path:
    p = tmp_path / "in.jsonl"
    lines = [json.dumps({"prompt": t, "id": f"p{i}", "max_tokens": 3 + (i * 5) % 17}) for i, t in enumerate(PROMPTS)]
    lines.insert(4, "{not json")
    p.write_text("\n".join(lines) + "\n")
    return p


def test_toy_gang_order_and_resume(ray_cluster, codec, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = load_config(REPO / "configs" / "predict-small.yaml", ["engine.max_slots=4", "cluster.init_timeout_s=30"])
    inp, out = _input(tmp_path), tmp_path / "out.jsonl"
    assert run_predict(cfg, _args(inp, out), engine="toy") == 0
    assert "in.jsonl:5: invalid_input: not valid JSON" in capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(1, 14))  # input order, one row per line
    bad = rows.pop(4)
    assert bad["error"]["type"] == "invalid_input" and "not valid JSON" in bad["error"]["message"]
    assert bad["id"] == 5 and bad["token_ids"] == [] and bad["finish_reason"] == "error"
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(len(PROMPTS))]
    for i, r in enumerate(rows):
        want = toy_expected_tokens(codec.encode(PROMPTS[i]), 3 + (i * 5) % 17)
        assert r["token_ids"] == want, f"line {r['index']}"
        assert r["finish_reason"] == ("stop" if want[-1] == 2 else "length") and r["error"] is None

    # an interrupted run: 5 complete lines and a torn one; resuming completes it in order, keeping the 5
    full = out.read_text().splitlines(keepends=True)
    out.write_text("".join(full[:5]) + full[5][:20])
    assert run_predict(cfg, _args(inp, out), engine="toy") == 0
    assert "5 line(s) already in" in capsys.readouterr().err
    assert out.read_text().splitlines(keepends=True) == full
    # nothing left to do: no gang is started
    assert run_predict(cfg, _args(inp, out), engine="toy") == 0
    assert "wrote 0 row(s)" in capsys.readouterr().err


def test_driver_killed_mid_run_resumes_one_row_per_line(ray_cluster, codec, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    """`raydeploy predict` (a real process on this Ray cluster) is killed with SIGKILL after some rows are
    written; the same command again gives every input line exactly one row, in input order, each with the
    oracle's tokens (its lock died with the killed process)."""
    import ray

    overrides = ["engine.max_slots=2", "engine.max_new_tokens=200", "cluster.init_timeout_s=30"]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = [f"{t} (copy {k})" for k in range(3) for t in PROMPTS]
    inp.write_text("".join(json.dumps({"prompt": t, "max_tokens": 120 + i % 7}) + "\n"
                           for i, t in enumerate(prompts)))
    cmd = [sys.executable, "-m", "raydeploy", "predict", str(REPO / "configs" / "predict-small.yaml"),
           "--input", str(inp), "--output", str(out), "--engine", "toy",
           "--address", ray.get_runtime_context().gcs_address, *(a for o in overrides for a in ("--set", o))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not (
                out.exists() and out.read_bytes().count(b"\n") >= 3):
            time.sleep(0.05)
        assert proc.poll() is None, f"predict ended before it was killed: {proc.stderr.read()[-3000:]}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    n_before = out.read_bytes().count(b"\n")
    assert 3 <= n_before < len(prompts), n_before

    cfg = load_config(REPO / "configs" / "predict-small.yaml", overrides)
    assert run_predict(cfg, _args(inp, out), engine="toy") == 0
    assert f"{n_before} line(s) already in" in capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(1, len(prompts) + 1))
    for r, text in zip(rows, prompts, strict=True):
        assert r["error"] is None, r
        want = toy_expected_tokens(codec.encode(text), 120 + (r["index"] - 1) % 7)
        assert r["token_ids"] == want, f"line {r['index']}"


def test_toy_gang_coordinator_killed_mid_run_every_line_still_written(ray_cluster, codec, tmp_path: Path) -> None:
    """Rank 0 dies while lines are in flight: the requests fail retriably, predict waits for the restarted
    gang (not the dead generation, which can still read ready for a moment) and resubmits them; every line
    is written once, in order, with the oracle's tokens."""
    import os
    import signal
    import threading
    import time

    from raydeploy.gang.gang import start_gang

    cfg = load_config(REPO / "configs" / "predict-small.yaml",
                      ["engine.max_slots=2", "engine.max_new_tokens=200", "cluster.init_timeout_s=30",
                       "cluster.heartbeat_timeout_s=4",
                       "cluster.restart_backoff_s=0.2", "cluster.max_restarts=2"])
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = PROMPTS * 2
    inp.write_text("".join(json.dumps({"prompt": t, "max_tokens": 200}) + "\n" for t in prompts))
    gang = start_gang(cfg, engine="toy")
    killed: list[int] = []

    def kill_rank0_after_first_line() -> None:
        pid = gang.status()["host_status"][0]["pid"]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out.exists() and out.read_text().count("\n") >= 1):
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    try:
        gang.wait_ready(120)
        killer = threading.Thread(target=kill_rank0_after_first_line, daemon=True)
        killer.start()
        assert run_predict(cfg, _args(inp, out), engine="toy", gang=gang) == 0
        killer.join(5)
        assert killed, "rank 0 was not killed"
        st = gang.state()
        assert st["restarts"] == 1 and st["generation"] == 2, st
    finally:
        gang.shutdown(60)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(1, len(prompts) + 1))
    for r, text in zip(rows, prompts, strict=True):
        assert r["token_ids"] == toy_expected_tokens(codec.encode(text), 200), f"line {r['index']}"


REAL_PROMPTS = [
    {"prompt": "The capital of France is"},
    {"messages": [{"role": "user", "content": "Name three colors."}]},
    {"prompt": "1, 2, 3, 4,"},
    {"messages": [{"role": "user", "content": "What is the opposite of hot?"}]},
    {"prompt": "Once upon a time"},
]


@pytest.fixture(scope="module")
def real_gang(ray_cluster, demo_checkpoint: Path):
    from raydeploy.gang.gang import start_gang

    cfg = load_config(REPO / "configs" / "predict-small.yaml",
                      ["engine.max_slots=4", "model.max_seq_len=128",
                       "engine.max_new_tokens=24",
                       # generous failure detection: this test is about results, and CI machines are busy
                       "cluster.heartbeat_timeout_s=60", "cluster.step_timeout_s=600"])
    gang = start_gang(cfg, checkpoint_path=str(demo_checkpoint))
    try:
        gang.wait_ready(600)
        yield cfg, gang
    finally:
        gang.shutdown(120)


def test_real_model_batch_equals_per_prompt_greedy(real_gang, codec, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    """5 prompts over 4 slots (continuous batching, prompts of different lengths finishing at different
    steps) give exactly the tokens each prompt gets alone on the same gang, in input order; resuming an
    interrupted output reproduces the same file."""
    from raydeploy.engine.request import GenerationRequest
    from raydeploy.engine.step import SamplingParams

    cfg, gang = real_gang
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({**p, "id": f"r{i}", "max_tokens": 6 + 2 * i}) + "\n"
                           for i, p in enumerate(REAL_PROMPTS)))
    assert run_predict(cfg, _args(inp, out), gang=gang) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(len(REAL_PROMPTS))]
    assert all(r["error"] is None and len(r["input_sha256"]) == 16 for r in rows)

    for i, (p, row) in enumerate(zip(REAL_PROMPTS, rows, strict=True)):
        ids = codec.encode(p["prompt"]) if "prompt" in p else codec.encode_chat(codec.chat_prompt(p["messages"]))
        assert row["prompt_tokens"] == len(ids)
        events = gang.generate(GenerationRequest(f"alone-{i}", tuple(ids), 6 + 2 * i, SamplingParams()), 300)
        alone = [e.token_id for e in events if e.token_id is not None]
        assert row["token_ids"] == alone, f"prompt {i}: batch {row['token_ids']} vs alone {alone}"
        assert row["text"] == codec.decode(alone)
        assert row["finish_reason"] == events[-1].finish_reason
    assert "Paris" in rows[0]["text"]

    full = out.read_text().splitlines(keepends=True)
    out.write_text("".join(full[:2]) + full[2][:10])
    capsys.readouterr()
    assert run_predict(cfg, _args(inp, out), gang=gang) == 0
    assert "2 line(s) already in" in capsys.readouterr().err
    assert out.read_text().splitlines(keepends=True) == full
