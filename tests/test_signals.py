"""A stop signal to the whole process group of `raydeploy serve` (a supervisor's or `kill -- -PGID`'s SIGTERM,
a terminal's SIGINT) stops the server cleanly: exit 0 within seconds, in-flight work drained, and no process it
started (Ray's GCS, raylet, workers, the gang's hosts) left running. And when every process gets the signal
(systemd's default KillMode=control-group stops Ray's processes too), the server notices that Ray is gone,
does not wait on it, and still exits 0.

Each test starts the real command (`python -m raydeploy.cli serve --engine toy`: the embedded default's two
simulated hosts with the stand-in engine) in a new session, as a shell starts a job, waits for /ready, signals,
then checks the exit code, the output and every process that was its descendant.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.e2e,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc")]

READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 15.0  # the bound for a signal to the group
ALL_STOP_TIMEOUT_S = 45.0  # every process signalled: Ray's own shutdown of its dead processes takes ~8-12 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every live descendant of `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out[child] = _cmdline(child)
            todo.append(child)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:100]
    except OSError:
        return "?"


def _running(pids: dict[int, str]) -> dict[int, str]:
    """The ones still running (a zombie waiting for its reaper has stopped)."""
    alive = {}
    for pid, cmd in pids.items():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            alive[pid] = cmd
    return alive


@pytest.fixture()
def serving(demo_checkpoint, tmp_path):
    """A `raydeploy serve` in its own session (as a shell starts a job), ready; yields (process, url, log)."""
    port = _free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "raydeploy.cli", "serve", "--engine", "toy",
                                 "--set", f"serving.port={port}"], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"serve exited with {proc.returncode}: {log.read_text()[-3000:]}"
            try:
                if httpx.get(url + "/ready", timeout=10).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"not ready after {READY_TIMEOUT_S:.0f}s: {log.read_text()[-3000:]}"
            time.sleep(0.5)
        yield proc, url, log
    finally:
        if proc.poll() is None:  # the test failed before stopping it: stop everything it started
            for pid in [proc.pid, *_descendants(proc.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(30)


def _stop_and_check(proc: subprocess.Popen, log: Path, send: Callable[[], None], timeout_s: float) -> str:
    started = _descendants(proc.pid)
    assert any("gcs_server" in c for c in started.values()) and any("raylet" in c for c in started.values()), started
    send()
    try:
        code = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve still running {timeout_s:.0f}s after the signal: {log.read_text()[-3000:]}")
    text = log.read_text()
    assert code == 0, f"exit {code}: {text[-3000:]}"
    deadline = time.monotonic() + 10  # the last Ray workers notice their raylet is gone
    while _running(started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running(started) == {}, f"left running: {_running(started)}"
    assert "Traceback" not in text and "raydeploy serve: stopped" in text, text[-3000:]
    return text


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_process_group_drains_and_exits_0(serving, sig):
    proc, _url, log = serving
    text = _stop_and_check(proc, log, lambda: os.killpg(os.getpgid(proc.pid), sig), STOP_TIMEOUT_S)
    assert f"raydeploy serve: {sig.name} received; draining" in text
    assert "in-flight requests drain first" in text  # Ray's processes did not get the signal: a real drain


def test_a_signal_to_every_process_exits_0_without_waiting_on_the_dead_gcs(serving):
    """What systemd's KillMode=control-group does: SIGTERM to the launcher, the server and each Ray process."""
    proc, _url, log = serving

    def everyone() -> None:
        for pid in [proc.pid, *_descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    text = _stop_and_check(proc, log, everyone, ALL_STOP_TIMEOUT_S)
    assert "Ray's processes" in text and "stopped" in text, text[-3000:]
    assert "Failed to connect to GCS" not in text
