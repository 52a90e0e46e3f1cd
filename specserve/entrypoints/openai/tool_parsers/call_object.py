"""One call as models write it: a JSON object {"name": NAME, "arguments": {...}} ("parameters" for Llama),
read from text that may still be growing (a stream) or is whole.

What must hold for streaming: what is read from a prefix of the text is a prefix of what is read from the
whole text. So the arguments are the object's own text as the model wrote it (never re-serialized) whenever
the name comes first, which is how every template asks for calls; such a call's name is known as soon as its
string closes and its arguments grow with the text. A call written another way (arguments first, say) is read
only once its object is complete, its arguments then re-serialized from the parsed value.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

# The start of a call written name first, up to where its arguments' value begins.
_NAME_FIRST = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
ARGUMENT_KEYS = ("arguments", "parameters")
# A whole string, a bracket, or the opening quote of a string that does not end.
_BRACKET_OR_STRING = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"|[{}\[\]]|"')


@dataclass
class CallObject:
    """A call read from text[start:]: name None until known; arguments: its text so far (all of it once
    complete); end: the index past the object's closing brace, None while the text ends inside it."""

    name: str | None
    arguments: str
    end: int | None

    @property
    def complete(self) -> bool:
        return self.end is not None


def value_end(text: str, start: int) -> int | None:
    """The index past the JSON object or array opening at text[start], None when the text ends first.
    It only balances brackets outside strings (json.loads checks the span), a string at a time: a stream
    reads its text again at every chunk, so this runs in the regex engine, not character by character."""
    depth = 0
    for m in _BRACKET_OR_STRING.finditer(text, start):
        token = m.group()
        if token == '"':
            return None  # a string the text ends inside
        if token in "{[":
            depth += 1
        elif token in "}]":
            depth -= 1
            if depth == 0:
                return m.end()
    return None


def read_call(text: str, start: int) -> CallObject | None:
    """The call whose object opens at text[start] ("{"); None when that object, complete, is not a call (not
    JSON, no string name, arguments that are not an object)."""
    end = value_end(text, start)
    m = _NAME_FIRST.match(text, start)
    name = _string(m.group(1)) if m is not None and text.startswith("{", m.end()) else None
    name_first = name is not None
    if end is None:
        # The name is known once its arguments' value has begun.
        return CallObject(name, text[m.end():] if name_first else "", None)
    try:
        obj = json.loads(text[start:end])
    except json.JSONDecodeError:
        return None
    keys = [k for k in ARGUMENT_KEYS if isinstance(obj, dict) and k in obj]
    if not keys or not isinstance(obj.get("name"), str) or not isinstance(obj[keys[0]], dict):
        return None
    if name_first:
        arguments = text[m.end():value_end(text, m.end())]
    else:
        arguments = json.dumps(obj[keys[0]], ensure_ascii=False)
    return CallObject(obj["name"], arguments, end)


def _string(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except json.JSONDecodeError:  # an escape JSON does not have
        return None
