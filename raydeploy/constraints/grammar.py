"""A constraint as the grammar engine's text, and the check that refuses one the engine cannot compile.

`to_grammar` turns a `Constraint` into llguidance's grammar (its JSON form, which `LLMatcher` takes); `check`
runs llguidance's validator on it without a tokenizer, so the HTTP ingress can refuse a bad schema, regex,
choice or grammar with a 400 that names the problem before the request reaches a gang. The same text is what
rank 0's `GrammarEngine` compiles, so a constraint that passes `check` compiles there too (barring resource
limits). No JAX and no tokenizer here.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from llguidance import LLMatcher

from raydeploy.constraints.spec import Constraint

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_WHITESPACE = r"( ?|\n[ \t]{0,16})"
"""The whitespace a JSON output may hold between two tokens: none, one space, or one newline and an indent of up to
16. Free whitespace lets a sampled model spend its whole budget on blanks (at temperature 1 the demo model writes
newline after newline inside an object and never closes it, as it did with a bounded run of any blanks); none at
all pushes a model that pretty-prints (the demo model opens `{` then a newline) off its own path and into a key
it never closes. One space or one line break per gap keeps both: pretty-printed and compact JSON pass, runs of
blank lines do not."""

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "whitespace_pattern": JSON_WHITESPACE}
"""llguidance's JSON compile options: separators with at most `JSON_WHITESPACE` around them."""

_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains")


def strict_schema(schema: object) -> object:
    """`schema` with every object schema that lists `properties` and says nothing of `additionalProperties` closed
    (`additionalProperties: false`), recursively: what OpenAI's strict mode and vLLM's default grammar engine
    (xgrammar's strict mode) generate. JSON Schema itself allows any further property there, and a sampled model
    then invents keys (LangChain's tool schemas leave the keyword out). A schema that sets the keyword keeps it."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_schema(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(v) for v in out[key]]
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict | list):
            out[key] = strict_schema(out[key])
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out

CHECK_CACHE_SIZE = 1024
"""Checked constraints remembered (by `Constraint.key`): a client that sends the same schema with every request
pays the validation once."""


class ConstraintError(ValueError):
    """A constraint the grammar engine cannot use: its message names the constraint's kind and the problem."""


def _json_source(c: Constraint, what: str) -> object:
    try:
        return json.loads(c.source)
    except json.JSONDecodeError as e:
        raise ConstraintError(f"{c.kind} constraint: {what} is not valid JSON: {e}") from None


def to_grammar(c: Constraint) -> str:
    """The llguidance grammar for `c`: json_schema through llguidance's JSON-schema compiler, json_object as the
    schema {"type": "object"}, regex as a regex matching the whole output, choice as a Lark rule of literal
    alternatives, grammar as the Lark text it is. Raises ConstraintError when the source is not even of the
    right form (a schema that is not JSON, a choice that is not a list of strings); the grammar's own
    errors (an unsupported schema keyword, a bad regex) are found by `check`."""
    if c.kind == "json_schema":
        schema = _json_source(c, "the schema")
        if not isinstance(schema, dict | bool):
            raise ConstraintError(f"json_schema constraint: the schema must be a JSON object (or true/false), "
                                  f"not {type(schema).__name__}")
        return _from_schema(schema)
    if c.kind == "json_object":
        return _from_schema({"type": "object"})
    if c.kind == "regex":
        return LLMatcher.grammar_from_regex(c.source)
    if c.kind == "choice":
        choices = _json_source(c, "the choice list")
        if not isinstance(choices, list) or not all(isinstance(x, str) for x in choices):
            raise ConstraintError("choice constraint: the choices must be a JSON list of strings")
        if not choices:
            raise ConstraintError("choice constraint: the list of choices is empty")
        # Lark string literals take JSON's escapes, so json.dumps quotes each choice exactly
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(x) for x in choices))
    if c.kind == "grammar":
        if not c.source.strip():
            raise ConstraintError("grammar constraint: the grammar is empty")
        return LLMatcher.grammar_from_lark(c.source)
    raise ConstraintError(f"constraint kind {c.kind!r} has no grammar")  # spec.Constraint refuses other kinds


def _from_schema(schema: dict | bool) -> str:
    if schema is False:
        raise ConstraintError("json_schema constraint: the schema false matches no output")
    if schema is True:
        schema = {}  # any JSON value (llguidance's options need an object schema)
    try:
        return LLMatcher.grammar_from_json_schema(json.dumps(strict_schema(schema)), defaults=JSON_OPTIONS)
    except ValueError as e:  # llguidance raises for a schema that is not a JSON object or boolean
        raise ConstraintError(f"json_schema constraint: {e}") from None


_WHAT = {"json_schema": "the JSON schema", "json_object": "the JSON object grammar", "regex": "the regex",
         "choice": "the choice list", "grammar": "the Lark grammar"}

MAX_MESSAGE_CHARS = 600
"""The longest engine message kept in a ConstraintError (a deep schema's error can quote much of it)."""


def _brief(message: str) -> str:
    """`message` bounded to MAX_MESSAGE_CHARS."""
    message = message.strip()
    return message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS] + " ..."


_checked: OrderedDict[str, str] = OrderedDict()  # key -> "" (valid) or the error message
_checked_lock = threading.Lock()


def check(c: Constraint) -> None:
    """Raise ConstraintError naming the problem when `c` cannot be compiled: a schema that is not valid JSON, a
    schema keyword or format llguidance does not implement, a bad regex, an empty or malformed choice list, a
    Lark grammar that does not parse. No tokenizer is needed; results are cached by `c.key`."""
    with _checked_lock:
        error = _checked.get(c.key)
        if error is not None:
            _checked.move_to_end(c.key)
    if error is None:
        try:
            is_error, messages = LLMatcher.validate_grammar_with_warnings(to_grammar(c))
            error = f"{c.kind} constraint: {_WHAT[c.kind]} cannot be used: {_brief(messages[0])}" if is_error else ""
        except ConstraintError as e:
            error = str(e)
        with _checked_lock:
            _checked[c.key] = error
            while len(_checked) > CHECK_CACHE_SIZE:
                _checked.popitem(last=False)
    if error:
        raise ConstraintError(error)
