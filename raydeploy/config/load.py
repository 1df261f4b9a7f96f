"""Loading a config: YAML (or a dict), `a.b=value` overrides, pydantic's type check, then `validate`."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin

import yaml

if TYPE_CHECKING:
    import pydantic


from raydeploy.config.schema import DEFAULT_CONFIG_PATH, Config, ConfigError
from raydeploy.config.validate import validate

# -- loading ----------------------------------------------------------------------------------------


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML file (the embedded default when None), apply `a.b=value` overrides, validate."""
    p = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    source = str(p)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config: {e.strerror}", file=source) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML: {e}", file=source) from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"the top level must be a mapping, found {type(raw).__name__}", file=source)
    for item in overrides or []:
        _apply_override(raw, item, source)
    return config_from_dict(raw, source=source)


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    raw = dict(raw)
    raw.pop("source", None)
    import pydantic

    try:
        cfg = _config_adapter().validate_python(raw)
    except pydantic.ValidationError as e:
        raise _config_error(e, raw, source) from None
    cfg = dataclasses.replace(cfg, source=source)
    validate(cfg)
    return cfg


def _apply_override(raw: dict[str, Any], item: str, source: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like section.key=value", file=source)
    dotted, value_text = item.split("=", 1)
    keys = dotted.strip().split(".")
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else None
    except yaml.YAMLError:
        value = value_text
    node = raw
    for k in keys[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override '{item}': '{k}' is not a section", file=source, key=dotted)
        node = nxt
    node[keys[-1]] = value


@functools.cache
def _config_adapter() -> pydantic.TypeAdapter[Config]:
    import pydantic

    return pydantic.TypeAdapter(Config)


REMOVED_KEYS = {
    "engine.prefill_buckets": "prompts are computed in chunks of engine.prefill_chunk tokens and never padded to "
                              "bucket lengths",
}
"""Keys that configs once set, and why they are gone: a config that still sets one fails naming it."""


def _config_error(exc: pydantic.ValidationError, raw: dict[str, Any], source: str) -> ConfigError:
    """The first of pydantic's errors in the file's order, as file + dotted key + what was expected and found."""
    located = [_locate(err["loc"], raw) for err in exc.errors()]
    _, key, tp, value, section = min(located, key=lambda item: item[0])
    if key in REMOVED_KEYS:
        return ConfigError(f"this key was removed ({REMOVED_KEYS[key]}); delete it from the config", file=source,
                           key=key)
    if section is not None:
        known = ", ".join(f.name for f in dataclasses.fields(section) if f.name != "source")
        return ConfigError(f"unknown key; known keys here are: {known}", file=source, key=key)
    return ConfigError(_expected(tp, value), file=source, key=key)


def _locate(loc: tuple[int | str, ...], raw: dict[str, Any]) -> tuple[list[int], str, Any, Any, type | None]:
    """Follow pydantic's error location through the raw data and the annotations.

    Returns (position in the file's order, dotted key, annotation there, value there, and the section class when
    the key is not one of its fields). A union stops the walk: its message names the whole union.
    """
    tp: Any = Config
    value: Any = raw
    key = ""
    order: list[int] = []
    parts = list(loc)
    while parts and get_origin(tp) not in (Union, types.UnionType):
        part = parts.pop(0)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            key = f"{key}.{part}" if key else str(part)
            order.append(list(value).index(part) if part in value else len(value))
            names = {f.name for f in dataclasses.fields(tp)} - ({"source"} if tp is Config else set())
            if part not in names:
                return order, key, None, None, tp
            tp, value = typing.get_type_hints(tp)[str(part)], value[part]
        elif get_origin(tp) is list and isinstance(part, int):
            key, order = f"{key}[{part}]", [*order, part]
            tp, value = get_args(tp)[0], value[part]
        elif get_origin(tp) is dict and part in value:
            key, order = f"{key}.{part}", [*order, list(value).index(part)]
            key_tp, value_tp = get_args(tp)
            if parts and parts[0] == "[key]":  # the key itself has the wrong type
                tp, value = key_tp, part
                parts.pop(0)
            else:
                tp, value = value_tp, value[part]
        else:
            break
    return order, key, tp, value, None


def _expected(tp: Any, value: Any) -> str:
    """What the annotation `tp` asks for, in the config's words, and the value found instead."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return f"expected {_type_name(tp)}, found {value!r}"
    if origin is Literal:
        return f"must be one of {', '.join(repr(a) for a in get_args(tp))}, found {value!r}"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"expected a mapping (section), found {value!r}"
    words = {list: "a list", dict: "a mapping", bool: "true or false", int: "an integer", float: "a number",
             str: "a string"}
    return f"expected {words.get(origin or tp, _type_name(tp))}, found {value!r}"


def _type_name(tp: Any) -> str:
    """An annotation as the messages and the config reference write it (`int`, `str | None`, `list[int]`)."""
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")
