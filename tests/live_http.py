"""What the modules that serve the real gang over HTTP share: a free port for the ingress, and the wait for its
/ready (the gangs report ready before the proxy routes to every ingress replica)."""

from __future__ import annotations

import socket
import time

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
