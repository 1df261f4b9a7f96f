"""Fast, one-process tests of the gang's pieces that need no cluster: the plan broadcast protocol (over an
in-memory key-value store standing in for the jax.distributed coordination service, which the Ray tests
use for real), fingerprint comparison, restart backoff with an injected sleep, the coordinator's request
path with the stand-in scheduler, bring-up phase errors.
"""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest

from raydeploy.config import load_config
from raydeploy.engine.request import GenerationRequest
from raydeploy.engine.step import SamplingParams, SeqStep, StepPlan, StepResult
from raydeploy.gang.bringup import GangError, gather_phase
from raydeploy.gang.dispatch import Dispatcher, FollowerLoop, plan_key
from raydeploy.gang.fingerprint import FingerprintMismatchError, check_fingerprints, host_fingerprint
from raydeploy.gang.supervisor import GangSupervisor, RestartPolicy


class MemoryKV:
    """In-memory stand-in for the coordination service's key-value store (same timeout behaviour)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.deleted: list[str] = []

    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout_in_ms / 1e3):
                raise TimeoutError(f"no value for key {key}")  # as raydeploy.compat.CoordinationKV raises
            return self.data[key]

    def key_value_delete(self, key: str) -> None:
        with self.cond:
            self.data.pop(key, None)
            self.deleted.append(key)

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self.cond:
            assert allow_overwrite or key not in self.data
            self.data[key] = value.encode()

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        with self.cond:
            return [(k, v.decode()) for k, v in self.data.items() if k.startswith(key)]


class RecordingEngine:
    def __init__(self) -> None:
        self.plans: list[StepPlan] = []

    def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        return StepResult(plan.step_id)


def _plan(i: int) -> StepPlan:
    return StepPlan(step_id=100 + i, seqs=(SeqStep(i % 4, np.arange(i + 1, dtype=np.int32), 0, True,
                                                   SamplingParams(0.5, 0.9, 3, 1.1, i)),),
                    release=(i % 4,) if i % 3 == 0 else ())


def test_follower_runs_exactly_the_published_plans_in_order_and_old_keys_are_deleted():
    kv = MemoryKV()
    lead, follower_engine = RecordingEngine(), RecordingEngine()
    dispatcher = Dispatcher(lead, kv, generation=7, num_followers=1)
    follower = FollowerLoop(follower_engine, kv, generation=7, rank=1, poll_ms=20)
    # publish 40 plans before the follower starts: nothing it has not run may be deleted
    for i in range(40):
        dispatcher.run(_plan(i))
    assert not kv.deleted
    t = threading.Thread(target=follower.run)
    t.start()
    for i in range(40, 70):
        dispatcher.run(_plan(i))
    dispatcher.run(StepPlan(step_id=-1, shutdown=True))
    t.join(10)
    assert not t.is_alive()
    assert [p.to_bytes() for p in follower_engine.plans] == [p.to_bytes() for p in lead.plans]
    assert len(lead.plans) == 70 and follower.clock.steps_done == 70
    assert plan_key(7, 0) in kv.deleted and plan_key(7, 70) not in kv.deleted
    assert all(int(k.rsplit("/", 1)[1]) >= 16 for k in kv.data if k.startswith("raydeploy/plan/"))
    assert dispatcher.clock.broadcasts == 71


def test_follower_stop_flag_ends_an_idle_wait():
    kv = MemoryKV()
    follower = FollowerLoop(RecordingEngine(), kv, generation=1, rank=1, poll_ms=20)
    t = threading.Thread(target=follower.run)
    t.start()
    follower.stop()
    t.join(5)
    assert not t.is_alive()


def test_follower_raises_real_kv_errors():
    class BrokenKV(MemoryKV):
        def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
            raise RuntimeError("UNAVAILABLE: coordination service is gone")

    with pytest.raises(RuntimeError, match="UNAVAILABLE"):
        FollowerLoop(RecordingEngine(), BrokenKV(), generation=1, rank=1).run()


def test_fingerprint_mismatch_names_host_and_part():
    cfg = load_config(None)
    other = load_config(None, ["model.dtype=bfloat16"])
    versions = {"jax": "0.10.2"}
    same = host_fingerprint(cfg, "abc", versions)
    check_fingerprints([same, host_fingerprint(load_config(None, ["cluster.env={A: b}"]), "abc", versions)])
    with pytest.raises(FingerprintMismatchError, match=r"host 1 differs from host 0 in config.model"):
        check_fingerprints([same, host_fingerprint(other, "abc", versions)])
    with pytest.raises(FingerprintMismatchError, match=r"host 2 differs from host 0 in checkpoint \(xyz != abc\)"):
        check_fingerprints([same, same, host_fingerprint(cfg, "xyz", versions)])
    with pytest.raises(FingerprintMismatchError, match=r"in version.jax"):
        check_fingerprints([same, host_fingerprint(cfg, "abc", {"jax": "0.9"})])


def test_restart_policy_backoff_doubles_and_is_bounded():
    p = RestartPolicy(max_restarts=3, backoff_s=2.0)
    assert [p.delay_s(n) for n in (1, 2, 3)] == [2.0, 4.0, 8.0]
    assert p.allows(0) and p.allows(2) and not p.allows(3)


def test_supervisor_restarts_with_backoff_then_fails_with_root_cause(monkeypatch):
    """The lifecycle loop with bring-up replaced by a failing stub and an injected sleep."""
    cfg = load_config(None, ["cluster.max_restarts=2", "cluster.restart_backoff_s=1.5"])
    slept: list[float] = []

    async def fake_sleep(s: float) -> None:
        slept.append(s)

    sup = GangSupervisor(cfg, None, sleep=fake_sleep)

    async def failing_start() -> None:
        sup.generation += 1
        raise GangError(f"bring-up phase 'init' failed: host(s) [1] did not finish init (gen {sup.generation})",
                        phase="init")

    async def no_teardown(cause: str, graceful: bool = False) -> None:
        return None

    monkeypatch.setattr(sup, "_start_gang", failing_start)
    monkeypatch.setattr(sup, "_teardown", no_teardown)
    asyncio.run(sup._run())
    st = sup.get_state()
    assert st["state"] == "failed" and st["restarts"] == 2
    assert slept == [1.5, 3.0]
    assert "did not finish init (gen 3)" in st["last_error"] and "after 2 restart(s)" in st["last_error"]
    assert len(st["history"]) == 3


class _Host:
    """A host handle whose heartbeat answers, raises, or never answers."""

    def __init__(self, beat: BaseException | dict | None) -> None:
        self.heartbeat = self
        self.beat = beat

    def remote(self):
        async def answer():
            if self.beat is None:
                await asyncio.sleep(3600)
            if isinstance(self.beat, BaseException):
                raise self.beat
            return self.beat

        return answer()


def test_a_peers_collective_error_is_blamed_on_the_host_that_died(monkeypatch):
    """Rank 0's step loop fails first ('connection reset by peer') when rank 1 is killed: the cause names the
    dead host first, then the one that does not answer, then rank 0's own error."""
    import ray.exceptions

    import raydeploy.gang.supervisor as supervisor

    monkeypatch.setattr(supervisor, "BLAME_WAIT_S", 0.2)
    sup = GangSupervisor(load_config(None, []), None)
    sup.hosts = [_Host({}), _Host(ray.exceptions.ActorDiedError()), _Host({}), _Host(None)]
    reset = RuntimeError("Gloo AllGather failed: Read error: Connection reset by peer")
    cause = asyncio.run(sup._blame(0, reset))
    assert cause.startswith("host 1 died: ActorDiedError"), cause
    assert "host 3 does not answer within 0.2s" in cause and "host 2" not in cause, cause
    assert cause.endswith("host 0 failed: RuntimeError: Gloo AllGather failed: Read error: Connection reset by peer")
    # a host that died itself is the cause without asking the others
    sup.hosts[1] = _Host(None)
    assert asyncio.run(sup._blame(2, ray.exceptions.ActorDiedError())) == (
        "host 2 failed: ActorDiedError: The actor died unexpectedly before finishing this task.")


def test_gather_phase_names_failed_and_missing_hosts():
    async def ok() -> int:
        return 1

    async def boom() -> int:
        raise ValueError("disk on fire")

    async def never() -> int:
        await asyncio.sleep(3600)
        return 0

    async def run(coros, timeout_s):
        return await gather_phase("load", [asyncio.ensure_future(c) for c in coros], timeout_s)

    assert asyncio.run(run([ok(), ok()], 1.0)) == [1, 1]
    with pytest.raises(GangError, match=r"host\(s\) \[2\] did not finish load before another host failed; "
                                        r"host 1 failed: ValueError: disk on fire"):
        asyncio.run(run([ok(), boom(), never()], 5.0))
    with pytest.raises(GangError, match=r"host\(s\) \[1\] did not finish load within 0.2s"):
        asyncio.run(run([ok(), never()], 0.2))


def test_coordinator_streams_events_and_fail_all_ends_requests():
    from raydeploy.gang.coordinator import Coordinator, GangUnavailableError
    from raydeploy.testing.toy import ToyScheduler

    class BlockingEngine:
        """Steps normally; once armed, every step after the next prefill hangs like a host stuck in a
        collective (so the request under test cannot finish on its own however the threads are scheduled)."""

        def __init__(self) -> None:
            self.armed = False
            self.prefilled = False
            self.release = threading.Event()

        def step(self, plan: StepPlan) -> StepResult:
            if self.prefilled:
                self.release.wait(30)
            if self.armed and any(len(q.tokens) for q in plan.seqs):
                self.prefilled = True
            n = len(plan.seqs)
            return StepResult(plan.step_id, np.full((1, n), 9, np.int32), np.zeros((1, n), np.float32))

    engine = BlockingEngine()
    coord = Coordinator(ToyScheduler(4), Dispatcher(engine, MemoryKV(), 1, num_followers=0))
    coord.start()

    async def run() -> None:
        events = [e async for batch in coord.generate(GenerationRequest("a", (1, 2), 5, ignore_eos=True))
                  for e in batch]
        assert [e.token_id for e in events] == [9] * 5 and events[-1].finish_reason == "length"
        engine.armed = True  # b's prefill step runs, the step after it hangs
        gen = coord.generate(GenerationRequest("b", (1, 2), 1000, ignore_eos=True))
        first = await gen.__anext__()
        assert first
        coord.fail_all("gang failure, retry: host 1 died", retriable=True)  # must end b despite the hang
        rest = [e async for batch in gen for e in batch]
        assert rest[-1].finish_reason == "error" and rest[-1].retriable and "host 1 died" in rest[-1].error
        with pytest.raises(GangUnavailableError, match="host 1 died"):
            async for _ in coord.generate(GenerationRequest("c", (1,), 3)):
                pass

    asyncio.run(run())
    engine.release.set()
    coord.join(10)


def test_coordinator_feed_carries_every_request_closing_it_aborts_the_rest_and_fail_all_ends_them():
    from raydeploy.gang.coordinator import Coordinator, GangUnavailableError
    from raydeploy.testing.toy import ToyScheduler

    class Engine:
        """Every prefill and decode token is 9."""

        def step(self, plan: StepPlan) -> StepResult:
            shape = (plan.decode_steps, len(plan.seqs))
            return StepResult(plan.step_id, np.full(shape, 9, np.int32), np.zeros(shape, np.float32))

    coord = Coordinator(ToyScheduler(4), Dispatcher(Engine(), MemoryKV(), 1, num_followers=0))
    coord.start()

    async def run() -> None:
        feed = coord.feed("f")
        # two requests submitted together: their events come on the one stream, a step's in one list
        await coord.submit(GenerationRequest("a", (1, 2), 9, ignore_eos=True), "f")
        await coord.submit(GenerationRequest("b", (1, 2), 9, ignore_eos=True), "f")
        got: dict[str, list] = {"a": [], "b": []}
        mixed = 0
        while not all(evs and evs[-1].finish_reason for evs in got.values()):
            batch = await asyncio.wait_for(anext(feed), 10)
            mixed += len({ev.request_id for ev in batch}) == 2
            for ev in batch:
                got[ev.request_id].append(ev)
        for evs in got.values():
            assert [ev.token_id for ev in evs] == [9] * 9 and evs[-1].finish_reason == "length"
            assert [ev.index for ev in evs] == list(range(9))
        assert mixed, "no list carried both requests' events"
        assert coord.open_streams == 0 and coord.stats()["requests_done"] == 2

        # a request still running when its caller closes the feed is aborted, and the stream ends
        await coord.submit(GenerationRequest("c", (1, 2), 10_000, ignore_eos=True), "f")
        assert (await asyncio.wait_for(anext(feed), 10))[0].request_id == "c"
        coord.close_feed("f")
        with pytest.raises(StopAsyncIteration):
            while True:
                await asyncio.wait_for(anext(feed), 10)
        assert coord.open_streams == 0 and not coord.abort("c"), "c still runs after its feed closed"

        # the gang fails: requests on a feed end with a retriable error event, new ones are refused
        feed = coord.feed("g")
        await coord.submit(GenerationRequest("d", (1, 2), 10_000, ignore_eos=True), "g")
        await asyncio.wait_for(anext(feed), 10)
        coord.fail_all("gang failure, retry: host 1 died", retriable=True)
        last = None
        while last is None or last.finish_reason is None:
            last = (await asyncio.wait_for(anext(feed), 10))[-1]
        assert last.finish_reason == "error" and last.retriable and "host 1 died" in last.error
        with pytest.raises(GangUnavailableError, match="host 1 died"):
            await coord.submit(GenerationRequest("e", (1,), 3), "g")
        await feed.aclose()

    asyncio.run(run())
    coord.join(10)


class _FeedCoordinator:
    """Rank 0's feed calls as a caller sees them (each `.remote` a coroutine or an async generator of awaitables):
    every submitted request gets one token a list, forever, until aborted; records aborts and closes."""

    class _Method:
        def __init__(self, fn) -> None:
            self.remote = fn

    def __init__(self, refuse: Exception | None = None) -> None:
        self.refuse = refuse
        self.aborted: list[str] = []
        self.closed: list[str] = []
        self.queue: asyncio.Queue = asyncio.Queue()
        self.submit, self.feed = self._Method(self._submit), self._Method(self._feed)
        self.abort, self.close_feed = self._Method(self.aborted.append), self._Method(self._close)

    async def _submit(self, req, name: str) -> None:
        from raydeploy.engine.request import TokenEvent

        if self.refuse is not None:
            raise self.refuse
        for i in range(3):
            self.queue.put_nowait([TokenEvent(req.request_id, 7, 0.0, i)])

    async def _feed(self, name: str):
        async def ready(batch):
            return batch

        while (batch := await self.queue.get()) is not None:
            yield ready(batch)

    async def _close(self, name: str) -> None:
        self.closed.append(name)
        self.queue.put_nowait(None)


def test_feed_aborts_a_request_its_caller_leaves_but_not_one_refused_and_ends_open_ones_when_it_closes():
    from raydeploy.engine.scheduler import QueueFullError
    from raydeploy.gang.feed import Feed

    async def run() -> None:
        coord = _FeedCoordinator()
        feed = Feed(coord)
        stream = feed.stream(GenerationRequest("left", (1,), 100))
        first = await anext(stream)  # what has arrived, in one list
        assert [ev.token_id for ev in first] == [7] * len(first) and [ev.index for ev in first] == [0, 1, 2][:len(first)]
        await stream.aclose()  # the caller stops reading mid-request: rank 0 is told at once
        assert coord.aborted == ["left"] and "left" not in feed.queues

        open_one = feed.stream(GenerationRequest("open", (1,), 100))
        await anext(open_one)
        await feed.close()  # the stream ends: the request still open gets a final retriable error event
        assert coord.closed == [feed.name]
        rest = [ev async for batch in open_one for ev in batch]
        assert rest[-1].finish_reason == "error" and rest[-1].retriable and "gang failure" in rest[-1].error, rest
        assert coord.aborted == ["left"], "a request whose feed ended needs no abort"

        refusing = _FeedCoordinator(refuse=QueueFullError(4, 4))
        feed = Feed(refusing)
        with pytest.raises(QueueFullError):
            async for _ in feed.stream(GenerationRequest("refused", (1,), 5)):
                pass
        assert refusing.aborted == [] and not feed.queues  # never started: nothing to abort
        await feed.close()

    asyncio.run(asyncio.wait_for(run(), 30))


def test_gang_errors_cross_ray_intact():
    import pickle

    from raydeploy.gang.coordinator import GangUnavailableError
    from raydeploy.gang.placement import PlacementError
    from raydeploy.gang.preflight import PreflightError

    for err in (GangError("phase 'init' failed", phase="init", retriable=False), PlacementError("cannot place"),
                PreflightError("TPU_NAME not set"),
                FingerprintMismatchError("gang refused"), GangUnavailableError("restarting", retriable=True)):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert getattr(back, "retriable", None) == getattr(err, "retriable", None)
        assert getattr(back, "phase", None) == getattr(err, "phase", None)


@pytest.mark.parametrize("devices,hosts,cores,threads", [(1, 2, 2, 1), (1, 2, 16, 8), (1, 4, 2, 1), (1, 1, 2, 2),
                                                          (2, 2, 2, 8), (4, 2, 64, 16)])
def test_simulated_hosts_split_the_cores_unless_they_hold_several_devices(devices, hosts, cores, threads):
    from raydeploy.gang.host import simulated_host_threads

    assert simulated_host_threads(devices, hosts, cores) == threads


def test_host_env_sets_jax_before_import_and_actor_options_follow_the_bundle():
    from raydeploy.gang.host import actor_options, host_env

    cfg = load_config(None, ["cluster.env={FOO: bar}", "cluster.devices_per_host=2", "mesh.axes={dp: 4}"])
    env = host_env(cfg)
    assert env["JAX_PLATFORMS"] == "cpu" and env["FOO"] == "bar"
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2" and int(env["PJRT_NPROC"]) >= 8
    one = host_env(load_config(None, []))  # the embedded default: 2 hosts x 1 device on this machine
    assert one["PJRT_NPROC"] == str(max(1, (os.cpu_count() or 1) // 2))
    opts = actor_options(cfg, 0, {"CPU": 0.5, "TPU": 4.0, "slice-head": 1.0}, None, 1)
    assert opts["num_cpus"] == 0.5 and opts["resources"] == {"TPU": 4.0, "slice-head": 1.0}
    assert opts["runtime_env"]["env_vars"] == env and opts["max_restarts"] == 0


def test_host_module_does_not_import_jax():
    import subprocess
    import sys

    code = ("import sys; import raydeploy.gang.host, raydeploy.gang.supervisor, raydeploy.gang.gang; "
            "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_gpu_hosts_run_cuda_and_the_coordinator_port_is_fixed_on_real_clusters():
    from raydeploy.config import config_from_dict
    from raydeploy.gang.host import JAX_COORDINATOR_PORT, coordinator_port, host_env

    def cfg(**cluster):
        return config_from_dict({"cluster": {"num_hosts": 2, "devices_per_host": 8, **cluster},
                                 "mesh": {"axes": {"dp": 2, "tp": 8}}})

    gpu = cfg(platform="gpu", simulated=False, host_resources={"GPU": 8})
    assert host_env(gpu)["JAX_PLATFORMS"] == "cuda" and "XLA_FLAGS" not in host_env(gpu)
    assert coordinator_port(gpu) == JAX_COORDINATOR_PORT == 8476
    assert coordinator_port(cfg(platform="gpu", simulated=False, coordinator_port=9000)) == 9000
    assert coordinator_port(cfg(platform="gpu", simulated=False, coordinator_port=0)) == 0
    assert coordinator_port(cfg()) == 0  # simulated: a free port at each start


def test_preflight_errors_are_not_retried_even_wrapped_by_ray():
    from raydeploy.gang.preflight import PreflightError

    class RayTaskErrorLike(RuntimeError):  # what Ray raises for a remote error: the original as .cause
        def __init__(self, cause: BaseException) -> None:
            super().__init__(str(cause))
            self.cause = cause

    async def fail(e: BaseException) -> None:
        raise e

    async def run(e: BaseException) -> GangError:
        with pytest.raises(GangError) as info:
            await gather_phase("preflight", [fail(e), asyncio.sleep(0)], 5.0)
        return info.value

    final = asyncio.run(run(RayTaskErrorLike(PreflightError("TPU_NAME not set"))))
    assert not final.retriable and "host 0 failed: PreflightError: TPU_NAME not set" in str(final)
    assert asyncio.run(run(RuntimeError("flaky"))).retriable
