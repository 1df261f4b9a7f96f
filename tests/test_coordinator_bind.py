"""The jax.distributed coordination service listens only on the address rank 0 advertises to the gang, not on
every interface: a recording stand-in for `jax.distributed.initialize` shows what each rank passes, and a real
one-process jax.distributed in a subprocess shows (in /proc/net/tcp) which address its port listens on."""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from raydeploy.config import config_from_dict
from raydeploy.gang import runtime


def _cfg(**cluster):
    return config_from_dict({
        "cluster": {"num_hosts": 2, "devices_per_host": 1, "platform": "cpu", "simulated": True,
                    "placement_strategy": "PACK", **cluster},
        "mesh": {"axes": {"dp": 2}},
        "engine": {"max_slots": 2, "compilation_cache_dir": None},
    }, source="test")


class _Stop(Exception):
    pass


@pytest.mark.parametrize(("rank", "expected"), [(0, "10.1.2.3:8476"), (1, None)])
def test_rank_0_binds_the_address_it_advertises(monkeypatch, rank, expected):
    import jax

    calls: list[dict] = []

    def recording_initialize(**kwargs):
        calls.append(kwargs)
        raise _Stop  # the rest of join_distributed needs a real gang

    monkeypatch.setattr(jax.distributed, "initialize", recording_initialize)
    with pytest.raises(_Stop):
        runtime.join_distributed(_cfg(), rank, "10.1.2.3:8476")
    assert len(calls) == 1
    assert calls[0]["coordinator_address"] == "10.1.2.3:8476"
    assert calls[0]["coordinator_bind_address"] == expected
    assert calls[0]["process_id"] == rank and calls[0]["num_processes"] == 2


def test_rank_0_advertises_an_address_of_its_own_node():
    import asyncio

    from raydeploy.gang.host import HostActor
    from raydeploy.gang.preflight import PreflightError

    def address(**cluster) -> str:
        return asyncio.run(HostActor(_cfg(**cluster), 0, 0, None, engine="toy").coordinator_address())

    ip, port = address(coordinator_bind_address="127.0.0.1").rsplit(":", 1)  # simulated: a free port
    assert ip == "127.0.0.1" and int(port) > 0
    assert address(coordinator_bind_address="127.0.0.1", coordinator_port=18476) == "127.0.0.1:18476"
    # not an address of this machine (TEST-NET-2): named before jax.distributed, whose gRPC server would abort
    with pytest.raises(PreflightError, match=r"cluster\.coordinator_bind_address '198\.51\.100\.7' cannot be "
                                             r"listened on by rank 0 \(.*\): it must be an address of rank 0's node"):
        address(coordinator_bind_address="198.51.100.7")


def test_no_rank_binds_every_interface():
    for address in ("127.0.0.1:1234", "10.0.0.7:8476"):
        assert runtime.coordinator_bind(0, address) == address
        assert runtime.coordinator_bind(1, address) is None


ONE_HOST = r"""
import sys
from raydeploy.config import config_from_dict
from raydeploy.gang.runtime import join_distributed
cfg = config_from_dict({"cluster": {"num_hosts": 1, "devices_per_host": 1, "platform": "cpu", "simulated": True,
                                    "init_timeout_s": 30, "heartbeat_timeout_s": 5},
                        "mesh": {"axes": {"dp": 1}}, "engine": {"max_slots": 2, "compilation_cache_dir": None}},
                       source="test")
join_distributed(cfg, 0, sys.argv[1])
print("joined", flush=True)
sys.stdin.readline()  # hold the service open until the test has looked
"""


def _proc_ip(hex_ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} writes it (32-bit words in host order, little-endian here); an IPv4 address
    mapped into IPv6 (::ffff:a.b.c.d, as gRPC listens) comes back as the IPv4 address."""
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped if mapped is not None else ip


def _listening(port: int) -> set[str]:
    """The local addresses in state LISTEN on TCP `port` (IPv4 and IPv6 tables)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, _remote, state = line.split()[1:4]
            ip_hex, port_hex = local.rsplit(":", 1)
            if state == "0A" and int(port_hex, 16) == port:
                found.add(str(_proc_ip(ip_hex)))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_a_real_coordination_service_listens_on_the_advertised_ip_only():
    assert _proc_ip("00000000") == ipaddress.ip_address("0.0.0.0")
    assert _proc_ip("0100007F") == _proc_ip("0000000000000000FFFF00000100007F") == ipaddress.ip_address("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, "-c", ONE_HOST, f"127.0.0.1:{port}"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "joined", proc.stderr
        listening = _listening(port)
        assert listening == {"127.0.0.1"}, f"port {port} listens on {sorted(listening)}, not only 127.0.0.1"
    finally:
        proc.communicate("\n", timeout=60)
