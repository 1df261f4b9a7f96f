"""Walking a jaxpr and the jaxprs inside it (jit, scan, cond, shard_map...), for tests that check a program's
structure: where a cond sits, whether a Pallas kernel is called."""

from __future__ import annotations

from typing import Any


def _sub_jaxprs(eqn: Any) -> list[Any]:
    out = []
    for v in eqn.params.values():
        for x in (v if isinstance(v, (list, tuple)) else (v,)):
            if hasattr(x, "eqns"):
                out.append(x)
            elif hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
                out.append(x.jaxpr)
    return out


def walk(jaxpr: Any, in_loop: bool = False) -> list[tuple[Any, bool]]:
    """Every equation of a jaxpr and its sub-jaxprs, with whether it sits inside a scan or while loop; a Pallas
    kernel's own body is not entered."""
    found = []
    for eqn in jaxpr.eqns:
        found.append((eqn, in_loop))
        if eqn.primitive.name == "pallas_call":
            continue
        loop = in_loop or eqn.primitive.name in ("scan", "while")
        for sub in _sub_jaxprs(eqn):
            found.extend(walk(sub, loop))
    return found


def primitives(jaxpr: Any) -> set[str]:
    """The names of every primitive in a jaxpr and its sub-jaxprs (a Pallas kernel's body not entered)."""
    return {eqn.primitive.name for eqn, _ in walk(jaxpr)}
