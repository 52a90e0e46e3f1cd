"""End to end: grammar-constrained outputs match their grammar (20 JSON schemas validated with jsonschema), with
and without speculation (chains and trees of drafts, the drafter's logits masked by the grammar or not), and
speculation keeps constrained decoding exact: greedy output equals constrained output without drafts token for
token, and sampled output has the same distribution."""
from __future__ import annotations

import json
from collections import Counter

import jsonschema
import pytest
from scipy.stats import chi2_contingency

from heads import save_eagle_head, save_perturbed_copy
from schemas import SCHEMAS
from specserve import LLM, SamplingParams
from specserve.errors import ConfigError
from specserve.spec_decode.config import SpeculativeConfig
from step_overlap import record_overlap

PROMPTS = ["Give me JSON:", "Numbers: 1 2 3", "The quick brown fox"]
TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


def schema_params(schema: dict, **kw) -> SamplingParams:
    kw = {"temperature": 0, "max_tokens": 64, **kw}
    return SamplingParams(structured_output={"kind": "json_schema", "value": schema}, **kw)


@pytest.fixture(scope="module")
def models(tiny_llama, tmp_path_factory):
    """The target; a random EAGLE-3 head, as a chain and as a tree, its drafts unmasked (the default: drafts the
    grammar refuses reach the verification) or masked by the grammar (grammatical but often not the target's); a
    perturbed copy of the target as a draft model (drafts often accepted), unmasked and masked; n-gram drafts (never
    masked)."""
    path, hf = tiny_llama
    root = tmp_path_factory.mktemp("structured")
    head = str(save_eagle_head(root / "eagle3", hf.config, "eagle3", seed=2))
    specs = {
        "eagle3": {"method": "eagle3", "num_speculative_tokens": 3, "model": head},
        "eagle3_tree": {"method": "eagle3", "model": head, "speculative_token_tree": TREE},
        "near": {"method": "draft_model", "num_speculative_tokens": 3,
                 "model": str(save_perturbed_copy(root / "near", path))},
    }
    return {"path": path, None: None, **specs, **{f"{name}_masked": spec | {"mask_drafts": True}
                                                  for name, spec in specs.items()},
            "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}}


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


@pytest.mark.parametrize("spec", ["eagle3", "eagle3_masked", "eagle3_tree", "eagle3_tree_masked", "near",
                                  "near_masked", "ngram"])
def test_greedy_with_speculation_equals_without(models, reference, spec):
    """Small token budget (chunked prefill) and pool (preemption) in the mix; with asynchronous scheduling too,
    where each step's masks wait for the step before it only once its forward is launched."""
    for async_scheduling in (False, True) if spec != "ngram" else (False,):
        llm = make_llm(models, spec, max_num_batched_tokens=48, num_kv_blocks=24, block_size=16,
                       async_scheduling=async_scheduling)
        overlapped = record_overlap(llm)
        outs = [o.outputs[0] for o in llm.generate(PROMPTS * 20, [schema_params(s) for s in SCHEMAS
                                                                  for _ in PROMPTS], use_tqdm=False)]
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
        if async_scheduling:
            assert sum(overlapped) > len(overlapped) // 2
        assert_valid(outs)
        assert llm.engine.spec_stats.num_drafted > 0


def test_unmasked_drafts_draft_what_the_grammar_refuses_and_masked_ones_never_do(models):
    """With a random head the unmasked drafts (the default) are mostly ones the grammar refuses, so fewer are
    accepted than of the masked drafts, which the grammar allows (the same outputs:
    test_greedy_with_speculation_equals_without)."""
    accepted = {}
    for spec in ("eagle3", "eagle3_masked"):
        llm = make_llm(models, spec)
        llm.generate(PROMPTS, [schema_params(SCHEMAS[0])] * len(PROMPTS), use_tqdm=False)
        stats = llm.engine.spec_stats
        accepted[spec] = stats.num_accepted / stats.num_drafted
    assert accepted["eagle3"] < accepted["eagle3_masked"], accepted


def test_drafts_are_unmasked_by_default_but_under_forced_acceptance(models):
    """Forced acceptance accepts a draft whatever the target's masked logits say, so its drafts must be ones the
    grammar allows."""
    def masks(**extra) -> bool:
        return SpeculativeConfig.parse({**models["eagle3"], **extra}).masks_drafts

    assert not masks() and masks(mask_drafts=True) and masks(forced_acceptance_prob=0.5)
    assert masks(forced_acceptance_prob=0.5, mask_drafts=True) and not masks(mask_drafts=False)
    assert not SpeculativeConfig.parse(models["ngram"]).masks_drafts


@pytest.mark.parametrize("extra,why", [
    ({"method": "ngram", "prompt_lookup_min": 1, "mask_drafts": True}, "never masked"),
    ({"mask_drafts": False, "forced_acceptance_prob": 0.5}, "drop one of the two"),
    ({"mask_drafts": "no"}, "true or false"),
])
def test_mask_drafts_it_cannot_honour_is_a_config_error(models, extra, why):
    fields = {"method": "eagle3", "num_speculative_tokens": 3, "model": models["eagle3"]["model"], **extra}
    with pytest.raises(ConfigError, match=why) as e:
        SpeculativeConfig.parse(fields)
    assert e.value.field == "speculative_config.mask_drafts"


@pytest.mark.parametrize("spec", ["near_masked", "eagle3_tree_masked", "eagle3_tree"])
def test_requests_without_a_grammar_are_unchanged_beside_grammar_requests(models, spec):
    llm = make_llm(models, spec)
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    mixed = llm.generate(PROMPTS * 2, [free] * 3 + [schema_params(SCHEMAS[i]) for i in range(3)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    assert_valid([o.outputs[0] for o in mixed[3:]][:1])


# Two independent samples of one distribution: p < 1e-4 would be a one-in-ten-thousand event (seeded requests,
# so the test is deterministic).
P_MIN = 1e-4


LETTERS = "abcde"
LENGTH = 3


def sampled_texts(llm: LLM, n: int) -> list[str]:
    """At a low temperature the target and a drafter each favour letters of their own, so a draft distribution
    given to the rejection sampler other than the one the drafts were drawn from (the drafter's unmasked q)
    moves the output towards the drafter's favourites: far from the target's."""
    params = [SamplingParams(temperature=0.3, max_tokens=8, seed=i,
                             structured_output={"kind": "regex", "value": f"[{LETTERS[0]}-{LETTERS[-1]}]{{{LENGTH}}}"})
              for i in range(n)]
    outs = llm.generate(["Numbers: 1 2 3"] * n, params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    texts = [o.outputs[0].text for o in outs]
    assert all(len(t) == LENGTH and set(t) <= set(LETTERS) for t in texts), texts
    return texts


@pytest.mark.parametrize("spec", ["eagle3", "eagle3_masked", "eagle3_tree", "eagle3_tree_masked", "near_masked"])
def test_sampled_distribution_with_speculation_equals_without(models, reference_samples, spec):
    """The letter at each position, with speculation against without (the later ones are drafted)."""
    llm = make_llm(models, spec)
    with_spec = sampled_texts(llm, len(reference_samples))
    assert llm.engine.spec_stats.num_accepted > 0
    for position in range(LENGTH):
        without = Counter(t[position] for t in reference_samples)
        spec_counts = Counter(t[position] for t in with_spec)
        seen = sorted(set(without) | set(spec_counts))
        table = [[without[c] for c in seen], [spec_counts[c] for c in seen]]
        assert chi2_contingency(table).pvalue > P_MIN / LENGTH, (position, table)


@pytest.fixture(scope="module")
def reference_samples(models) -> list[str]:
    return sampled_texts(make_llm(models, None), 300)
