"""`raydeploy serve` checks its listening address before Ray starts: a taken port is one line on stderr that
names the address and the `--set serving.port=` override, not a Ray Serve traceback after Ray and the gang
have started. A real socket holds the port."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from raydeploy import cli
from raydeploy.serve import run as serve_run
from raydeploy.serve.run import AddressUnavailable, check_address_free


@pytest.fixture()
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_taken_port_is_one_line_before_ray_starts(taken_port, monkeypatch, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray must not start when the address is taken")

    monkeypatch.setattr(serve_run, "connect_ray", no_ray)
    code = cli.main(["serve", "--set", f"serving.port={taken_port}"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"raydeploy serve: cannot listen on 127.0.0.1:{taken_port}: ")
    assert "in use" in lines[0] and "--set serving.port=" in lines[0]


def test_the_installed_command_says_the_same_without_a_traceback(taken_port, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"}
    r = subprocess.run([sys.executable, "-m", "raydeploy.cli", "serve", "--set", f"serving.port={taken_port}"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"raydeploy serve: cannot listen on 127.0.0.1:{taken_port}: Address already in use; "
        "choose another port with --set serving.port=PORT (or stop what holds it)"], r.stderr
    assert not (tmp_path / ".ray").exists() and "Traceback" not in r.stderr


def test_address_check_passes_a_free_port_and_names_a_bad_host():
    check_address_free("127.0.0.1", _free_port())
    check_address_free("127.0.0.1", 0)
    with pytest.raises(AddressUnavailable, match=r"cannot listen on 192\.0\.2\.1:\d+: .*serving\.host"):
        check_address_free("192.0.2.1", _free_port())  # TEST-NET-1: not an address of this machine


LOG_MONITOR_ENV = r"""
import os, sys
from pathlib import Path
import ray
from raydeploy.serve.run import connect_ray
temp = sys.argv[1]
assert connect_ray(None, temp_dir=temp, num_cpus=1)
try:
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = (proc / "cmdline").read_bytes().decode().split("\0")
            if any(a.endswith("/log_monitor.py") for a in args[:3]) and any(temp in a for a in args):
                env = dict(e.split("=", 1) for e in (proc / "environ").read_bytes().decode().split("\0") if "=" in e)
                print(env.get("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"), env.get("LOG_NAME_UPDATE_INTERVAL_S"))
                break
        except OSError:
            continue
    else:
        print("no log monitor")
    print(ray.get(ray.remote(lambda: os.environ.get("RAY_SERVE_USE_GRPC_BY_DEFAULT")).remote()))
finally:
    ray.shutdown()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process environment from /proc")
def test_a_local_ray_starts_its_log_monitor_rescanning_rarely(tmp_path):
    """The local Ray that `connect_ray` starts (a real one) runs its log monitor with `LOCAL_RAY_ENV` (it rescans
    the log directory every 5 s, not every 0.1 s), and a value the user set wins; its workers (Serve's replicas
    among them) see Serve's gRPC handles turned on."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", *serve_run.LOCAL_RAY_ENV)}
    env["LOG_NAME_UPDATE_INTERVAL_S"] = "2"
    done = subprocess.run([sys.executable, "-c", LOG_MONITOR_ENV, f"/tmp/rdlm-{os.getpid()}"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-2:] == ["0 2", "1"], done.stdout[-2000:]


def test_bounded_teardown_steps_give_up_return_and_raise():
    """Each step of `raydeploy serve`'s start and teardown runs bounded: it gives up at once when Ray's GCS is gone
    (a signal that stopped Ray's processes too), times out, or returns (re-raising what the step raised)."""
    import threading

    release = threading.Event()
    gone = threading.Event()
    checks = []

    def give_up() -> bool:
        checks.append(1)
        if len(checks) == 3:
            gone.set()
        return gone.is_set()

    assert serve_run.run_bounded(lambda: release.wait(60), 60, give_up, poll_s=0.01) == "gave up"
    assert len(checks) == 3
    assert serve_run.run_bounded(lambda: release.wait(60), 0.05, lambda: False, poll_s=0.01) == "timeout"
    release.set()
    assert serve_run.run_bounded(lambda: None, 60, lambda: True) == "done"

    def fails() -> None:
        raise ValueError("engine must be one of ['real', 'toy']")

    with pytest.raises(ValueError, match="engine must be one of"):
        serve_run.run_bounded(fails, 60, lambda: False)


def test_gcs_reachable_is_a_bounded_tcp_check(taken_port):
    assert serve_run.gcs_reachable(f"127.0.0.1:{taken_port}", timeout_s=1.0)
    assert not serve_run.gcs_reachable(f"127.0.0.1:{_free_port()}", timeout_s=1.0)
    assert not serve_run.gcs_reachable("not-an-address", timeout_s=1.0)
