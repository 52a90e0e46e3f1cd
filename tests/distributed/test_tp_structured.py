"""Grammar-constrained decoding under tensor parallelism (masks applied on rank 0, which alone samples), with a
draft model (its drafts unmasked, the default, and masked) and n-gram drafts on rank 0: TP=2's greedy outputs equal TP=1's and match their schema."""
from __future__ import annotations

import json

import jsonschema
import pytest

from specserve import LLM, SamplingParams
from tests.heads import save_perturbed_copy

PROMPTS = ["Give me JSON:", "Numbers: 1 2 3", "The quick brown fox"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}}, "required": ["name", "age"],
          "additionalProperties": False}
PARAMS = SamplingParams(temperature=0, max_tokens=96, structured_output={"kind": "json_schema", "value": SCHEMA})


@pytest.fixture(scope="module")
def near(tiny_llama, tmp_path_factory):
    return str(save_perturbed_copy(tmp_path_factory.mktemp("tp-structured") / "near", tiny_llama[0]))


def _texts(path, **kwargs):
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=256, **kwargs)
    try:
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        return [(o.text, o.finish_reason) for o in outs], llm.engine.spec_stats
    finally:
        llm.engine.core.close()


@pytest.mark.parametrize("method, mask_drafts", [("draft_model", None), ("draft_model", True), ("ngram", None)])
def test_tp2_constrained_outputs_equal_tp1(tiny_llama, near, method, mask_drafts):
    spec = {"method": method, "num_speculative_tokens": 3, "mask_drafts": mask_drafts}
    spec.update(model=near) if method == "draft_model" else spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    want, _ = _texts(tiny_llama[0], speculative_config=spec)
    got, stats = _texts(tiny_llama[0], speculative_config=spec, tensor_parallel_size=2)
    assert got == want and stats.num_drafted > 0
    finished = [text for text, reason in got if reason == "stop"]
    assert finished
    for text in finished:
        jsonschema.validate(json.loads(text, strict=False), SCHEMA)
