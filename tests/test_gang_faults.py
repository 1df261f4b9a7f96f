"""The gang's failure handling on a real local Ray cluster with real jax.distributed between 2 host
processes (2 virtual CPU devices each), using the stand-in engine so each bring-up takes seconds.

Covered: a host killed mid-generation (rank 1, then rank 0) fails the request with a retriable error
event within the heartbeat timeout (on a stream of its own, and on a feed with every request beside it) and the gang restarts and serves again, its new processes started
only after every old one had exited; a rank that never joins;
a fingerprint mismatch; a host stuck in a step (watchdog); a step that fails for one request (the
`raise_on_token` fault on both hosts) fails that request alone while both hosts stay in lockstep, without a
restart; no leaked processes or ports after shutdown.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from raydeploy.config import load_config
from raydeploy.engine.request import GenerationRequest
from raydeploy.gang.feed import Feeds, stream_events
from raydeploy.gang.gang import start_gang
from raydeploy.testing.faults import FaultyEngine
from raydeploy.testing.toy import toy_expected_tokens

pytestmark = pytest.mark.ray

HEARTBEAT_S = 4


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    import ray

    tmp = f"/tmp/rdg-{os.getpid()}"
    ray.init(num_cpus=2, _temp_dir=tmp, include_dashboard=False, namespace="raydeploy-tests",
             configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def _cfg(*extra: str):
    return load_config(None, [f"cluster.heartbeat_timeout_s={HEARTBEAT_S}", "cluster.init_timeout_s=6",
                              "cluster.step_timeout_s=4", "cluster.restart_backoff_s=0.2",
                              "cluster.max_restarts=2", "engine.max_slots=2", *extra])


def _pid_alive(pid: int) -> bool:
    """Running (a zombie awaiting its parent's reaping has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _pids(gang) -> list[int]:
    return [h["pid"] for h in gang.status()["host_status"]]


def _long_request(rid: str) -> GenerationRequest:
    return GenerationRequest(rid, (5, 6, 7), max_tokens=1_000_000, ignore_eos=True)


def _stream_until_end(gang, req, started: threading.Event, out: dict, feed: bool = False) -> None:
    """Stream `req` to its end, on a stream of its own or (`feed`) on a feed beside a second request, whose
    events go to out["beside"]."""

    async def one(stream, key: str) -> None:
        events = []
        async for batch in stream:
            events.extend(batch)
            if len(events) >= 5:
                started.set()
        out[key] = events
        out["ended_s"] = time.monotonic()

    async def run() -> None:
        if not feed:
            await one(stream_events(gang.coordinator(), req), "events")
            return
        feeds = Feeds()
        coord = gang.coordinator()
        try:
            await asyncio.gather(one(feeds.stream(coord, req), "events"),
                                 one(feeds.stream(coord, _long_request(req.request_id + "-beside")), "beside"))
        finally:
            await feeds.close()

    asyncio.run(run())


def _check_feed_generation(gang, rid: str, n: int = 6) -> None:
    async def run() -> list:
        feeds = Feeds()
        try:
            return [e async for batch in feeds.stream(gang.coordinator(), GenerationRequest(
                rid, (5, 6, 7), max_tokens=n, ignore_eos=True)) for e in batch]
        finally:
            await feeds.close()

    events = asyncio.run(asyncio.wait_for(run(), 60))
    assert [e.token_id for e in events] == toy_expected_tokens((5, 6, 7), n, eos_token_ids=())


def _check_generation(gang, rid: str, n: int = 6) -> None:
    events = gang.generate(GenerationRequest(rid, (5, 6, 7), max_tokens=n, ignore_eos=True), timeout_s=60)
    want = toy_expected_tokens((5, 6, 7), n, eos_token_ids=())
    assert [e.token_id for e in events] == want
    assert events[-1].finish_reason == "length"


def _wait_restarts(gang, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while gang.state()["restarts"] < n:
        assert time.monotonic() < deadline, f"the supervisor did not restart the gang within {timeout_s:g}s"
        time.sleep(0.2)


@pytest.mark.parametrize("victim,feed", [(1, False), (0, False), (1, True), (0, True)])
def test_host_killed_mid_generation_fails_request_and_gang_restarts(ray_cluster, victim, feed):
    gang = start_gang(_cfg(), engine="toy")
    try:
        gang.wait_ready(120)
        _check_generation(gang, "before")
        pids = _pids(gang)
        started, out = threading.Event(), {}
        t = threading.Thread(target=_stream_until_end, args=(gang, _long_request("long"), started, out, feed))
        t.start()
        assert started.wait(60), "the long request produced no tokens"
        killed_s = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        t.join(HEARTBEAT_S + 30)
        assert not t.is_alive(), "the request did not end after a host died"
        last = out["events"][-1]
        assert last.finish_reason == "error" and last.retriable, last
        assert "gang failure" in last.error
        assert out["ended_s"] - killed_s < HEARTBEAT_S + 5
        if feed:  # every request on the feed ends so, the one beside it too
            beside = out["beside"][-1]
            assert beside.finish_reason == "error" and beside.retriable and "gang failure" in beside.error, beside
        # the stream can learn of the death before the supervisor does: until then the gang still reads ready
        _wait_restarts(gang, 1, HEARTBEAT_S + 30)
        st = gang.wait_ready(120)
        assert st["restarts"] == 1 and f"host {victim}" in (st["last_error"] or "") or st["history"], st
        _check_generation(gang, "after")
        if feed:  # a feed on the new coordinator
            _check_feed_generation(gang, "after-feed")
        assert not any(_pid_alive(p) for p in pids), "old host processes still alive"
        # the restart waited until every old process had exited (checked on its node) before starting new ones
        exits = st["history"][-1]["exits"]
        assert sorted(e["pid"] for e in exits) == sorted(pids), exits
        assert all(e["gone"] is True and e["checked"] == "node" for e in exits), exits
        assert max(e["at"] for e in exits) <= min(h["started_at"] for h in st["hosts"]), (exits, st["hosts"])
    finally:
        gang.shutdown()


def test_a_step_failing_for_one_request_fails_it_alone_and_both_hosts_go_on_in_lockstep(ray_cluster):
    poison = 201
    gang = start_gang(_cfg(), engine=FaultyEngine("toy", faults={r: {"raise_on_token": poison} for r in (0, 1)}))
    try:
        gang.wait_ready(120)

        async def run() -> tuple[tuple[list, float], tuple[list, float]]:
            feeds = Feeds()
            coord = gang.coordinator()
            going = asyncio.Event()

            async def events(req: GenerationRequest) -> tuple[list, float]:
                out = []
                async for batch in feeds.stream(coord, req):
                    out.extend(batch)
                    going.set()
                return out, time.monotonic()

            try:  # the poison's prefill rides in a step beside the first request's decode rows
                first = asyncio.create_task(events(GenerationRequest("beside", (5, 6, 7), max_tokens=200,
                                                                     ignore_eos=True)))
                await going.wait()
                bad = await events(GenerationRequest("poison", (5, poison, 7), max_tokens=8, ignore_eos=True))
                return await first, bad
            finally:
                await feeds.close()

        (beside, beside_end), (bad, bad_end) = asyncio.run(asyncio.wait_for(run(), 60))
        assert [e.token_id for e in beside if e.token_id is not None] == toy_expected_tokens((5, 6, 7), 200, ())
        assert beside[-1].finish_reason == "length"
        assert beside_end > bad_end  # it was still running when the poison failed
        last = bad[-1]
        assert [e.token_id for e in bad] == [None] and last.finish_reason == "error" and not last.retriable, bad
        assert "request poison failed in step" in last.error and f"token id {poison}" in last.error, last.error
        # both hosts skipped that step and stay in step: the toy's decode is a cross-host reduction
        _check_generation(gang, "after-poison", n=20)
        st = gang.status()
        assert st["restarts"] == 0 and st["state"] == "ready", st
        assert st["stats"]["steps_failed"] == 1 and st["stats"]["requests_submitted"] == 3, st["stats"]
    finally:
        gang.shutdown()


def test_a_cancelled_first_request_does_not_end_the_feed_of_the_others(ray_cluster):
    """A replica opens its feed inside its first request; a client that hangs up on that request gets it
    cancelled by Ray, recursively: the feed's stream from rank 0 must not be one of the children cancelled."""
    import ray

    @ray.remote(num_cpus=0)
    class Replica:  # holds one Feeds and streams each call's request on it, as the gang's Serve replica does
        def __init__(self, coord) -> None:
            self.coord, self.feeds = coord, None

        async def tokens(self, rid: str, n: int) -> list:
            self.feeds = self.feeds or Feeds()
            req = GenerationRequest(rid, (5, 6, 7), max_tokens=n, ignore_eos=True)
            return [e.token_id for batch in [b async for b in self.feeds.stream(self.coord, req)] for e in batch]

    gang = start_gang(_cfg(), engine="toy")
    try:
        gang.wait_ready(120)
        replica = Replica.remote(gang.coordinator())
        first = replica.tokens.remote("first", 1_000_000)  # opens the feed, then runs until cancelled
        time.sleep(1.0)
        beside = replica.tokens.remote("beside", 400)  # on the same feed
        time.sleep(1.0)
        ray.cancel(first, recursive=True)
        with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError)):
            ray.get(first, timeout=30)
        assert ray.get(beside, timeout=120) == toy_expected_tokens((5, 6, 7), 400, eos_token_ids=())
        assert gang.status()["restarts"] == 0
    finally:
        gang.shutdown()


def test_rank_that_never_joins_fails_within_init_timeout(ray_cluster):
    gang = start_gang(_cfg("cluster.max_restarts=0"), engine=FaultyEngine("toy", faults={1: {"never_join": 120}}))
    t0 = time.monotonic()
    try:
        with pytest.raises(Exception) as info:
            gang.wait_ready(120)
        elapsed = time.monotonic() - t0
        msg = str(info.value)
        assert "init" in msg and "host(s) [1] did not finish init" in msg, msg
        assert elapsed < 6 + 15, elapsed
        assert gang.state()["state"] == "failed"
    finally:
        gang.shutdown()


def test_fingerprint_mismatch_is_refused_without_restart(ray_cluster):
    cfg = _cfg()
    other = load_config(None, [f"cluster.heartbeat_timeout_s={HEARTBEAT_S}", "cluster.init_timeout_s=6",
                               "cluster.step_timeout_s=4", "cluster.restart_backoff_s=0.2",
                               "cluster.max_restarts=2", "engine.max_slots=2", "model.max_seq_len=1024",
                               "engine.max_new_tokens=128"])  # an engine and a model key differ from host 0's
    gang = start_gang(cfg, engine=FaultyEngine("toy", host_configs={1: other}))
    try:
        with pytest.raises(Exception) as info:
            gang.wait_ready(120)
        msg = str(info.value)
        assert "gang refused" in msg and "host 1 differs from host 0 in config.engine" in msg, msg
        assert "config.model" in msg
        st = gang.state()
        assert st["state"] == "failed" and st["restarts"] == 0
    finally:
        gang.shutdown()


def test_stuck_host_is_caught_by_the_watchdog(ray_cluster):
    gang = start_gang(_cfg(), engine=FaultyEngine("toy", faults={1: {"hang_at_step": 3}}))
    try:
        gang.wait_ready(120)
        events = gang.generate(_long_request("stuck"), timeout_s=60)
        assert events[-1].finish_reason == "error" and events[-1].retriable
        st = gang.wait_ready(120)
        cause = st["history"][0]["error"]
        assert "host 0 is stuck" in cause or "host 1 is stuck" in cause, st["history"]
        assert "step_timeout_s=4s" in cause and "stuck" in events[-1].error, events[-1].error
        _check_generation(gang, "after-stuck")
    finally:
        gang.shutdown()


def test_shutdown_leaves_no_processes_or_ports(ray_cluster):
    gang = start_gang(_cfg(), engine="toy")
    gang.wait_ready(120)
    _check_generation(gang, "x")
    pids = _pids(gang)
    address = gang.state()["coordinator_address"]
    gang.shutdown()
    assert not any(_pid_alive(p) for p in pids)
    port = int(address.rsplit(":", 1)[1])
    # nothing of ours listens on the coordinator port (another program on this busy machine may have
    # taken the freed port since; that is not a leak)
    owners = _listener_cmdlines(port)
    assert not [c for c in owners if "HostActor" in c or "GangSupervisor" in c], owners


def _listener_cmdlines(port: int) -> list[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                    inodes.add(cols[9])
    owners = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    with open(f"/proc/{pid}/cmdline") as f:
                        owners.append(f.read().replace("\0", " "))
        except OSError:
            continue
    return owners
