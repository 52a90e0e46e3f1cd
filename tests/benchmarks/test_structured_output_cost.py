"""benchmarks/structured_output_cost.py's random head: a shape's --spec with model "random" drafts under a grammar
with a random EAGLE-3 head of the shape's size, its acceptance forced."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from structured_output_cost import SCHEMA, engine_source, spec_label, speculative_config  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.structured_output.spec import StructuredOutput, StructuredOutputKind  # noqa: E402

SPEC = {"method": "eagle3", "model": "random", "num_speculative_tokens": 3, "forced_acceptance_prob": 0.8}


def test_a_shape_drafts_under_the_schema_with_a_random_head(tokenizer_dir):
    model, extra = engine_source("tiny", str(tokenizer_dir))
    spec = speculative_config(SPEC, "tiny", model)
    head = json.loads((Path(spec["model"]) / "config.json").read_text())
    target = json.loads((Path(model) / "config.json").read_text())
    assert head["hidden_size"] == target["hidden_size"] and head["vocab_size"] == target["vocab_size"]
    assert spec_label(spec) == "eagle3 k=3 forced p=0.8"
    llm = LLM(model, device="cpu", dtype="float32", max_model_len=256, speculative_config=spec, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=24,
                            structured_output=StructuredOutput(StructuredOutputKind.JSON_SCHEMA, SCHEMA))
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    stats = llm.engine.spec_stats
    assert len(out.token_ids) == 24 and "".join(out.text.split()).startswith('{"answers":[{"topic')
    assert stats.num_accepted > 0 and stats.num_accepted <= stats.num_drafted


def test_a_random_head_is_refused_for_a_model_with_weights(tiny_llama):
    with pytest.raises(SystemExit, match="random head for a shape"):
        speculative_config(SPEC, str(tiny_llama[0]), str(tiny_llama[0]))
