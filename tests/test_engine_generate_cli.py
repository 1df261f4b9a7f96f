"""`raydeploy generate` as a user runs it: a subprocess with the embedded default config (2x2 mesh of virtual
CPU devices in one process), the demo checkpoint, the chat template, greedy decoding, JSON output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

SMALL = ["--set", "model.max_seq_len=256", "--set", "engine.max_new_tokens=128", "--set", "engine.max_slots=2"]


def _run(*args: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "raydeploy", "generate", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO, env=dict(os.environ))


@pytest.mark.model
def test_generate_chat_json(demo_checkpoint):
    r = _run("--chat", "What is the capital of France?", "--max-tokens", "12", "--temperature", "0", "--json",
             *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "Paris" in out["text"]
    assert out["token_ids"][:2] == [504, 3575]  # "The capital", as transformers' greedy decoding gives
    assert out["finish_reason"] in ("stop", "length") and out["prompt_tokens"] > 20
    assert out["mesh"] == {"dp": 2}
    assert set(out["timings"]) >= {"load_s", "first_token_s", "total_s"}


def test_generate_rejects_bad_max_tokens_before_loading():
    r = _run("--prompt", "hi", "--max-tokens", "0", timeout_s=120)
    assert r.returncode == 1
    assert "--max-tokens must be >= 1, found 0" in r.stderr
    assert "Traceback" not in r.stderr
