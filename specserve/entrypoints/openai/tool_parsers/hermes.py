"""Hermes-style calls, as Hermes 2 Pro, Qwen 2.5 and Qwen 3 write them (vLLM's `hermes` parser):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

anywhere in the text, as many as the model writes; text around them is content. A call left open at the
end of the output is read without its </tool_call>; a <tool_call> not followed by a call object is text.
"""
from __future__ import annotations

from specserve.entrypoints.openai.tool_parsers.call_object import CallObject, read_call
from specserve.entrypoints.openai.tool_parsers.parser import (CallSyntax, Segment, ToolParser, opening_length,
                                                              skip_space)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    syntax = CallSyntax(prefix=START + "\n", args_key="arguments", suffix="\n" + END, separator="\n")

    def _segments(self, text: str, final: bool) -> list[Segment]:
        segments: list[Segment] = []
        pos = search = 0  # text[pos:] is not yet in a segment; calls are looked for from search on
        while (i := text.find(START, search)) >= 0:
            search = i + 1
            j = skip_space(text, i + len(START))
            if j == len(text) or text[j] != "{":
                if j == len(text) and not final:  # the call's object is still to come
                    return segments + [text[pos:i], CallObject(None, "", None)]
                continue
            call = read_call(text, j)
            if call is None or (final and not call.complete):
                continue
            if not call.complete:
                return segments + [text[pos:i], call]
            k = skip_space(text, call.end)
            if text.startswith(END, k):
                end = k + len(END)
            elif k == len(text) or (not final and END.startswith(text[k:])):
                end = len(text)  # the output ended without </tool_call>, or it is still being written
            else:
                continue
            segments += [text[pos:i], call]
            pos = search = end
        return segments + [text[pos:]]

    def _held(self, tail: str) -> int:
        return opening_length(tail, START)
