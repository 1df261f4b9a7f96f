"""`raydeploy.loading.build_engine`: the one way from a checkpoint to an engine, for the host actor and
`raydeploy generate` alike."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from raydeploy import loading
from raydeploy.config import load_config
from raydeploy.engine import generate
from raydeploy.gang import runtime

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


class _Built(Exception):
    """Raised by the stand-in build_engine to stop right where the engine would be built."""


def _record(calls: list[tuple[Any, ...]]) -> Any:
    def build_engine(cfg: Any, mesh: Any, checkpoint: Any, **kw: Any) -> Any:
        calls.append((cfg, mesh, Path(checkpoint), kw))
        raise _Built

    return build_engine


def test_the_host_actor_and_generate_build_through_build_engine(monkeypatch: pytest.MonkeyPatch,
                                                               demo_checkpoint: Path) -> None:
    """No second copy of checkpoint-to-engine loading: `raydeploy generate` once read the weights without the
    family's sharding rules that the host actor merged in."""
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(loading, "build_engine", _record(calls))
    cfg = load_config(CONFIGS / "local.yaml")
    with pytest.raises(_Built):
        runtime.load_checkpoint_engine(cfg, "the mesh", str(demo_checkpoint))
    args = argparse.Namespace(prompt="Hello", chat=None, max_tokens=1, temperature=None, top_p=None, top_k=None,
                              seed=0, json=True)
    with pytest.raises(_Built):
        generate._generate(cfg, args)
    (host_cfg, host_mesh, host_path, host_kw), (gen_cfg, gen_mesh, gen_path, gen_kw) = calls
    assert host_cfg is gen_cfg is cfg and host_mesh == "the mesh" and host_kw == gen_kw == {}
    assert host_path == gen_path == demo_checkpoint
    assert dict(gen_mesh.shape) == cfg.mesh_shape or set(dict(gen_mesh.shape).values()) == {1}


def test_build_engine_reads_with_the_familys_rules_under_the_configured(demo_checkpoint: Path) -> None:
    import jax

    from raydeploy.model.sharding import build_mesh

    cfg = load_config(CONFIGS / "local.yaml")
    mesh = build_mesh({"dp": 1, "fsdp": 1, "tp": 1, "sp": 1}, jax.devices()[:1])
    built = loading.build_engine(cfg, mesh, demo_checkpoint)
    ps = built.engine.programs_set
    assert built.family.name == "llama" and built.model.num_layers == 30
    assert ps.rules == {**built.family.rules, **ps.rules}  # the family's rules are under the configured ones
    assert built.load_stats.bytes_read > 0 and built.load_s > 0
    assert ps.geometry.max_slots == cfg.engine.max_slots and ps.geometry.problems() == []
