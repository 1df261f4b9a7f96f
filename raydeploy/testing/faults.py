"""Fault injection for gang tests: a host that never joins, fails its load, hangs in a step, or an engine that
fails one request; and hosts that run with another config.

A test passes `engine=FaultyEngine("toy", faults={rank: {...}})` to `start_gang` (or `start_serving`, for every
gang replica): an engine source (raydeploy.gang.engines) that wraps the named factory. The hosts of the first gang
(generation 1) get their rank's faults at the matching phase; the engine faults are wrappers around whatever the
factory built. `host_configs={rank: cfg}` gives a host another config (every generation). Nothing here is
imported unless a test injects faults.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from raydeploy.config import Config
from raydeploy.engine.request import RequestFailed
from raydeploy.gang.engines import EngineSource
from raydeploy.gang.runtime import LoadedEngine

FAULT_KEYS = ("never_join", "hang_at_step", "fail_load", "raise_on_token")


@dataclass(frozen=True)
class FaultyEngine(EngineSource):
    """The named engine factory, with per-rank faults injected into the first gang and per-rank configs."""

    faults: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    host_configs: Mapping[int, Config] = field(default_factory=dict)

    def check(self) -> None:
        super().check()
        for f in self.faults.values():
            check_faults(f)

    def _faults(self, rank: int, generation: int) -> dict[str, Any]:
        return dict(self.faults.get(rank, {})) if generation == 1 else {}  # the first gang only

    def config_for(self, cfg: Config, rank: int) -> Config:
        return self.host_configs.get(rank, cfg)

    async def before_init(self, rank: int, generation: int) -> None:
        await before_init(self._faults(rank, generation), rank)

    def load(self, cfg: Config, mesh: Any, checkpoint_path: str | None, rank: int, generation: int) -> LoadedEngine:
        faults = self._faults(rank, generation)
        before_load(faults, rank)
        loaded = super().load(cfg, mesh, checkpoint_path, rank, generation)
        return replace(loaded, engine=wrap_engine(faults, loaded.engine))


def check_faults(faults: Mapping[str, Any]) -> None:
    """Refuse a fault this module does not know, naming the known ones."""
    unknown = set(faults) - set(FAULT_KEYS)
    if unknown:
        raise ValueError(f"unknown fault(s) {sorted(unknown)}; known: {FAULT_KEYS}")


async def before_init(faults: Mapping[str, Any], rank: int) -> None:
    """`never_join: SECONDS`: wait that long instead of joining jax.distributed, then fail."""
    if faults.get("never_join"):
        await asyncio.sleep(float(faults["never_join"]))
        raise RuntimeError(f"host {rank}: fault injected, did not join")


def before_load(faults: Mapping[str, Any], rank: int) -> None:
    """`fail_load: true`: the load phase fails."""
    if faults.get("fail_load"):
        raise RuntimeError(f"host {rank}: fault injected in load")


def wrap_engine(faults: Mapping[str, Any], engine: Any) -> Any:
    """`hang_at_step: N`: the engine blocks forever in its step N (like a host stuck in a collective).
    `raise_on_token: ID`: a step whose plan carries token id ID in a row's new tokens raises `RequestFailed`
    naming that row, before the engine it wraps sees the plan (give it to every rank: each host raises alike)."""
    if "raise_on_token" in faults:
        engine = PoisonTokenEngine(engine, int(faults["raise_on_token"]))
    if "hang_at_step" in faults:
        return HangingEngine(engine, int(faults["hang_at_step"]))
    return engine


class PoisonTokenEngine:
    """Steps like the engine it wraps, except that a plan carrying `token` fails the rows that carry it: the
    deterministic per-request failure every host of a gang raises at the same plan, before any device work."""

    def __init__(self, engine: Any, token: int) -> None:
        self.engine = engine
        self.token = token
        self.raised = 0

    def __getattr__(self, name: str) -> Any:  # the wrapped engine's figures (slots, vocabulary, ...)
        return getattr(self.engine, name)

    def step(self, plan: Any) -> Any:
        rows = [q.slot for q in plan.seqs if np.any(np.asarray(q.tokens) == self.token)]
        if rows:
            self.raised += 1
            raise RequestFailed(f"fault injected: the plan carries token id {self.token}", slots=tuple(rows))
        return self.engine.step(plan)


class HangingEngine:
    """Steps like the engine it wraps, until step `hang_at_step`, which never returns."""

    def __init__(self, engine: Any, hang_at_step: int) -> None:
        self.engine = engine
        self.hang_at_step = hang_at_step
        self.n = 0

    def __getattr__(self, name: str) -> Any:  # the wrapped engine's geometry, status, figures
        return getattr(self.engine, name)

    def step(self, plan: Any) -> Any:
        if self.n == self.hang_at_step:
            while True:
                time.sleep(3600)
        self.n += 1
        return self.engine.step(plan)
