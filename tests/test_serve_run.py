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
