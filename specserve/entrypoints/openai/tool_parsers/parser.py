"""What a tool-call parser is: a model's output text split into plain text (the reply's `content`) and the
calls it wrote, read from the whole text or from a prefix of it while it streams.

A parser turns text into segments, each plain text or a call (call_object.py); the content is the text
segments joined, except that when the output holds calls, segments of white space only (the line breaks
around calls) are not content. Read from a prefix (final=False) it holds back what the rest of the text may
still make part of a call, so what a prefix yields is a prefix of what the whole text yields: the content,
each call's name once it appears, and each call's arguments (stream.py sends the differences).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from specserve.entrypoints.openai.tool_parsers.call_object import CallObject

Segment = str | CallObject


@dataclass(frozen=True)
class CallSyntax:
    """How the model writes a call to `name`: prefix + '{"name": "NAME", "<args_key>": ' + the arguments'
    JSON + '}' + suffix, several calls joined by separator. The grammar of a forced call is built from this
    (tool_choice.py), so what it forces is what the parser reads."""

    prefix: str
    args_key: str
    suffix: str
    separator: str

    def begin(self, name: str) -> str:
        return f'{self.prefix}{{"name": "{name}", "{self.args_key}": '

    @property
    def end(self) -> str:
        return "}" + self.suffix


@dataclass
class ParsedOutput:
    content: str
    calls: list[CallObject]  # read from a prefix, the last may be incomplete


class ToolParser(ABC):
    name: ClassVar[str]  # as --tool-call-parser names it (vLLM's names)
    syntax: ClassVar[CallSyntax]

    def parse(self, text: str, final: bool) -> ParsedOutput:
        """The content and calls of `text`, the whole output (final) or a prefix of it."""
        segments = self._segments(text, final)
        if not final and segments and isinstance(segments[-1], str):
            # The end of the text may open a call, or be white space before one.
            tail = segments[-1][:len(segments[-1]) - self._held(segments[-1])]
            segments[-1] = tail if tail.strip() else ""
        calls = [s for s in segments if isinstance(s, CallObject)]
        texts = [s for s in segments if isinstance(s, str) and (s.strip() or not calls)]
        return ParsedOutput("".join(texts), calls)

    @abstractmethod
    def _segments(self, text: str, final: bool) -> list[Segment]:
        """text as plain text and calls in order; read from a prefix, the last call may be incomplete and
        text that may still turn out to open a call is either left out or held (_held)."""

    def _held(self, tail: str) -> int:
        """How many characters at the end of a prefix's last text segment may begin a call."""
        return 0


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def opening_length(tail: str, marker: str) -> int:
    """The length of the longest end of `tail` that is the start of `marker` (0 if none)."""
    for n in range(min(len(tail), len(marker) - 1), 0, -1):
        if marker.startswith(tail[-n:]):
            return n
    return 0
