"""Asynchronous scheduling: step N+1 is scheduled and launched before step N's results are read, and
every output is the same as with synchronous scheduling (greedy, seeded sampling, logprobs, stops,
penalties), with drafts accepted, partly accepted and rejected, chunked prefill, prefix hits,
preemption and aborts in the mix."""
from __future__ import annotations

import pytest

from conftest import repetitive_prompts as prompts
from heads import save_eagle_head, save_perturbed_copy
from step_overlap import record_overlap
from specserve import LLM, ConfigError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tiny_llama, tmp_path_factory):
    """The target, a random EAGLE-3 head (drafts mostly rejected) and a perturbed copy of the target as
    draft model (drafts partly accepted)."""
    path, hf = tiny_llama
    root = tmp_path_factory.mktemp("async")
    return {
        "path": path,
        "vocab": hf.config.vocab_size,
        "eagle3": {"method": "eagle3", "num_speculative_tokens": 3,
                   "model": str(save_eagle_head(root / "eagle3", hf.config, "eagle3", seed=2))},
        "near": {"method": "draft_model", "num_speculative_tokens": 3,
                 "model": str(save_perturbed_copy(root / "near", path))},
        "self": {"method": "draft_model", "num_speculative_tokens": 4, "model": str(path)},
    }


def mixed_llm(models, async_scheduling: bool, spec: str | None, **kw) -> LLM:
    """A small token budget (chunked prefill) and a small KV pool (preemption)."""
    return LLM(str(models["path"]), max_model_len=256, max_num_batched_tokens=48, num_kv_blocks=17, block_size=16,
               speculative_config=models[spec] if spec else None, async_scheduling=async_scheduling, **kw)


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("spec", [None, "eagle3", "near", "self"])
def test_greedy_output_equals_synchronous_scheduling(models, spec):
    ps = prompts(models["vocab"])
    results = {}
    for async_ in (False, True):
        llm = mixed_llm(models, async_, spec)
        llm.generate(ps[:2], GREEDY, use_tqdm=False)  # later prompts hit the prefix cache
        log = record_overlap(llm)
        outs = llm.generate(ps, GREEDY, use_tqdm=False)
        results[async_] = token_ids(outs)
        engine = llm.engine
        if spec != "self":  # accepting every draft, requests finish before the pool runs short
            assert sum(o.metrics.num_preemptions for o in outs) > 0, "no preemption in the mix"
        assert sum(o.metrics.num_cached_tokens for o in outs) > 0, "no prefix-cache hit in the mix"
        assert engine.kv.pool.num_free == engine.kv.num_blocks
        # Rows still held belong to finished requests whose release goes out with the next step.
        assert set(engine.runner.rows) <= set(engine.scheduler._finished_ids)
        if async_:
            assert sum(log) > len(log) // 2, f"steps rarely overlapped: {log}"
        else:
            assert not any(log)
        if spec in ("near", "self"):
            stats = engine.spec_stats
            assert 0 < stats.num_accepted <= stats.num_drafted
            if spec == "near":
                assert stats.num_accepted < stats.num_drafted, "the perturbed draft should miss sometimes"
    assert results[True] == results[False]


def test_stops_lengths_penalties_and_logprobs_match(models):
    ps = prompts(models["vocab"], n=8, seed=4)
    # A stop token and a stop string the greedy continuations do reach.
    plain = [o.outputs[0] for o in mixed_llm(models, False, None).generate(ps, GREEDY, use_tqdm=False)]
    stop_token = plain[1].token_ids[5]
    stop_text = max((o.text.strip() for o in plain[2:]), key=len)[-2:]
    params = [
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.9, seed=11, max_tokens=20),
        SamplingParams(temperature=0.7, top_p=0.9, seed=12, max_tokens=20, logprobs=2),
        SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=6, logprobs=1),
        SamplingParams(temperature=1.0, seed=13, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=30, stop=[stop_text]),
    ]
    # The stop string's request is the greedy one whose text holds it.
    holder = next(i for i, o in enumerate(plain) if i >= 2 and stop_text in o.text)
    ps[7] = ps[holder]
    for spec in (None, "near"):
        got = {}
        for async_ in (False, True):
            outs = mixed_llm(models, async_, spec).generate(ps, params, use_tqdm=False)
            got[async_] = [o.outputs[0] for o in outs]
        for a, b in zip(got[False], got[True]):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), spec
            # Batches differ in shape (requests that need their tokens on the host skip a step), so
            # logprobs may differ in float32 rounding only; tokens and ranks not at all.
            assert (a.logprobs is None) == (b.logprobs is None)
            for x, y in zip(a.logprobs or [], b.logprobs or []):
                assert {t: lp.rank for t, lp in x.items()} == {t: lp.rank for t, lp in y.items()}
                assert all(abs(x[t].logprob - y[t].logprob) < 1e-5 for t in x)
        assert got[True][1].finish_reason == got[True][7].finish_reason == "stop"
        assert sum(o.logprobs is not None for o in got[True]) == 2


def test_abort_while_in_flight_leaves_the_others_unchanged(models):
    ps = prompts(models["vocab"], n=4, seed=9)
    expected = token_ids(mixed_llm(models, False, "near").generate(ps, GREEDY, use_tqdm=False))
    llm = mixed_llm(models, True, "near")
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in ps]
    final = {}
    for _ in range(6):
        for out in engine.step():
            final[out.request_id] = out
    assert engine.core._inflight is not None
    in_flight = [s.request.request_id for s in engine.core._inflight.sched.scheduled]
    victim = next(i for i in ids[1:] if i in in_flight)
    assert engine.abort_request(victim)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != victim
            if out.finished:
                final[out.request_id] = out
    for rid, want in zip(ids, expected):
        if rid != victim:
            assert final[rid].outputs[0].token_ids == want
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_configuration_is_checked(models):
    with pytest.raises(ConfigError, match="async_scheduling"):
        LLM(str(models["path"]), async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    llm = LLM(str(models["path"]), speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert llm.engine.config.async_scheduling is False
    assert LLM(str(models["path"])).engine.config.async_scheduling is False  # CPU: off unless asked

