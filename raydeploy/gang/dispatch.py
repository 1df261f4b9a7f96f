"""The one place that fans out per-step work to every host.

Every host must issue the same jitted calls in the same order (different programs abort the collectives;
the same program with different data gives silently wrong answers). So exactly one component decides
the order: rank 0's :class:`Dispatcher` publishes each `StepPlan.to_bytes()` once, under a key that
carries the gang generation and step number, in the jax.distributed coordination service's key-value
store (already running inside rank 0, already connected to every host); then it runs the step itself.
Followers (:class:`FollowerLoop`) fetch plan n with a bounded blocking get, re-checking their stop flag
between waits, and run the same step. A step costs one small key-value write on rank 0 and one read per
follower, not a Ray round trip per host per token.

A step whose engine raises `RequestFailed` (a check of the plan's rows that failed before any device work,
raydeploy.engine.request) raises it on every host alike: the dispatcher passes it to rank 0's step loop, which
fails those requests and plans the others again; followers skip the step and go on. Any other exception ends
the host's loop (the supervisor rebuilds the gang).

Adapter commands (`raydeploy.lora.device.AdapterCommand`: load or clear a LoRA slot) go through the same
sequence of keys, between two plans: `Dispatcher.command` checks the command on rank 0 (a bad adapter file
changes nothing anywhere), publishes it and applies it, under the lock `run` holds, so it never splits a step
and the gang never stops; followers apply it where it falls among their plans. A follower that cannot apply a
command rank 0 applied ends its loop (its slots would differ: the supervisor rebuilds the gang).

Old plans are deleted once every follower has acknowledged them: each follower writes its progress to
one key every `ACK_EVERY` steps, and rank 0 reads those keys as often, deleting every plan below the
slowest follower's mark. Steps without device work (release-only plans) do not synchronise the hosts,
so the dispatcher never assumes a follower has kept up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from raydeploy.engine.request import RequestFailed
from raydeploy.engine.step import StepPlan, StepResult
from raydeploy.lora.commands import AdapterCommand

KEY_PREFIX = "raydeploy/plan"
ACK_PREFIX = "raydeploy/ack"
ACK_EVERY = 16


class KeyValueClient(Protocol):
    """The subset of jax's DistributedRuntimeClient the dispatcher uses."""

    def key_value_set_bytes(self, key: str, value: bytes) -> None: ...
    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        """The value of `key`; TimeoutError when none came within `timeout_in_ms`."""
        ...
    def key_value_delete(self, key: str) -> None: ...
    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None: ...
    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]: ...


class StepRunner(Protocol):
    def step(self, plan: StepPlan) -> StepResult: ...


def jax_kv_client() -> KeyValueClient:
    """The coordination-service client of this process (after jax.distributed.initialize); its blocking get
    raises TimeoutError when no value came in time."""
    from raydeploy.compat import coordination_kv_client

    return coordination_kv_client()


def plan_key(generation: int, step_id: int) -> str:
    return f"{KEY_PREFIX}/{generation}/{step_id}"


def ack_dir(generation: int) -> str:
    return f"{ACK_PREFIX}/{generation}/"


@dataclass
class StepClock:
    """What a watchdog reads: steps done, and since when the current step has been running (None when idle)."""

    steps_done: int = 0
    step_started_s: float | None = None
    last_step_s: float = 0.0
    total_step_s: float = 0.0
    broadcast_s_total: float = 0.0
    broadcasts: int = 0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def begin(self) -> None:
        self.step_started_s = self.clock()

    def end(self) -> None:
        if self.step_started_s is not None:
            self.last_step_s = self.clock() - self.step_started_s
            self.total_step_s += self.last_step_s
        self.step_started_s = None
        self.steps_done += 1

    def stuck_for_s(self) -> float:
        """Seconds the current step has been running (0 when idle)."""
        return 0.0 if self.step_started_s is None else self.clock() - self.step_started_s

    def snapshot(self) -> dict[str, Any]:
        return {"steps_done": self.steps_done, "in_step_s": round(self.stuck_for_s(), 3),
                "last_step_ms": round(self.last_step_s * 1e3, 3),
                "mean_step_ms": round(self.total_step_s / self.steps_done * 1e3, 3) if self.steps_done else None,
                "mean_broadcast_us": (round(self.broadcast_s_total / self.broadcasts * 1e6, 1)
                                      if self.broadcasts else None)}


class Dispatcher:
    """Rank 0: publish each plan, then run it locally. The only caller of `engine.step` on rank 0."""

    def __init__(self, engine: StepRunner, client: KeyValueClient, generation: int, num_followers: int,
                 clock: StepClock | None = None) -> None:
        self.engine = engine
        self.client = client
        self.generation = generation
        self.num_followers = num_followers
        self.clock = clock or StepClock()
        self.seq = 0
        """Sequence number of the next plan: keys use it, not plan.step_id, so they are always contiguous."""
        self._oldest_kept = 0
        self._lock = threading.Lock()
        """Held by `run` and `command`: a command falls between two steps, in one order on every host."""

    def publish(self, plan: StepPlan | AdapterCommand) -> None:
        t0 = time.perf_counter()
        self.client.key_value_set_bytes(plan_key(self.generation, self.seq), plan.to_bytes())
        self.seq += 1
        if self.seq % ACK_EVERY == 0:
            self._delete_acknowledged()
        self.clock.broadcast_s_total += time.perf_counter() - t0
        self.clock.broadcasts += 1

    def _delete_acknowledged(self) -> None:
        if self.num_followers == 0:
            done = self.seq
        else:
            acks = self.client.key_value_dir_get(ack_dir(self.generation))
            if len(acks) < self.num_followers:
                return
            done = min(int(v) for _, v in acks) + 1  # every follower has run steps < done
        for seq in range(self._oldest_kept, done):
            self.client.key_value_delete(plan_key(self.generation, seq))
        self._oldest_kept = max(self._oldest_kept, done)

    def run(self, plan: StepPlan) -> StepResult | None:
        """Broadcast `plan` and execute it here; returns None for a shutdown plan."""
        with self._lock:
            self.clock.begin()
            try:
                self.publish(plan)
                if plan.shutdown:
                    return None
                return self.engine.step(plan)
            finally:
                self.clock.end()

    def command(self, cmd: AdapterCommand, timeout_s: float) -> dict[str, Any]:
        """Check `cmd` here, then send it to every host and apply it here, between two steps (waits at most
        `timeout_s` for the step in flight; TimeoutError naming it otherwise). Raises the check's error (nothing
        sent) or the apply's."""
        engine: Any = self.engine  # an `Engine` with adapter slots (`check_adapter_command`, `adapter_command`)
        if not self._lock.acquire(timeout=timeout_s):
            raise TimeoutError(f"adapter {cmd.op} of slot {cmd.slot}: the step in flight did not end within "
                               f"{timeout_s} s")
        try:
            engine.check_adapter_command(cmd)
            self.publish(cmd)
            return dict(engine.adapter_command(cmd))
        finally:
            self._lock.release()


class FollowerLoop:
    """Ranks > 0: fetch plan n, run it, n += 1, until a shutdown plan or `stop()`.

    `poll_ms` bounds each wait so the stop flag is re-checked; while the gang is idle there are simply no
    plans. A dead rank 0 takes the coordination service with it and JAX ends this process, which the
    supervisor sees as an actor death.
    """

    def __init__(self, engine: StepRunner, client: KeyValueClient, generation: int, rank: int,
                 poll_ms: int = 500, clock: StepClock | None = None) -> None:
        self.engine = engine
        self.rank = rank
        self.client = client
        self.generation = generation
        self.poll_ms = poll_ms
        self.clock = clock or StepClock()
        self._stop = threading.Event()
        self.next_step = 0
        self.steps_failed = 0
        """Plans whose engine step raised `RequestFailed` (skipped here as on every host)."""

    def stop(self) -> None:
        self._stop.set()

    def _fetch(self, step_id: int) -> bytes | None:
        key = plan_key(self.generation, step_id)
        while not self._stop.is_set():
            try:
                return self.client.blocking_key_value_get_bytes(key, self.poll_ms)
            except TimeoutError:  # no plan yet: re-check the stop flag; any other error is real
                continue
        return None

    def run(self, first_step: int = 0) -> int:
        """Run steps until shutdown; returns the number of steps executed."""
        self.next_step = first_step
        while True:
            data = self._fetch(self.next_step)
            if data is None:
                return self.clock.steps_done
            if AdapterCommand.is_command(data):
                engine: Any = self.engine
                engine.adapter_command(AdapterCommand.from_bytes(data))
                self.next_step += 1
                continue
            plan = StepPlan.from_bytes(data)
            if plan.shutdown:
                return self.clock.steps_done
            self.clock.begin()
            try:
                self.engine.step(plan)
            except RequestFailed:
                # raised before any device work, on every host alike (rank 0 fails those requests and plans the
                # others again): this host skipped the same step, so it goes on in lockstep
                self.steps_failed += 1
            finally:
                self.clock.end()
            if self.next_step % ACK_EVERY == ACK_EVERY - 1:
                self.client.key_value_set(f"{ack_dir(self.generation)}{self.rank}", str(self.next_step),
                                          allow_overwrite=True)
            self.next_step += 1
