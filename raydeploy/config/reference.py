"""The docs' config reference, generated from the sections' field docstrings (`raydeploy config-reference`)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import typing
from collections.abc import Callable
from typing import Any, cast

from raydeploy.config.load import _type_name
from raydeploy.config.schema import Config

# -- introspection for docs ---------------------------------------------------------------------------


def field_docs(cls: type) -> dict[str, str]:
    """Map field name -> the docstring written under it in the class body."""
    try:
        tree = ast.parse(inspect.getsource(cls).strip())
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in itertools.pairwise(body):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            docs[prev.target.id] = node.value.value.strip()
    return docs


def config_reference_markdown() -> str:
    """The config reference table for docs/config.md, generated from the dataclasses above."""
    lines = ["# Config reference", "", "Generated from `raydeploy/config/` (`raydeploy config-reference`).", ""]
    hints_cfg = typing.get_type_hints(Config)
    for section in ("cluster", "mesh", "model", "engine", "serving", "replicas", "lora"):
        cls = hints_cfg[section]
        lines += [f"## `{section}`", "", (cls.__doc__ or "").strip(), "", "| key | type | default | meaning |",
                  "| --- | --- | --- | --- |"]
        lines += _rows(cls, section)
        lines.append("")
    return "\n".join(lines)


def _rows(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            rows += _rows(tp, f"{prefix}.{f.name}")
            continue
        default = (f.default if f.default is not dataclasses.MISSING
                   else cast(Callable[[], Any], f.default_factory)())  # no default: it has a default_factory
        rows.append(f"| `{prefix}.{f.name}` | `{_type_name(tp)}` | `{default!r}` | {docs.get(f.name, '')} |")
    return rows
