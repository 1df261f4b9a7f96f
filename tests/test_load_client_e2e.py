"""A real load client against the real stack: guidellm (from PyPI) sends 200 streaming completions at once to
the embedded default gang (2 host processes, dp=2, the real demo model) behind Ray Serve, over HTTP on loopback,
with synthetic prompts made by the demo model's tokenizer from its local directory.

The server admits `engine.max_slots` + `serving.max_queue` (16) of them; the other 184 wait in the ingress's
line instead of getting a 503, so every request succeeds, and guidellm writes its TTFT/ITL report, which is
parsed here (benchmarks/serve_bench.py reads the same report for its figures).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from raydeploy.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from serve_bench import DEMO_TOKENIZER, run_guidellm  # noqa: E402  (benchmarks/ is not a package)

pytestmark = [pytest.mark.ray, pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

READY_TIMEOUT_S = 900
REQUESTS = 200
SLOTS, QUEUE = 8, 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live(demo_checkpoint):
    """One deployment shared by this module's tests: the embedded default gang, a small context."""
    import ray

    from raydeploy.serve.run import connect_ray, start_serving

    cfg = load_config(None, [
        "model.max_seq_len=256", f"engine.max_slots={SLOTS}", f"serving.max_queue={QUEUE}",
        f"serving.port={_free_port()}", "serving.request_timeout_s=900"])
    assert cfg.serving.max_waiting >= REQUESTS
    assert connect_ray(None, temp_dir=f"/tmp/rdl-{os.getpid()}", num_cpus=2)
    serving = None
    try:
        serving = start_serving(cfg, checkpoint_path=str(demo_checkpoint))
        serving.wait_ready(READY_TIMEOUT_S)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                if httpx.get(serving.url + "/ready", timeout=10).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the HTTP ingress did not become ready"
            time.sleep(0.5)
        yield serving
    finally:
        if serving is not None:
            serving.shutdown()
        ray.shutdown()


def test_guidellm_all_at_once_every_request_succeeds(live, demo_checkpoint, tmp_path):
    assert (DEMO_TOKENIZER / "tokenizer.json").exists(), "the demo model's directory has no tokenizer"
    report = tmp_path / "guidellm.json"
    figures = run_guidellm(live.url, demo_checkpoint.name, requests=REQUESTS, prompt_tokens=16, output_tokens=16,
                           report=report, log=tmp_path / "guidellm.log", timeout_s=900)
    assert figures["requests"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}, (
        figures, (tmp_path / "guidellm.log").read_text()[-3000:])
    # the report is written and holds TTFT and ITL for every request
    assert report.exists()
    assert figures["ttft_ms"]["count"] == REQUESTS and 0 < figures["ttft_ms"]["p50"] <= figures["ttft_ms"]["p99"]
    assert figures["itl_ms"]["count"] > 0 and figures["itl_ms"]["p50"] > 0
    assert figures["output_tokens"] == REQUESTS * 16  # guidellm asks for exactly 16 (ignore_eos)
    # they really were in flight together, far beyond what the gang admits at once: the rest waited
    bench = json.loads(report.read_text())["benchmarks"][0]
    concurrency = bench["metrics"]["request_concurrency"]["successful"]
    assert concurrency["max"] > SLOTS + QUEUE, concurrency
    # and the server is idle again, nothing left admitted
    status = httpx.get(live.url + "/status", timeout=30).json()
    assert status["serving"]["admitted"] == 0, status["serving"]
