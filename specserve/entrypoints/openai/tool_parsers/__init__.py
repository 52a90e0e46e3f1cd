"""Tool-call parsers: the calls a model wrote, in the format its chat template taught it, as OpenAI
tool_calls (docs/design.md, 'Tool calling')."""
from specserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from specserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from specserve.entrypoints.openai.tool_parsers.parser import CallSyntax, ParsedOutput, ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}

__all__ = ["TOOL_PARSERS", "CallSyntax", "ParsedOutput", "ToolParser"]
