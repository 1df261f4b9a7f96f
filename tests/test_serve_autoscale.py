"""Autoscaling of gangs: a real local Ray cluster and Ray Serve HTTP, gang replicas of one host with the
stand-in engine. Load raises the count from 1 to 2 gangs; idleness lowers it back to 1 while a client keeps
sending one request at a time; every request is answered, correctly.
"""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest
from test_serve_replicas import (
    PROMPT,
    READY_TIMEOUT_S,
    _free_port,
    expected_text,
    replica_cfg,
    wait_http_ready,
)

pytestmark = [pytest.mark.ray, pytest.mark.e2e, pytest.mark.slow,
              # Serve warns that look_back_period_s should exceed the deprecated metrics_interval_s (10 s); load
              # is reported every 0.5 s here (SERVE_ENV), so a 2 s window holds four reports
              pytest.mark.filterwarnings("ignore:`look_back_period_s`:FutureWarning")]

# Serve's handles and replicas report load every 10 s by default; the test wants decisions in seconds.
SERVE_ENV = {"RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
             "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5"}


@pytest.fixture(scope="module")
def codec(demo_checkpoint):
    from raydeploy.serve.text import TextCodec

    return TextCodec.from_dir(demo_checkpoint)


def test_load_adds_a_gang_and_idleness_removes_it(demo_checkpoint, codec, monkeypatch):
    import ray

    from raydeploy.serve.run import connect_ray, start_serving

    for k, v in SERVE_ENV.items():  # before Ray starts: its workers inherit them
        monkeypatch.setenv(k, v)
    assert connect_ray(None, temp_dir=f"/tmp/rdas-{os.getpid()}", num_cpus=2)
    serving = None
    sent: list[tuple[float, int, str, int]] = []
    stop, busy = threading.Event(), threading.Event()
    threads: list[threading.Thread] = []
    try:
        cfg = replica_cfg(_free_port(), "replicas.min=1", "replicas.max=2", "engine.max_slots=2",
                          "replicas.target_ongoing_requests=2", "replicas.upscale_delay_s=1",
                          "replicas.downscale_delay_s=4", "replicas.look_back_period_s=2")
        serving = start_serving(cfg, checkpoint_path=str(demo_checkpoint), engine="toy")
        serving.wait_ready(READY_TIMEOUT_S, count=1)
        wait_http_ready(serving.url, READY_TIMEOUT_S)
        assert serving.gangs.state()["total_gangs"] == 1

        def client(loaded: bool) -> None:
            """Sends one request after another; the `loaded` ones only while `busy` is set."""
            n = 400 if loaded else 8
            with httpx.Client(timeout=300) as c:
                while not stop.is_set():
                    if loaded and not busy.is_set():
                        time.sleep(0.05)
                        continue
                    at = time.monotonic()
                    r = c.post(serving.url + "/v1/completions",
                               json={"prompt": PROMPT, "max_tokens": n, "ignore_eos": True, "temperature": 0})
                    sent.append((at, r.status_code, r.text, n))

        busy.set()
        threads += [threading.Thread(target=client, args=(i < 6,)) for i in range(7)]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        up = serving.wait_ready(READY_TIMEOUT_S, count=2)  # 6 requests at once on 2 slots: a second gang
        scaled_up_s = time.monotonic() - t0
        assert up["total_gangs"] == 2 and up["ready_gangs"] == 2
        # the second gang takes requests too
        deadline = time.monotonic() + 120
        while True:
            stats = httpx.get(serving.url + "/status", timeout=60).json()["engine"]["gangs"]
            if len(stats) == 2 and all(s.get("requests_done", 0) > 0 for s in stats.values()):
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)
        busy.clear()  # idle but for one client sending one request at a time
        t0 = time.monotonic()
        deadline = t0 + 300
        while serving.gangs.state()["total_gangs"] != 1:
            assert time.monotonic() < deadline, serving.gangs.state()
            time.sleep(0.2)
        scaled_down_s = time.monotonic() - t0
        after_down = time.monotonic()
        while len([s for s in sent if s[0] > after_down]) < 3:  # the remaining gang keeps serving
            assert time.monotonic() < after_down + 120
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(300)
        if serving is not None:
            serving.shutdown()
        ray.shutdown()
    assert len(sent) >= 20, len(sent)
    wrong = [(status, text[:200]) for _, status, text, n in sent
             if status != 200 or json.loads(text)["choices"][0]["text"] != expected_text(codec, n)]
    assert not wrong, wrong  # every request answered, correctly, through the scale-up and the scale-down
    print(f"autoscaling: 1 -> 2 gangs in {scaled_up_s:.1f}s under load, 2 -> 1 in {scaled_down_s:.1f}s idle; "
          f"{len(sent)} requests, all 200")
