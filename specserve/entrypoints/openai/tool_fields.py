"""The request fields of tool calling, in OpenAI's shapes: `tools` (function tools), a named `tool_choice`,
and the `tool_calls` of assistant messages. Types only; what they mean together is tool_calling.py's."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve.entrypoints.openai.unicode_text import Text


class _Field(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Field):
    # OpenAI's rule for names; it also keeps a name a plain JSON string inside the call a grammar forces.
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: dict[Text, Any] | None = None  # a JSON schema; none: the function takes no arguments
    strict: bool | None = None  # a forced call always follows the schema here, strict or not


class FunctionTool(_Field):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(_Field):
    name: Text


class NamedToolChoice(_Field):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Field):
    name: Text
    arguments: Text  # the arguments' JSON object, as text


class MessageToolCall(_Field):
    id: Text
    type: Literal["function"]
    function: CalledFunction
