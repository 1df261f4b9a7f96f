"""Structured outputs as requests shape them: OpenAI's `response_format` (text, any JSON object, a named JSON
schema) and vLLM's `structured_outputs` extension. They are only shaped here; what they mean for generation is
:mod:`raydeploy.serve.structured`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from raydeploy.serve.protocol.common import MAX_CHOICES, TOOL_NAME, _at_most, _Tolerant


class JsonSchemaSpec(_Tolerant):
    """`response_format.json_schema`: OpenAI's named schema (`schema` is checked in serve.structured, so that
    a missing or unusable one is a 400 naming the problem rather than pydantic's wording)."""

    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    schema_: Any = Field(default=None, alias="schema")
    strict: bool | None = None


class TextFormat(_Tolerant):
    type: Literal["text"]


class JsonObjectFormat(_Tolerant):
    type: Literal["json_object"]


class JsonSchemaFormat(_Tolerant):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputs(_Tolerant):
    """vLLM's `structured_outputs` extension: exactly one of a JSON schema (an object, or its JSON text), any
    JSON object, a regex, a choice among strings, or a Lark grammar (llguidance's dialect)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    _choice_count = _at_most("choice", MAX_CHOICES, "strings")

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k, v in (("json", self.json_), ("json_object", self.json_object or None),
                                ("regex", self.regex), ("choice", self.choice), ("grammar", self.grammar))
                 if v is not None]
        if len(given) != 1:
            found = ", ".join(given) if given else "none"
            raise ValueError(f"set exactly one of json, json_object, regex, choice, grammar (found: {found})")
        if self.choice is not None and not self.choice:
            raise ValueError("'choice' must hold at least one string")
        return self
