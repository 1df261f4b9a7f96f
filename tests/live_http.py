"""What the modules that serve the real gang over HTTP share: a free port for the ingress, and the wait for its
/ready (the gangs report ready before the proxy routes to every ingress replica)."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http_ready(url: str, timeout_s: float) -> None:
    """Until `url`/ready answers 200 (bounded by `timeout_s`: an assertion names what did not come up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/ready", timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the HTTP ingress did not become ready"
        time.sleep(0.5)


@contextlib.contextmanager
def live_serving(cfg: Any, checkpoint: str, ray_temp_prefix: str, ready_timeout_s: float) -> Iterator[Any]:
    """The real gang behind Ray Serve HTTP for `cfg`: a local Ray of 2 CPUs (its temp dir named by the prefix and
    this process), `start_serving`, both readiness waits; shut down and Ray stopped on the way out."""
    import ray

    from raydeploy.serve.run import connect_ray, start_serving

    assert connect_ray(None, temp_dir=f"/tmp/{ray_temp_prefix}-{os.getpid()}", num_cpus=2)
    serving = None
    try:
        serving = start_serving(cfg, checkpoint_path=checkpoint)
        serving.wait_ready(ready_timeout_s)
        wait_http_ready(serving.url, ready_timeout_s)
        yield serving
    finally:
        if serving is not None:
            serving.shutdown()
        ray.shutdown()
