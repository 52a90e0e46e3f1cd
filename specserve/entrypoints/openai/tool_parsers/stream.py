"""A streamed reply's tool calls as OpenAI deltas: each chunk of text the model wrote goes in, and out come
the new content and, per call, a first delta with its id, name and the arguments written so far, then the
fragments of its arguments that follow. The parser reads the whole text so far each time (parser.py: a
prefix's reading is a prefix of the whole text's), and this sends what is new since the last chunk.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from specserve.entrypoints.openai.tool_parsers.parser import ParsedOutput, ToolParser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallDelta:
    index: int
    arguments: str
    id: str | None = None  # with the name, in a call's first delta only
    name: str | None = None

    def wire(self) -> dict:
        """As OpenAI's chat.completion.chunk writes a tool call delta."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class StreamDelta:
    content: str
    calls: list[CallDelta]


@dataclass
class ToolCallStream:
    parser: ToolParser
    max_calls: int | None = None  # parallel_tool_calls false: 1; calls past it are not sent
    text: str = ""
    parsed: ParsedOutput = field(default_factory=lambda: ParsedOutput("", []))
    _sent_content: int = 0
    _sent_arguments: list[int] = field(default_factory=list)  # per call whose name went out

    def feed(self, text: str, final: bool) -> StreamDelta:
        """The deltas after `text`, the model's next chunk; final: the output ends with it."""
        self.text += text
        self.parsed = self.parser.parse(self.text, final)
        content = self.parsed.content[self._sent_content:]
        self._sent_content = len(self.parsed.content)
        deltas = []
        for index, call in enumerate(self.parsed.calls[:self.max_calls]):
            if call.name is None:
                break  # later calls start after this one
            if index == len(self._sent_arguments):
                deltas.append(CallDelta(index, call.arguments, new_call_id(), call.name))
                self._sent_arguments.append(len(call.arguments))
            elif len(call.arguments) > self._sent_arguments[index]:
                deltas.append(CallDelta(index, call.arguments[self._sent_arguments[index]:]))
                self._sent_arguments[index] = len(call.arguments)
        return StreamDelta(content, deltas)

    @property
    def called(self) -> bool:
        """A call went out: the reply's finish_reason is tool_calls."""
        return bool(self._sent_arguments)
