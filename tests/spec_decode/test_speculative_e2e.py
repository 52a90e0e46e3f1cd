"""End to end: speculative decoding is lossless, for every speculator, with batching, chunking,
prefix caching and preemption in the mix."""
from __future__ import annotations


import pytest

from conftest import make_hf_model, repetitive_prompts as prompts
from heads import save_eagle_head
from specserve import LLM, ConfigError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tiny_llama):
    path, hf = tiny_llama
    ps = prompts(hf.config.vocab_size)
    llm = LLM(str(path), max_model_len=256)
    ref = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    return path, hf, ps, ref


@pytest.fixture(scope="module")
def spec_models(tmp_path_factory, tiny_llama, tokenizer_dir):
    _, hf = tiny_llama
    root = tmp_path_factory.mktemp("spec")
    draft = root / "draft"
    make_hf_model(draft, tokenizer_dir, "llama", seed=7, num_hidden_layers=1)
    return {
        "eagle": save_eagle_head(root / "eagle", hf.config, "eagle", seed=1),
        "eagle3": save_eagle_head(root / "eagle3", hf.config, "eagle3", seed=2),
        "draft_model": draft,
    }


def spec_config(method: str, k: int, spec_models) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return {"method": method, "num_speculative_tokens": k, "model": str(spec_models[method])}


def run_mixed(path, cfg: dict, ps: list[list[int]], **engine) -> list:
    """The prompts as one batch after a warm-up of the first two (so later ones hit the prefix cache),
    with a small token budget (chunked prefill) and a small KV pool (preemption)."""
    llm = LLM(str(path), max_model_len=256, speculative_config=cfg, max_num_batched_tokens=48,
              num_kv_blocks=17, block_size=16, **engine)
    llm.generate(ps[:2], GREEDY, use_tqdm=False)
    return llm, llm.generate(ps, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "eagle", "eagle3", "draft_model"])
def test_greedy_equals_no_speculation(target, spec_models, method, k):
    path, _, ps, ref = target
    llm, outs = run_mixed(path, spec_config(method, k, spec_models), ps)
    assert [o.outputs[0].token_ids for o in outs] == ref
    stats = llm.engine.spec_stats
    assert stats.num_drafted > 0
    assert sum(o.metrics.num_cached_tokens for o in outs) > 0, "no prefix-cache hit in the mix"
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "no preemption in the mix"
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_target_as_its_own_draft_accepts_everything(target):
    path, _, ps, ref = target
    llm = LLM(str(path), max_model_len=256,
              speculative_config={"method": "draft_model", "model": str(path), "num_speculative_tokens": 4})
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    stats = llm.engine.spec_stats
    assert stats.num_drafted > 0 and stats.acceptance_rate == 1.0
    assert outs[0].metrics.spec["acceptance_rate"] == 1.0


def test_a_prompt_longer_than_a_steps_budget_is_all_in_the_drafters_cache(target):
    """The chunks of a long prompt that yield no token run the drafter's prefill alone (Drafting.PREFILL_ONLY), so
    the target drafting for itself still accepts every draft."""
    path, _, ps, _ = target
    long = [t for p in ps[:4] for t in p]
    want = LLM(str(path), max_model_len=256).generate([long], GREEDY, use_tqdm=False)[0].outputs[0]
    llm = LLM(str(path), max_model_len=256, max_num_seqs=1, max_num_batched_tokens=16,
              speculative_config={"method": "draft_model", "model": str(path), "num_speculative_tokens": 4})
    out = llm.generate([long], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(long) > 3 * 16 and out.token_ids == want.token_ids
    stats = llm.engine.spec_stats
    assert stats.num_drafted > 0 and stats.acceptance_rate == 1.0


def test_stop_string_inside_accepted_drafts(target):
    path, _, ps, _ = target
    plain = LLM(str(path), max_model_len=256)
    full = plain.generate([ps[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    text = full.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop and stop.strip(), f"pick a visible stop string from {text!r}"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    want = plain.generate([ps[0]], params, use_tqdm=False)[0].outputs[0]
    spec = LLM(str(path), max_model_len=256,
               speculative_config={"method": "draft_model", "model": str(path), "num_speculative_tokens": 5})
    got = spec.generate([ps[0]], params, use_tqdm=False)[0].outputs[0]
    assert spec.engine.spec_stats.num_accepted > 0
    assert got.text == want.text == text[: text.index(stop)]
    assert got.token_ids == want.token_ids and got.finish_reason == "stop" and got.stop_reason == stop


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model"])
def test_sampling_with_a_model_drafter_is_seeded_and_runs(target, spec_models, method):
    path, _, ps, _ = target
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=12, seed=1234)
    llm = LLM(str(path), max_model_len=256, speculative_config=spec_config(method, 3, spec_models))
    a = llm.generate(ps[:3], params, use_tqdm=False)
    b = llm.generate(ps[:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert llm.engine.spec_stats.num_drafted > 0


@pytest.mark.parametrize("cfg,field", [
    ({"method": "medusa", "num_speculative_tokens": 3}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 1000}, "speculative_config.num_speculative_tokens"),
    ({"method": "eagle3", "num_speculative_tokens": 3}, "speculative_config.model"),
    ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "speculative_config.lookahead"),
    ('{"method": "ngram",', "speculative_config"),
])
def test_bad_speculative_config(target, cfg, field):
    with pytest.raises(ConfigError) as e:
        LLM(str(target[0]), max_model_len=256, speculative_config=cfg)
    assert e.value.field == field


def test_head_that_does_not_fit_names_both_sizes(target, tmp_path):
    path, hf, _, _ = target
    head = save_eagle_head(tmp_path / "wide", hf.config, "eagle", hidden=hf.config.hidden_size * 2)
    with pytest.raises(ConfigError, match=rf"hidden size {hf.config.hidden_size * 2} .* {hf.config.hidden_size}"):
        LLM(str(path), max_model_len=256,
            speculative_config={"method": "eagle", "model": str(head), "num_speculative_tokens": 3})


def test_penalized_request_beside_speculating_ones_keeps_its_penalties(target):
    path, _, ps, ref = target
    penalized = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8,
                               frequency_penalty=1.0)
    plain = LLM(str(path), max_model_len=256)
    want = plain.generate([ps[0]], penalized, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(str(path), max_model_len=256,
              speculative_config={"method": "draft_model", "model": str(path), "num_speculative_tokens": 3})
    outs = llm.generate(ps[:4], [penalized] + [GREEDY] * 3, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == want
    assert [o.outputs[0].token_ids for o in outs[1:]] == ref[1:4]
    assert llm.engine.spec_stats.num_drafted > 0
