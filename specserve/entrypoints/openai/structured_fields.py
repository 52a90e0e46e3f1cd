"""The request fields that ask for structured output: OpenAI's response_format (chat) and vLLM's
structured_outputs (both endpoints), each turned into the engine's StructuredOutput. A bad spec is an
InvalidRequestError naming the request's own field, so the 400 points at what the client sent."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve.errors import InvalidRequestError
from specserve.structured_output import StructuredOutput, StructuredOutputKind


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_output(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return _built("response_format", StructuredOutputKind.JSON_OBJECT, None)
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise InvalidRequestError("response_format.json_schema", "a json_schema response format needs "
                                      "json_schema.schema; give the JSON schema the output must follow")
        return _built("response_format.json_schema.schema", StructuredOutputKind.JSON_SCHEMA,
                      self.json_schema.schema_)


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of its fields."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def structured_output(self) -> StructuredOutput:
        given = {name: value for name, value in (("json", self.json_), ("regex", self.regex),
                                                 ("choice", self.choice), ("grammar", self.grammar))
                 if value is not None}
        if self.json_object:
            given["json_object"] = None
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs", "give exactly one of json, json_object, regex, choice "
                                      f"and grammar, got {sorted(given) or 'none'}")
        (name, value), = given.items()
        kind = {"json": StructuredOutputKind.JSON_SCHEMA, "json_object": StructuredOutputKind.JSON_OBJECT,
                "regex": StructuredOutputKind.REGEX, "choice": StructuredOutputKind.CHOICE,
                "grammar": StructuredOutputKind.GRAMMAR}[name]
        return _built(f"structured_outputs.{name}", kind, value)


def _built(field: str, kind: StructuredOutputKind, value) -> StructuredOutput:
    try:
        return StructuredOutput(kind, value)
    except InvalidRequestError as e:
        raise InvalidRequestError(field, str(e).split(": ", 1)[1]) from None
