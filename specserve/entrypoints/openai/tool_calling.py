"""Tool calling on /v1/chat/completions (docs/design.md, 'Tool calling'): what a request's tools,
tool_choice and parallel_tool_calls ask for, as a ToolPlan.

- "none": the model sees no tools (they are not passed to the chat template) and writes text;
- "auto" (the default when tools are given): the template shows the tools, the model writes freely, and the
  server's parser (--tool-call-parser) reads the calls it wrote; it needs --enable-auto-tool-choice, as vLLM;
- "required" or a named function: as "auto", and a grammar (an xgrammar structural tag) forces the output to
  be calls in the parser's format, each call's arguments following its tool's JSON schema. It runs as any
  structured output does, with speculation too (docs/design.md, 'Structured output').

parallel_tool_calls false allows one call: the grammar of a forced choice ends after it; under "auto" only
the first call the model wrote is returned, the calls after it are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

from specserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from specserve.entrypoints.openai.tool_fields import FunctionTool, NamedToolChoice
from specserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, CallSyntax, ToolParser
from specserve.errors import InvalidRequestError
from specserve.structured_output import StructuredOutput, StructuredOutputKind
from specserve.structured_output.spec import JSON_LAYOUT

# A function without parameters takes none (OpenAI: "omitting parameters defines a function with an empty
# parameter list").
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolCallingConfig:
    """The server's side of tool calling."""

    parser: str | None = None  # --tool-call-parser: the format the model writes calls in
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice: tool_choice "auto" is allowed

    def __post_init__(self) -> None:
        if self.parser is not None and self.parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {self.parser!r}")
        if self.enable_auto_tool_choice and self.parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser), the format "
                             "of the calls to read")


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict] | None  # what the chat template is given as `tools`
    parser: ToolParser | None  # reads the calls in the output; None: the output is all content
    forced_calls: StructuredOutput | None  # the grammar of required or named calls
    max_calls: int | None  # parallel_tool_calls false: 1


NO_TOOLS = ToolPlan(None, None, None, None)


def plan_tools(body: ChatCompletionRequest, config: ToolCallingConfig) -> ToolPlan:
    """The request's ToolPlan; InvalidRequestError naming the field for what cannot be honoured."""
    _check_results_answer_calls(body.messages)
    if body.tools is None:
        if body.tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice", "needs tools to choose from; give tools, or remove tool_choice")
        if body.parallel_tool_calls is not None:
            raise InvalidRequestError("parallel_tool_calls", "is only allowed with tools; give tools, or remove it")
        return NO_TOOLS
    _check_tools(body.tools)
    choice = body.tool_choice or "auto"
    if choice == "none":
        return NO_TOOLS
    for field in ("response_format", "structured_outputs"):
        if getattr(body, field) is not None:
            raise InvalidRequestError(field, 'cannot be combined with tools unless tool_choice is "none": the '
                                      "output is either tool calls or the format; remove one of them")
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    max_calls = 1 if body.parallel_tool_calls is False else None
    if choice == "auto":
        if not config.enable_auto_tool_choice:
            raise InvalidRequestError("tool_choice", '"auto" (the default when tools are given) needs the server '
                                      "started with --enable-auto-tool-choice and --tool-call-parser; start it so, "
                                      'or send tool_choice "none", "required" or a named function')
        return ToolPlan(tools, TOOL_PARSERS[config.parser](), None, max_calls)
    shown = f'"{choice}"' if isinstance(choice, str) else "a named function"
    if config.parser is None:
        raise InvalidRequestError("tool_choice", f"{shown} needs the server started with --tool-call-parser "
                                  f"({' or '.join(sorted(TOOL_PARSERS))}), the format the model writes calls in")
    parser = TOOL_PARSERS[config.parser]()
    callable_tools = body.tools
    if isinstance(choice, NamedToolChoice):
        callable_tools = [t for t in body.tools if t.function.name == choice.function.name]
        if not callable_tools:
            names = ", ".join(t.function.name for t in body.tools)
            raise InvalidRequestError("tool_choice.function.name", f"{choice.function.name!r} is no tool of tools "
                                      f"({names}); name one of them, or add it to tools")
        max_calls = 1
    return ToolPlan(tools, parser, forced_calls(parser.syntax, callable_tools, max_calls == 1), max_calls)


def forced_calls(syntax: CallSyntax, tools: list[FunctionTool], single: bool) -> StructuredOutput:
    """The grammar of an output made of calls to `tools` written as `syntax` says, at least one (exactly one
    if single), each call's arguments following its tool's parameters."""
    from xgrammar.structural_tag import JSONSchemaFormat, StructuralTag, TagFormat, TagsWithSeparatorFormat

    tags = [TagFormat(begin=syntax.begin(t.function.name), end=syntax.end,
                      content=JSONSchemaFormat(json_schema=_parameters(t),
                                               max_whitespace_cnt=JSON_LAYOUT["max_whitespace_cnt"]))
            for t in tools]
    calls = (tags[0] if single and len(tags) == 1 else
             TagsWithSeparatorFormat(tags=tags, separator=syntax.separator, at_least_one=True, stop_after_first=single))
    return StructuredOutput(StructuredOutputKind.STRUCTURAL_TAG, StructuralTag(format=calls).model_dump(mode="json"))


def _parameters(tool: FunctionTool) -> dict:
    return NO_PARAMETERS if tool.function.parameters is None else tool.function.parameters


def _check_tools(tools: list[FunctionTool]) -> None:
    seen = set()
    for i, t in enumerate(tools):
        if t.function.name in seen:
            raise InvalidRequestError(f"tools[{i}].function.name", f"{t.function.name!r} names two tools; give each "
                                      "tool a name of its own")
        seen.add(t.function.name)
        try:
            StructuredOutput(StructuredOutputKind.JSON_SCHEMA, _parameters(t))
        except InvalidRequestError as e:
            raise InvalidRequestError(f"tools[{i}].function.parameters", str(e).split(": ", 1)[1]) from None


def _check_results_answer_calls(messages: list[ChatMessage]) -> None:
    called: set[str] = set()
    for i, m in enumerate(messages):
        called.update(c.id for c in m.tool_calls or ())
        if m.role == "tool" and m.tool_call_id is not None and m.tool_call_id not in called:
            raise InvalidRequestError(f"messages[{i}].tool_call_id", f"{m.tool_call_id!r} matches no tool call of an "
                                      "earlier assistant message; give the id of the call whose result this is")
