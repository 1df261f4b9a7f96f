"""The slots' one divisibility rule: `engine.max_slots` splits evenly over the dp groups of the KV cache, the mesh
axes that `mesh.rules.cache_batch` maps the slot axis to.

It is a rule about the config's own keys, so it lives with the config (the ground floor every other module stands
on): the config's load asks it, and `raydeploy.engine.geometry.EngineGeometry` lists it among its problems. No JAX.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

SLOT_AXIS = "cache_batch"
"""The logical axis of the KV cache's slots (and pages): the mesh axes it maps to split the slots into dp groups."""
DEFAULT_SLOT_RULE = "dp"
"""`raydeploy.model.sharding.DEFAULT_RULES`' rule for the slot axis (`raydeploy.config` imports nothing of the model)."""


def slot_axes(rules: Mapping[str, Any], mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes of size > 1 that `rules` map the slot axis (`cache_batch`) to."""
    rule = rules.get(SLOT_AXIS)
    axes = () if rule is None else ((rule,) if isinstance(rule, str) else tuple(rule))
    return tuple(a for a in axes if mesh_shape.get(a, 1) > 1)


def slot_groups(rules: Mapping[str, Any], mesh_shape: Mapping[str, int]) -> int:
    """dp groups: shards of the slot axis, each holding one run of consecutive slots and its own pages."""
    return math.prod(mesh_shape[a] for a in slot_axes(rules, mesh_shape))


def slots_problem(max_slots: int, rules: Mapping[str, Any], mesh_shape: Mapping[str, int]) -> str | None:
    """The one divisibility rule of the slots: `engine.max_slots` splits evenly over the dp groups (the mesh axes
    `mesh.rules.cache_batch` maps to). None when it does."""
    axes = slot_axes(rules, mesh_shape)
    groups = math.prod(mesh_shape[a] for a in axes)
    if max_slots % groups == 0:
        return None
    over = " x ".join(f"{a}={mesh_shape[a]}" for a in axes) or "1 group"
    return (f"engine.max_slots {max_slots} is not divisible by mesh {over} (the dp groups of the KV cache's slots, "
            f"mesh.rules.cache_batch)")
