"""Where each host's engine comes from: an `EngineSource`, sent to every host of a gang (it pickles).

The plain source names an engine factory (raydeploy.gang.runtime.ENGINES: "real", "toy", or "module:function")
and loads with it. A host calls the source at three points: the config it runs with (`config_for`), just before it
joins jax.distributed (`before_init`) and to load its engine (`load`). Tests inject failures by wrapping a source
(raydeploy.testing.faults.FaultyEngine), so no gang, supervisor or host signature carries a test parameter. No
JAX here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raydeploy.config import Config
from raydeploy.gang.runtime import ENGINES, LoadedEngine, load_engine


@dataclass(frozen=True)
class EngineSource:
    """An engine factory by name, loaded as it is on every host."""

    factory: str = "real"

    @property
    def reads_checkpoint(self) -> bool:
        """Only the real engine reads the checkpoint (the others get no path)."""
        return self.factory == "real"

    def check(self) -> None:
        """A known engine name or "module:function" (imported on the hosts, not here: no JAX in the driver)."""
        f = self.factory
        if f not in ENGINES and (":" not in f or f.startswith(":") or f.endswith(":")):
            raise ValueError(f"engine must be one of {sorted(ENGINES)} or 'module:function', found {f!r}")

    def config_for(self, cfg: Config, rank: int) -> Config:
        """The config host `rank` runs with."""
        return cfg

    async def before_init(self, rank: int, generation: int) -> None:
        """Called on host `rank` of gang `generation` before it joins jax.distributed."""

    def load(self, cfg: Config, mesh: Any, checkpoint_path: str | None, rank: int, generation: int) -> LoadedEngine:
        """Build this host's engine with the named factory."""
        return load_engine(self.factory, cfg, mesh, checkpoint_path)


def engine_source(engine: str | EngineSource) -> EngineSource:
    """`engine` as a checked source (a factory name becomes the plain source); ValueError naming what is wrong."""
    source = engine if isinstance(engine, EngineSource) else EngineSource(engine)
    source.check()
    return source
