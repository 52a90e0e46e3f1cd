"""Forced tool calls (tool_choice "required" or a named function): the grammar makes even a random model write
calls in the parser's format whose arguments validate against their tool's JSON schema (jsonschema), for
every object schema of schemas.py and both parsers; and speculation keeps forced calls exact (greedy output
with drafts equals output without)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from heads import save_eagle_head, save_perturbed_copy
from schemas import SCHEMAS
from specserve import LLM, SamplingParams
from specserve.entrypoints.openai.tool_calling import forced_calls
from specserve.entrypoints.openai.tool_fields import FunctionTool
from specserve.entrypoints.openai.tool_parsers import TOOL_PARSERS

OBJECT_SCHEMAS = [s for s in SCHEMAS if s["type"] == "object"]
TOOLS = [FunctionTool(type="function", function={"name": f"tool_{i}", "parameters": s})
         for i, s in enumerate(OBJECT_SCHEMAS)]
PROMPTS = ["Call a tool:", "The quick brown fox"]


@pytest.fixture(scope="module")
def path(tiny_llama):
    return tiny_llama[0]


def calls_of(parser: str, text: str, cut_off: bool = False) -> list[tuple[str, dict]]:
    """The calls in text, all of it calls (but for the last, cut off by max_tokens, if cut_off)."""
    parsed = TOOL_PARSERS[parser]().parse(text, final=True)
    assert cut_off or parsed.content == "", text
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def assert_follow_schemas(calls: list[tuple[str, dict]]) -> None:
    for name, arguments in calls:
        jsonschema.validate(arguments, OBJECT_SCHEMAS[int(name.removeprefix("tool_"))])


def params(grammar, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 200, **kw}, structured_output=grammar)


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_a_named_function_is_called_with_valid_arguments(path, parser):
    llm = LLM(str(path), max_model_len=512)
    syntax = TOOL_PARSERS[parser].syntax
    requests = [(tool, PROMPTS[i % 2], temperature) for i, tool in enumerate(TOOLS) for temperature in (0, 1.0)]
    outs = llm.generate([p for _, p, _ in requests],
                        [params(forced_calls(syntax, [tool], single=True), temperature=t, seed=i)
                         for i, (tool, _, t) in enumerate(requests)], use_tqdm=False)
    for (tool, _, _), out in zip(requests, outs):
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        calls = calls_of(parser, o.text)
        assert [name for name, _ in calls] == [tool.function.name]
        assert_follow_schemas(calls)


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_required_calls_any_tools_each_valid(path, parser):
    llm = LLM(str(path), max_model_len=512)
    syntax = TOOL_PARSERS[parser].syntax
    toolsets = [TOOLS[i:i + 4] for i in range(0, len(TOOLS), 4)]
    for single in (False, True):
        requests = [(tools, seed) for tools in toolsets for seed in range(3)]
        outs = llm.generate([PROMPTS[0]] * len(requests),
                            [params(forced_calls(syntax, tools, single), temperature=1.0, seed=seed)
                             for tools, seed in requests], use_tqdm=False)
        counts = []
        for (tools, _), out in zip(requests, outs):
            o = out.outputs[0]
            # One call ends the output; calls in parallel may go on until max_tokens.
            assert o.finish_reason == "stop" or not single, o.text
            calls = calls_of(parser, o.text, cut_off=o.finish_reason == "length")
            assert calls and {name for name, _ in calls} <= {t.function.name for t in tools}
            assert_follow_schemas(calls)
            counts.append(len(calls))
        assert set(counts) == {1} if single else max(counts) > 1


SPEC_GRAMMARS = [forced_calls(TOOL_PARSERS["hermes"].syntax, TOOLS[i:i + 3], single=False) for i in (0, 6, 12)]
SPEC_PROMPTS = [p for p in PROMPTS for _ in SPEC_GRAMMARS]


@pytest.fixture(scope="module")
def without_speculation(path):
    llm = LLM(str(path), max_model_len=512)
    return [o.outputs[0] for o in llm.generate(SPEC_PROMPTS, [params(g) for _ in PROMPTS for g in SPEC_GRAMMARS],
                                               use_tqdm=False)]


@pytest.mark.parametrize("spec", ["eagle3", "near", "ngram"])
def test_forced_calls_with_speculation_equal_without(path, tiny_llama, tmp_path_factory, without_speculation, spec):
    root = tmp_path_factory.mktemp("tool_spec")
    config = {
        "eagle3": lambda: {"method": "eagle3", "num_speculative_tokens": 3,
                           "model": str(save_eagle_head(root / "eagle3", tiny_llama[1].config, "eagle3", seed=2))},
        "near": lambda: {"method": "draft_model", "num_speculative_tokens": 3,
                         "model": str(save_perturbed_copy(root / "near", path))},
        "ngram": lambda: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                          "prompt_lookup_max": 3},
    }[spec]()
    llm = LLM(str(path), max_model_len=512, speculative_config=config)
    drafted = [o.outputs[0] for o in llm.generate(SPEC_PROMPTS, [params(g) for _ in PROMPTS for g in SPEC_GRAMMARS],
                                                  use_tqdm=False)]
    assert [o.token_ids for o in drafted] == [o.token_ids for o in without_speculation]
    assert llm.engine.spec_stats.num_drafted > 0
    for o in drafted:
        assert_follow_schemas(calls_of("hermes", o.text, cut_off=o.finish_reason == "length"))
