"""`raydeploy status`: readable output of /ready and /status, API key passed, clear errors.

A small local HTTP server stands in for the deployment here (fast); tests/test_cli_status_live.py runs
the same command against the real Serve app and gang.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from raydeploy.cli import main

STATUS = {"status": "Ready", "state": "ready", "restarts": 1, "last_error": None, "model": "smollm2-135m-instruct",
          "config": {"num_hosts": 2, "devices_per_host": 2}, "devices": 4, "process_count": 2,
          "mesh": {"dp": 2, "tp": 2}, "uptime_s": 12.5, "requests_served": 7,
          "serving": {"queue_capacity": 64, "admitted": 0}, "engine": {"steps": 120},
          "ready_gangs": 1, "total_gangs": 2,
          "gang": {"state": "ready", "ready_gangs": 1, "total_gangs": 2, "gangs": [
              {"gang": "raydeploy-gang-raydeploy-a1", "state": "ready", "restarts": 1, "last_error": None,
               "host_status": [{"rank": 0, "pid": 101}, {"rank": 1, "pid": 102}],
               "placement": {"slice": "slice-a", "rank_bundle": [1, 0]},
               "hosts": [{"rank": 0, "programs": {"loaded": 12, "compiled": 0}},
                         {"rank": 1, "programs": {"loaded": 9, "compiled": 3}}]},
              {"gang": "raydeploy-gang-raydeploy-b2", "state": "restarting", "restarts": 0,
               "last_error": "host 0 failed: RayActorError", "host_status": [{"rank": 0, "pid": 201}]}]}}


def _server(ready: bool, key: str | None):
    seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append(self.headers.get("Authorization"))
            if self.path == "/ready":
                code, body = (200, {"ready": True, "state": "ready", "ready_gangs": 1, "total_gangs": 2}) if ready else \
                    (503, {"ready": False, "state": "loading"})
            elif self.path == "/status" and key and self.headers.get("Authorization") != f"Bearer {key}":
                code, body = 401, {"error": {"message": "missing or invalid API key", "type": "authentication_error"}}
            elif self.path == "/status":
                code, body = 200, STATUS
            else:
                code, body = 404, {"error": {"message": "no such route"}}
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}", seen


def test_ready_deployment(capsys: pytest.CaptureFixture) -> None:
    srv, url, _ = _server(ready=True, key=None)
    try:
        assert main(["status", url]) == 0
    finally:
        srv.shutdown()
    out = capsys.readouterr().out
    assert "ready         yes (gang state ready, 1 of 2 gang(s) ready)" in out
    assert "gang          raydeploy-gang-raydeploy-a1: ready, restarts 1, last error -" in out
    assert "gang          raydeploy-gang-raydeploy-b2: restarting, restarts 0, last error host 0 failed" in out
    assert "host          rank=0, pid=201" in out
    assert "state         ready, restarts 1" in out
    assert "{'dp': 2, 'tp': 2} over 4 device(s) in 2 process(es)" in out
    assert "host          rank=1, pid=102" in out
    assert "placement     TPU slice slice-a, bundle per rank [1, 0] (ranks follow TPU_WORKER_ID)" in out
    assert "programs      host 0: 12 loaded from the compile cache, 0 compiled" in out
    assert "programs      host 1: 9 loaded from the compile cache, 3 compiled" in out


def test_not_ready_and_json(capsys: pytest.CaptureFixture) -> None:
    srv, url, _ = _server(ready=False, key=None)
    try:
        assert main(["status", url, "--json"]) == 3
    finally:
        srv.shutdown()
    info = json.loads(capsys.readouterr().out)
    assert info["ready"] is False and info["ready_body"]["state"] == "loading" and info["status"]["restarts"] == 1


def test_api_key(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    srv, url, seen = _server(ready=True, key="s3cret")
    try:
        monkeypatch.delenv("RAYDEPLOY_API_KEY", raising=False)
        assert main(["status", url]) == 1
        assert "/status needs an API key: pass --api-key or set RAYDEPLOY_API_KEY" in capsys.readouterr().out
        monkeypatch.setenv("RAYDEPLOY_API_KEY", "s3cret")
        assert main(["status", url]) == 0
        assert "Bearer s3cret" in seen
        assert seen[0] is None  # /ready is asked without the key
    finally:
        srv.shutdown()


def test_unreachable(capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["status", f"http://127.0.0.1:{port}", "--timeout-s", "2"]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach http://127.0.0.1:{port}/ready" in err and "Connection refused" in err


def test_bad_url(capsys: pytest.CaptureFixture) -> None:
    assert main(["status", "localhost:8000"]) == 1
    assert "URL must start with http:// or https://, found 'localhost:8000'" in capsys.readouterr().err
