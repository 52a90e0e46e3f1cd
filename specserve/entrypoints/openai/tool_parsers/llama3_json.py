"""Llama 3.1 / 3.2 / 3.3 JSON calls (vLLM's `llama3_json` parser): the output is one or more call objects,
optionally after <|python_tag|>, separated by ";":

    {"name": "get_weather", "parameters": {"city": "Paris"}}

("arguments" is read as "parameters"). Calls open the output: text that does not start with a call object
is all content, as is an output whose first object is not a call (an answer that is JSON). Text after the
calls is content.
"""
from __future__ import annotations

from specserve.entrypoints.openai.tool_parsers.call_object import read_call
from specserve.entrypoints.openai.tool_parsers.parser import CallSyntax, Segment, ToolParser, skip_space

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    syntax = CallSyntax(prefix="", args_key="parameters", suffix="", separator="; ")

    def _segments(self, text: str, final: bool) -> list[Segment]:
        pos = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos = skip_space(text, pos + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[pos:]):
            return []  # nothing but white space, or the tag's start: undecided
        calls: list[Segment] = []
        while pos < len(text) and text[pos] == "{":
            call = read_call(text, pos)
            if call is None or (final and not call.complete):
                break
            if not call.complete:
                # A first object whose name is not yet known may still be a JSON answer: undecided.
                return calls + [call] if calls or call.name is not None else []
            calls.append(call)
            pos = skip_space(text, call.end)
            if text.startswith(";", pos):
                pos = skip_space(text, pos + 1)
        if not calls:
            return [text] if final or pos < len(text) else []
        return calls + [text[pos:]]
