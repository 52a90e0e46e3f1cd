"""The tool-call parsers on outputs in the formats the models write (Hermes 2 Pro, Qwen 2.5, Qwen 3; Llama
3.1-3.3): the calls and content read from the whole text, and streamed: the same calls and content from the
text cut at arbitrary points, each call's name in its first delta."""
from __future__ import annotations

import json
import random

import pytest

from specserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from specserve.entrypoints.openai.tool_parsers.stream import ToolCallStream

QWEN_PARALLEL = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, '
    'USA", "date": "2024-10-01", "unit": "celsius"}}\n</tool_call>')
# (parser, output, content, [(name, arguments)])
CASES = [
    ("hermes", QWEN_PARALLEL, "", [
        ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
        ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"})]),
    # Qwen 3 thinks first; text before a call is content.
    ("hermes", '<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "days": [1, 2], "q": "a \\"}\\" b"}}\n</tool_call>',
     "<think>\nThe user wants the weather.\n</think>\n\n",
     [("get_weather", {"city": "Paris", "days": [1, 2], "q": 'a "}" b'})]),
    # Hermes 2 Pro writes the arguments before the name.
    ("hermes", '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>',
     "", [("get_stock_fundamentals", {"symbol": "TSLA"})]),
    # Text after the calls is content; the call left open at the end is read without </tool_call>.
    ("hermes", 'Sure.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\nOne more:\n<tool_call>\n'
     '{"name": "b", "arguments": {"x": "é中🚀"}}', "Sure.\n\nOne more:\n", [("a", {}), ("b", {"x": "é中🚀"})]),
    ("hermes", "Paris is sunny today.", "Paris is sunny today.", []),
    # A <tool_call> without a call object is text.
    ("hermes", "Use <tool_call> tags.\n<tool_call>\nnot json\n</tool_call>",
     "Use <tool_call> tags.\n<tool_call>\nnot json\n</tool_call>", []),
    ("llama3_json", '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": '
     '"Fahrenheit"}}', "", [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]),
    ("llama3_json", '<|python_tag|>{"name": "search", "parameters": {"query": "vLLM"}}; {"name": "add", '
     '"arguments": {"a": 1, "b": [2.5, null]}}', "",
     [("search", {"query": "vLLM"}), ("add", {"a": 1, "b": [2.5, None]})]),
    ("llama3_json", ' {"name": "f", "parameters": {}}\nDone.', "Done.", [("f", {})]),
    # An answer that is JSON, or text before JSON, is content.
    ("llama3_json", '{"city": "Paris", "temp": 21}', '{"city": "Paris", "temp": 21}', []),
    ("llama3_json", 'Here: {"name": "f", "parameters": {}}', 'Here: {"name": "f", "parameters": {}}', []),
]
# A call cut off (by max_tokens) is text. Streamed, its name and the arguments written went out before the end.
CUT_OFF = [
    ("hermes", 'Hi <tool_call>\n{"name": "f", "arguments": {"a": ', 'Hi <tool_call>\n{"name": "f", "arguments": {"a": ',
     []),
    ("llama3_json", '{"name": "f", "parameters": {"a": [1, 2', '{"name": "f", "parameters": {"a": [1, 2', []),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES + CUT_OFF, ids=range(len(CASES + CUT_OFF)))
def test_whole_output(parser, text, content, calls):
    parsed = TOOL_PARSERS[parser]().parse(text, final=True)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls


def streamed(parser: str, pieces: list[str], max_calls: int | None = None):
    """Content and calls (id, name, arguments) as a client puts the stream's deltas together."""
    stream = ToolCallStream(TOOL_PARSERS[parser](), max_calls)
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, i == len(pieces) - 1)
        content += delta.content
        for d in delta.calls:
            if d.index not in calls:  # a call's first delta has its id and name
                assert d.index == len(calls) and d.id.startswith("call_") and d.name, d
                calls[d.index] = [d.id, d.name, ""]
            else:
                assert d.id is None and d.name is None, d
            calls[d.index][2] += d.arguments
    return content, list(calls.values()), stream.called


@pytest.mark.parametrize("parser, text, content, calls", CASES, ids=range(len(CASES)))
def test_streamed_at_arbitrary_points(parser, text, content, calls):
    whole = TOOL_PARSERS[parser]().parse(text, final=True)
    cuttings = [list(text), [text]] + [
        [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        for rng in map(random.Random, range(60))
        for cuts in [sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))]]
    for pieces in cuttings:
        got_content, got_calls, called = streamed(parser, pieces)
        assert got_content == whole.content
        assert [(name, arguments) for _, name, arguments in got_calls] == [(c.name, c.arguments) for c in whole.calls]
        assert len({i for i, _, _ in got_calls}) == len(got_calls) and called == bool(calls)


def test_streamed_arguments_grow_as_written():
    """Arguments go out as the model writes them, not at the call's end."""
    stream = ToolCallStream(TOOL_PARSERS["hermes"]())
    first = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', False)
    assert first.content == "" and [(d.name, d.arguments) for d in first.calls] == [("get_weather", '{"city": "Par')]
    assert [d.arguments for d in stream.feed('is"}}\n</tool_', False).calls] == ['is"}']
    assert stream.feed("call>", True).calls == []


def test_one_call_when_parallel_calls_are_off():
    content, calls, _ = streamed("hermes", [QWEN_PARALLEL[:40], QWEN_PARALLEL[40:]], max_calls=1)
    assert [name for _, name, _ in calls] == ["get_current_temperature"] and content == ""
