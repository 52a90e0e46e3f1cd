"""End to end: grammar-constrained outputs match their grammar (20 JSON schemas validated with jsonschema), with
and without speculation, and speculation keeps constrained decoding exact: greedy output equals constrained
output without drafts token for token, and sampled output has the same distribution."""
from __future__ import annotations

import json
from collections import Counter

import jsonschema
import pytest
from scipy.stats import chi2_contingency

from heads import save_eagle_head, save_perturbed_copy
from schemas import SCHEMAS
from specserve import LLM, SamplingParams

PROMPTS = ["Give me JSON:", "Numbers: 1 2 3", "The quick brown fox"]


def schema_params(schema: dict, **kw) -> SamplingParams:
    kw = {"temperature": 0, "max_tokens": 64, **kw}
    return SamplingParams(structured_output={"kind": "json_schema", "value": schema}, **kw)


@pytest.fixture(scope="module")
def models(tiny_llama, tmp_path_factory):
    """The target; a random EAGLE-3 head (drafts mostly ungrammatical and rejected), a perturbed copy of the
    target as a draft model (drafts often accepted) and n-gram drafts."""
    path, hf = tiny_llama
    root = tmp_path_factory.mktemp("structured")
    return {
        "path": path,
        None: None,
        "eagle3": {"method": "eagle3", "num_speculative_tokens": 3,
                   "model": str(save_eagle_head(root / "eagle3", hf.config, "eagle3", seed=2))},
        "near": {"method": "draft_model", "num_speculative_tokens": 3,
                 "model": str(save_perturbed_copy(root / "near", path))},
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    }


def make_llm(models, spec: str | None, **kw) -> LLM:
    return LLM(str(models["path"]), max_model_len=256, speculative_config=models[spec], **kw)


@pytest.fixture(scope="module")
def reference(models):
    """Greedy constrained outputs without speculation: every schema, each with every prompt."""
    llm = make_llm(models, None)
    outs = llm.generate(PROMPTS * 20, [schema_params(s) for s in SCHEMAS for _ in PROMPTS], use_tqdm=False)
    return [o.outputs[0] for o in outs]


def assert_valid(outputs) -> None:
    for i, out in enumerate(outputs):
        schema = SCHEMAS[i // len(PROMPTS)]
        assert out.finish_reason == "stop", (out.text, schema)
        jsonschema.validate(json.loads(out.text), schema)


def test_every_schema_yields_valid_json_without_speculation(reference):
    assert_valid(reference)


@pytest.mark.parametrize("spec", ["eagle3", "near", "ngram"])
def test_greedy_with_speculation_equals_without(models, reference, spec):
    """Small token budget (chunked prefill) and pool (preemption) in the mix; an engine with asynchronous
    scheduling too (it runs steps synchronously while a grammar request runs)."""
    for async_scheduling in (False, True) if spec == "near" else (False,):
        llm = make_llm(models, spec, max_num_batched_tokens=48, num_kv_blocks=24, block_size=16,
                       async_scheduling=async_scheduling)
        outs = [o.outputs[0] for o in llm.generate(PROMPTS * 20, [schema_params(s) for s in SCHEMAS
                                                                  for _ in PROMPTS], use_tqdm=False)]
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
        assert_valid(outs)
        assert llm.engine.spec_stats.num_drafted > 0


def test_requests_without_a_grammar_are_unchanged_beside_grammar_requests(models):
    llm = make_llm(models, "near")
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    mixed = llm.generate(PROMPTS * 2, [free] * 3 + [schema_params(SCHEMAS[i]) for i in range(3)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    assert_valid([o.outputs[0] for o in mixed[3:]][:1])


# Two independent samples of one distribution: p < 1e-4 would be a one-in-ten-thousand event (seeded requests,
# so the test is deterministic).
P_MIN = 1e-4


def sampled_texts(llm: LLM, n: int) -> Counter:
    params = [SamplingParams(temperature=1.0, max_tokens=8, seed=i,
                             structured_output={"kind": "regex", "value": "[a-c]{2}"}) for i in range(n)]
    outs = llm.generate(["Numbers: 1 2 3"] * n, params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    return Counter(o.outputs[0].text for o in outs)


@pytest.mark.parametrize("spec", ["eagle3", "near"])
def test_sampled_distribution_with_speculation_equals_without(models, spec):
    n = 300
    without = sampled_texts(make_llm(models, None), n)
    llm = make_llm(models, spec)
    with_spec = sampled_texts(llm, n)
    assert llm.engine.spec_stats.num_drafted > 0
    outcomes = sorted(set(without) | set(with_spec))
    assert set(outcomes) <= {a + b for a in "abc" for b in "abc"}
    table = [[without[o] for o in outcomes], [with_spec[o] for o in outcomes]]
    assert chi2_contingency(table).pvalue > P_MIN, table
