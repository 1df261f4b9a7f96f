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

Every check is linear in the body's size (a body is read before anything else of its request happens, on the
ingress's event loop): the depth pre-scan strips strings with a regex that never backtracks (possessive
repeats, and an unclosed string runs to the end of the body instead of being retried from each quote inside
it), counts brackets with numpy, and the text check builds a field's path only for the field it reports.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
from starlette.requests import Request

from raydeploy.serve.errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType

MAX_DEPTH = 32
"""Deepest nesting of arrays/objects a body may have (the deepest valid body nests 4 levels)."""
INT_RANGE = (-(2**63), 2**63 - 1)

# A string, or an unclosed one up to the end of the body (a lone backslash last included). Possessive repeats
# and alternatives that never overlap: each byte is looked at once, so stripping strings is linear in any body.
_STRING_RE = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_LONG_DIGITS = re.compile(r"\d{19}")
"""A run of digits as long as the 64-bit range's bounds: the only way an integer outside it can be written."""
_LONG_INT = re.compile(r"-?\d{4301,}")
"""An integer longer than Python converts (4300 digits): json raises a plain ValueError on it."""
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = np.zeros(256, np.int8)
_DEPTH_STEP[list(b"[{")] = 1
_DEPTH_STEP[list(b"]}")] = -1


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
    # counting brackets is cheap; finding which are outside strings costs a pass, needed only when many
    depth = nesting_depth(raw) if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH else 0
    if depth > MAX_DEPTH:
        raise _too_deep(str(depth))
    try:
        # integers are parsed by json's own C code (a hook per integer would cost 7x json.loads on a list of
        # token ids) and their range is checked afterwards, in `_audit`
        data = json.loads(text, object_pairs_hook=_object, parse_constant=_constant, parse_float=_float)
    except RecursionError:  # not reached after the pre-scan; here so that it could never be a 500
        raise _too_deep("too many") from None
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                             code="invalid_json") from None
    except _BadJSON as e:
        raise InvalidRequest(f"the body is not valid JSON: {e}", code="invalid_json") from None
    except ValueError:  # Python's limit on an integer's digits (4300)
        long = _LONG_INT.search(text)
        shown = long.group(0)[:24] + "..." if long else "in the body"
        raise InvalidRequest(f"the body is not valid JSON: the integer {shown} is outside the 64-bit range",
                             code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest(f"the body must be a JSON object, found {_json_type(data)}", code="invalid_json")
    _audit(data)
    return data


def _audit(data: dict[str, Any]) -> None:
    """Raise the 400 for an integer outside 64 bits or text with a NUL or a lone surrogate, if there is one.

    One pass of json's C encoder tells whether there may be one (a lone surrogate fails UTF-8, a NUL is written
    as an escape, a big integer is a long run of digits); only then is the data walked to name the field."""
    dumped = json.dumps(data, ensure_ascii=False)
    try:
        dumped.encode("utf-8")
        suspect = "\\u0000" in dumped or _LONG_DIGITS.search(dumped) is not None
    except UnicodeEncodeError:
        suspect = True
    if not suspect:
        return
    bad = _find_bad_value(data)
    if bad is None:  # digits or an escape inside ordinary text
        return
    path, what, in_key = bad
    if what.startswith("the integer"):
        raise InvalidRequest(f"the body is not valid JSON: {what}", code="invalid_json")
    where = (f"a key in '{path}'" if path else "a key of the body") if in_key else f"'{path}'"
    raise InvalidRequest(f"{where} holds {what}, which is not valid in text", param=path or None,
                         code="invalid_text")


def nesting_depth(raw: bytes) -> int:
    """The deepest nesting of [ and { in a JSON text, outside strings (no parsing, no recursion; linear time)."""
    brackets = _STRING_RE.sub(b"", raw).translate(None, delete=_NOT_BRACKETS)
    if not brackets:
        return 0
    steps = _DEPTH_STEP[np.frombuffer(brackets, np.uint8)].astype(np.int64)
    return max(int(np.cumsum(steps).max()), 0)


def _too_deep(depth: str) -> InvalidRequest:
    return InvalidRequest(f"the body nests arrays/objects {depth} levels deep; at most {MAX_DEPTH} are allowed",
                          code="invalid_json")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _BadJSON(f"the key {_show(k)} appears twice in one object")
        out[k] = v
    return out


def _constant(name: str) -> Any:
    raise _BadJSON(f"{name} is not a JSON number")


def _int_problem(value: int) -> str | None:
    if INT_RANGE[0] <= value <= INT_RANGE[1]:
        return None
    text = str(value)
    return f"the integer {text[:24]}{'...' if len(text) > 24 else ''} is outside the 64-bit range"


def _float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _BadJSON(f"the number {text[:24]}{'...' if len(text) > 24 else ''} is too large for a float")
    return value


_Where = tuple[Any, str] | None
"""A value's place in the body, as (its parent's place, its key or index): the path text is built only for the
one value an error names (building it for every value costs the body's size times its depth)."""


def _find_bad_value(data: Any) -> tuple[str, str, bool] | None:
    """(path, what, whether it is a key) of the first string with a lone surrogate or a NUL, or integer outside
    64 bits, else None. Each container's scalars are screened together; only a flagged one is searched."""
    stack: list[tuple[_Where, Any]] = [(None, data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for k in value:
                what = _text_problem(k)
                if what:
                    return _path(where), what, True  # name where the key sits, not the key
            keys, values = list(value), list(value.values())
        else:
            values = value
            keys = None
        if _scalars_suspect(values):
            for i, v in enumerate(values):
                what = _text_problem(v) if v.__class__ is str else _int_problem(v) if v.__class__ is int else None
                if what:
                    return _path((where, keys[i] if keys is not None else str(i))), what, False
        stack.extend(((where, keys[i] if keys is not None else str(i)), v) for i, v in enumerate(values)
                     if v.__class__ is dict or v.__class__ is list)
    return None


def _scalars_suspect(values: list[Any]) -> bool:
    text = "".join([v for v in values if v.__class__ is str])
    if _text_problem(text):
        return True
    ints = [v for v in values if v.__class__ is int]
    return bool(ints) and (min(ints) < INT_RANGE[0] or max(ints) > INT_RANGE[1])


def _path(where: _Where) -> str:
    parts = []
    while where is not None:
        where, part = where
        parts.append(part)
    return ".".join(reversed(parts))


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
