"""Fault injection for gang tests: a host that never joins, fails its load, or hangs in a step.

A test passes `faults={rank: {...}}` to `start_gang`; the supervisor hands each host of the first gang its
rank's dict, and the host calls the hooks below at the matching phase. The engine fault is a wrapper around
whatever the engine factory built. Nothing here is imported unless a test passes faults.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

FAULT_KEYS = ("never_join", "hang_at_step", "fail_load")


def check_faults(faults: dict[str, Any]) -> None:
    """Refuse a fault this module does not know, naming the known ones."""
    unknown = set(faults) - set(FAULT_KEYS)
    if unknown:
        raise ValueError(f"unknown fault(s) {sorted(unknown)}; known: {FAULT_KEYS}")


async def before_init(faults: dict[str, Any], rank: int) -> None:
    """`never_join: SECONDS`: wait that long instead of joining jax.distributed, then fail."""
    if faults.get("never_join"):
        await asyncio.sleep(float(faults["never_join"]))
        raise RuntimeError(f"host {rank}: fault injected, did not join")


def before_load(faults: dict[str, Any], rank: int) -> None:
    """`fail_load: true`: the load phase fails."""
    if faults.get("fail_load"):
        raise RuntimeError(f"host {rank}: fault injected in load")


def wrap_engine(faults: dict[str, Any], engine: Any) -> Any:
    """`hang_at_step: N`: the engine blocks forever in its step N (like a host stuck in a collective)."""
    if "hang_at_step" in faults:
        return HangingEngine(engine, int(faults["hang_at_step"]))
    return engine


class HangingEngine:
    """Steps like the engine it wraps, until step `hang_at_step`, which never returns."""

    def __init__(self, engine: Any, hang_at_step: int) -> None:
        self.engine = engine
        self.hang_at_step = hang_at_step
        self.n = 0

    def step(self, plan: Any) -> Any:
        if self.n == self.hang_at_step:
            while True:
                time.sleep(3600)
        self.n += 1
        return self.engine.step(plan)
