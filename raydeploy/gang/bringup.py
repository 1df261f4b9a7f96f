"""Bring-up: from nothing to a ready gang, one bounded phase at a time.

1. place: one placement-group bundle per host (raydeploy.gang.placement).
2. start: one HostActor per bundle, each its own process with its JAX environment (the supervisor records
   every host's pid and node, so a teardown can wait for each process on its own node).
3. preflight: every host checks its accelerator platform, device count, TPU variables and slice topology
   against the config, reading only the environment and device files (no JAX backend starts). A failure
   is a non-retriable GangError: the same hosts would fail the same way.
4. fingerprint: every host fingerprints config + code + checkpoint; rank 0's is the reference; any
   difference refuses the gang before anything joins.
5. init: rank 0 picks the coordinator address (its node IP or cluster.coordinator_bind_address, and
   cluster.coordinator_port: 8476 on real clusters, a free port on simulated hosts), which its coordination
   service then listens on, and only there (not every interface); ALL hosts call
   jax.distributed.initialize concurrently (waiting for rank 0 first would deadlock); a host that never
   joins fails the phase within init_timeout_s plus a small margin, naming the hosts that did not finish.
6. load: every host reads its part of the checkpoint concurrently (per-host bytes, seconds, GB/s).
7. compile: every host warms the same programs concurrently (they run collectives together).
Then `serve` starts each host's loop. Phase times are recorded for the bring-up report.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from raydeploy.config import Config
from raydeploy.gang.fingerprint import check_fingerprints

INIT_MARGIN_S = 10.0


class GangError(RuntimeError):
    """A bring-up phase or the running gang failed; says which phase, which hosts and why."""

    def __init__(self, message: str, phase: str = "", retriable: bool = True) -> None:
        super().__init__(message)
        self.phase = phase
        self.retriable = retriable

    def __reduce__(self):
        return (GangError, (str(self), self.phase, self.retriable))


def _root(e: BaseException) -> str:
    """A one-line cause of an error that may have crossed Ray (RayTaskError wraps the remote one)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        e = cause
    text = str(e).strip().splitlines()
    last = next((ln for ln in reversed(text) if ln.strip()), type(e).__name__)
    return f"{type(e).__name__}: {last.strip()}"[:600]


async def gather_phase(phase: str, refs: Sequence[Any], timeout_s: float) -> list[Any]:
    """Await one call per host; raise GangError naming failed and unfinished hosts if any fails or times out.

    The first failure ends the wait: a gang that cannot form is reported at once, not after the others'
    timeouts.
    """
    futures = [asyncio.ensure_future(_await_ref(r)) for r in refs]
    done, pending = await asyncio.wait(futures, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
    problems: list[str] = []
    retriable = True
    for rank, fut in enumerate(futures):
        if fut in done and (exc := fut.exception()) is not None:
            problems.append(f"host {rank} failed: {_root(exc)}")
            retriable = retriable and _retriable(exc)
    missing = [rank for rank, fut in enumerate(futures) if fut in pending]
    for fut in pending:
        fut.cancel()
    if missing:
        when = "before another host failed" if problems else f"within {timeout_s:g}s"
        problems.insert(0, f"host(s) {missing} did not finish {phase} {when}")
    if problems:
        raise GangError(f"bring-up phase '{phase}' failed: " + "; ".join(problems), phase=phase,
                        retriable=retriable)
    return [f.result() for f in futures]


def _retriable(e: BaseException) -> bool:
    """False for errors that say a restart cannot fix them (a `retriable = False` attribute, e.g.
    PreflightError), also when they crossed Ray wrapped in a RayTaskError."""
    cause = getattr(e, "cause", None)
    return getattr(cause if isinstance(cause, BaseException) else e, "retriable", True) is not False


async def _await_ref(ref: Any) -> Any:
    return await ref


async def bring_up(cfg: Config, hosts: Sequence[Any], record: dict[str, float],
                   on_phase: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Phases 3-6 on already started host actors; fills `record` with phase seconds; returns per-host info."""
    c = cfg.cluster
    note = on_phase or (lambda phase: None)
    rpc = c.rpc_timeout_s

    t0 = time.perf_counter()
    preflight = await gather_phase("preflight", [h.preflight.remote() for h in hosts], rpc)
    record["preflight_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    fps = await gather_phase("fingerprint", [h.fingerprint.remote() for h in hosts], rpc)
    from raydeploy.gang.fingerprint import FingerprintMismatchError

    try:
        check_fingerprints(fps)
    except FingerprintMismatchError as e:
        raise GangError(str(e), phase="fingerprint", retriable=False) from None
    record["fingerprint_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    (address,) = await gather_phase("coordinator", [hosts[0].coordinator_address.remote()], rpc)
    inits = await gather_phase("init", [h.init_distributed.remote(address) for h in hosts],
                               c.init_timeout_s + INIT_MARGIN_S)
    record["init_s"] = time.perf_counter() - t0

    note("load")
    t0 = time.perf_counter()
    loads = await gather_phase("load", [h.load.remote() for h in hosts], rpc)
    record["load_s"] = time.perf_counter() - t0

    note("compile")
    t0 = time.perf_counter()
    compiles = await gather_phase("compile", [h.compile.remote() for h in hosts], rpc)
    record["compile_s"] = time.perf_counter() - t0
    return {"coordinator_address": address, "preflight": preflight, "init": inits, "load": loads,
            "compile": compiles}
