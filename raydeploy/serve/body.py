"""Reading a request body into JSON data, strictly: the one place raw client bytes become Python values.

`read_json_object(request, max_body_bytes)` checks the content type and the size limit while reading, then
parses with rules stricter than Python's `json` defaults, so every hostile body is a 4xx naming what was
wrong rather than something that fails deeper (in the tokenizer, the engine, or while writing the reply):

- `NaN`, `Infinity` and numbers that overflow a float are not JSON (RFC 8259) and are refused;
- integers beyond the 64-bit range are refused (no field takes one; Python would accept any size);
- a key repeated in one object is refused (parsers disagree on which copy wins);
- nesting deeper than `MAX_DEPTH` is refused before parsing (no recursion limit is ever reached);
- text holding a lone UTF-16 surrogate (`"\\ud800"`, which JSON's escapes allow but Unicode text cannot
  hold) or a NUL character is refused with the field's path, before any tokenizer sees it.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

from starlette.requests import Request

from raydeploy.serve.errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType

MAX_DEPTH = 32
"""Deepest nesting of arrays/objects a body may have (the deepest valid body nests 4 levels)."""
INT_RANGE = (-(2**63), 2**63 - 1)

_STRING_RE = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


class _BadJSON(ValueError):
    """Raised from the parser's hooks: a body that parses but breaks one of the rules above."""


async def read_body_bytes(request: Request, max_body_bytes: int) -> bytes:
    """The raw body of a JSON request, read with the size limit enforced as it streams in."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise UnsupportedMediaType(ctype or None)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_body_bytes:
        raise PayloadTooLarge(max_body_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise PayloadTooLarge(max_body_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json_object(request: Request, max_body_bytes: int) -> dict[str, Any]:
    """The body as a JSON object (dict), or an `InvalidRequest`/415/413 naming what is wrong."""
    return parse_json_object(await read_body_bytes(request, max_body_bytes))


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Parse and check `raw` (see the module docstring for the rules)."""
    try:
        text = raw.decode("utf-8")  # strict: bytes that are not UTF-8 (including encoded surrogates) fail
    except UnicodeDecodeError:
        raise InvalidRequest("the body is not UTF-8 text", code="invalid_json") from None
    # counting brackets is cheap; finding which are outside strings is not, and is only needed when many
    depth = nesting_depth(raw) if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH else 0
    if depth > MAX_DEPTH:
        raise InvalidRequest(f"the body nests arrays/objects {depth} levels deep; at most {MAX_DEPTH} are allowed",
                             code="invalid_json")
    try:
        data = json.loads(text, object_pairs_hook=_object, parse_constant=_constant, parse_int=_int,
                          parse_float=_float)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                             code="invalid_json") from None
    except _BadJSON as e:
        raise InvalidRequest(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest(f"the body must be a JSON object, found {_json_type(data)}", code="invalid_json")
    bad = _find_bad_text(data)
    if bad is not None:
        path, what, in_key = bad
        where = (f"a key in '{path}'" if path else "a key of the body") if in_key else f"'{path}'"
        raise InvalidRequest(f"{where} holds {what}, which is not valid in text", param=path or None,
                             code="invalid_text")
    return data


def nesting_depth(raw: bytes) -> int:
    """The deepest nesting of [ and { in a JSON text, outside strings (no parsing, no recursion)."""
    outside = _STRING_RE.sub(b"", raw)
    brackets = outside.translate(None, delete=bytes(b for b in range(256) if b not in _DEPTH_STEP))
    return max(accumulate(_DEPTH_STEP[b] for b in brackets), default=0)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _BadJSON(f"the key {_show(k)} appears twice in one object")
        out[k] = v
    return out


def _constant(name: str) -> Any:
    raise _BadJSON(f"{name} is not a JSON number")


def _int(text: str) -> int:
    # Python's own limit on digits (4300) would raise a plain ValueError; check the length first
    if len(text.lstrip("-")) > 19:
        raise _BadJSON(f"the integer {text[:24]}{'...' if len(text) > 24 else ''} is outside the 64-bit range")
    value = int(text)
    if not INT_RANGE[0] <= value <= INT_RANGE[1]:
        raise _BadJSON(f"the integer {text} is outside the 64-bit range")
    return value


def _float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _BadJSON(f"the number {text[:24]}{'...' if len(text) > 24 else ''} is too large for a float")
    return value


def _find_bad_text(data: Any) -> tuple[str, str, bool] | None:
    """(path, what, whether it is a key) of the first string with a lone surrogate or a NUL, else None."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            what = _text_problem(value)
            if what:
                return path, what, False
        elif isinstance(value, dict):
            for k, v in value.items():
                what = _text_problem(k)
                if what:
                    return path, what, True  # name where the key sits, not the key
                stack.append((f"{path}.{k}" if path else k, v))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), v) for i, v in enumerate(value))
    return None


def _text_problem(s: str) -> str | None:
    if "\x00" in s:
        return "a NUL character (U+0000)"
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return "a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape)"
    return None


def _show(key: str) -> str:
    """A key for an error message: short, and safe to write as UTF-8."""
    short = key if len(key) <= 40 else key[:40] + "..."
    return repr(short.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace"))


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
            type(None): "null"}.get(type(value), type(value).__name__)
