"""What a request's structured-output fields mean for generation: the `Constraint` its answer must match.

`response_format` (OpenAI: text, json_object, json_schema) and vLLM's `structured_outputs` (json, json_object,
regex, choice, grammar) become a `Constraint`; a chat request whose `tool_choice` is "required" or names a
function becomes the chat format's grammar of one call (or several, with `parallel_tool_calls`) whose
arguments match the function's schema. Every constraint is checked with the grammar engine here, on the
ingress, so a schema, regex or grammar it cannot use is a 400 that names the field and the problem instead of
a failure on the gang. The checks cost a grammar validation each (cached by source in
`raydeploy.constraints`), so they run after admission, on a tokenizer thread.

A forced tool call and a JSON response format are refused together in validation (`protocol`): the call is
already constrained to the function's schema. With tool_choice "auto" a response format applies to the whole
answer as usual, and calls are still parsed from it.
"""

from __future__ import annotations

import json
from typing import Any

from raydeploy.constraints import Constraint, ConstraintError, check
from raydeploy.serve.chat import ChatFormat
from raydeploy.serve.errors import InvalidRequest
from raydeploy.serve.protocol import ChatCompletionRequest, CompletionRequest, StructuredOutputs

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""A function's schema when `parameters` is left out (OpenAI: a function without parameters)."""


def output_constraint(body: CompletionRequest | ChatCompletionRequest) -> Constraint | None:
    """The constraint of `response_format` or `structured_outputs` (validation lets at most one through),
    checked; None for plain text."""
    if body.structured_outputs is not None:
        return checked(_from_structured_outputs(body.structured_outputs), "structured_outputs")
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return checked(Constraint("json_object"), "response_format")
    schema = fmt.json_schema.schema_
    if schema is None:
        raise InvalidRequest("'response_format.json_schema.schema' is required: the JSON schema the answer must "
                             "match", param="response_format", code="invalid_value")
    if not isinstance(schema, dict):
        raise InvalidRequest(f"'response_format.json_schema.schema' must be a JSON object (a JSON schema), not "
                             f"{_json_type(schema)}", param="response_format", code="invalid_value")
    return checked(Constraint("json_schema", json.dumps(schema)), "response_format")


def chat_constraint(body: ChatCompletionRequest, chat: ChatFormat) -> Constraint | None:
    """A chat request's constraint: the forced tool call's grammar (tool_choice "required" or a named function),
    else its output constraint. The functions that may be called have their parameter schemas checked first,
    so a bad one is named by its function."""
    forced = body.forced_tool
    if forced is None:
        return output_constraint(body)
    tools = tool_dicts(body)
    callable_ = [t for t in tools if not forced or t["function"]["name"] == forced]
    for t in callable_:
        name = t["function"]["name"]
        try:
            check(Constraint("json_schema", json.dumps(t["function"]["parameters"])))
        except ConstraintError as e:
            raise InvalidRequest(f"'tools': the parameters of function {name!r} cannot be used to constrain its "
                                 f"call: {e}", param="tools", code="invalid_value") from None
    return checked(chat.tool_constraint(tools, forced or None, body.parallel_tool_calls), "tools")


def tool_dicts(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """`tools` as chat templates and the chat format take them (OpenAI's shape); a function without
    `parameters` gets the empty object schema, which every template can show."""
    out = []
    for t in body.tools or ():
        d = t.model_dump(exclude_none=True, by_alias=True)
        d["function"].setdefault("parameters", EMPTY_PARAMETERS)
        out.append(d)
    return out


def checked(c: Constraint, param: str) -> Constraint:
    """`c`, once the grammar engine accepts it; its refusal is a 400 on `param` with the engine's reason."""
    try:
        check(c)
    except ConstraintError as e:
        raise InvalidRequest(f"'{param}': {e}", param=param, code="invalid_value") from None
    return c


def _from_structured_outputs(so: StructuredOutputs) -> Constraint:
    if so.json_ is not None:
        schema: Any = so.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidRequest(f"'structured_outputs.json' is not valid JSON: {e}", param="structured_outputs",
                                     code="invalid_value") from None
        if not isinstance(schema, dict):
            raise InvalidRequest(f"'structured_outputs.json' must be a JSON schema object, not {_json_type(schema)}",
                                 param="structured_outputs", code="invalid_value")
        return Constraint("json_schema", json.dumps(schema))
    if so.json_object:
        return Constraint("json_object")
    if so.regex is not None:
        return Constraint("regex", so.regex)
    if so.choice is not None:
        return Constraint("choice", json.dumps(so.choice))
    assert so.grammar is not None  # validation lets exactly one field through
    return Constraint("grammar", so.grammar)


def _json_type(v: Any) -> str:
    for t, name in ((bool, "a boolean"), (str, "a string"), (int | float, "a number"), (list, "an array")):
        if isinstance(v, t):
            return name
    return "null" if v is None else type(v).__name__
