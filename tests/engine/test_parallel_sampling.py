"""n > 1: a request's n sequences share its prompt's KV blocks, each is sampled on its own (reproducibly with a
seed), greedy ones equal transformers' greedy output, and the sampled ones are distributed as the model's
softmax computed by transformers, with and without EAGLE-3 speculation."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from conftest import hf_greedy
from distribution import drafted_tokens, first_two_tokens_test
from heads import save_eagle_head
from specserve import LLM, SamplingParams
from specserve.engine.request_stream import RequestStream
from specserve.errors import InvalidRequestError
from specserve.sampling_params import RequestOutputKind

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "Paged attention stores keys and values in fixed-size blocks."]


@pytest.fixture(scope="module")
def models(tiny_llama, tmp_path_factory):
    path, hf = tiny_llama
    head = save_eagle_head(tmp_path_factory.mktemp("nseq") / "eagle3", hf.config, "eagle3", seed=2)
    return {"path": path, "hf": hf, None: None,
            "eagle3": {"method": "eagle3", "num_speculative_tokens": 3, "model": str(head)}}


def make_llm(models, spec: str | None, **kw) -> LLM:
    return LLM(str(models["path"]), max_model_len=256, speculative_config=models[spec], **kw)


def core_ids(llm: LLM, request_id: str) -> list[str]:
    return [s.core_request_id for s in llm.engine.processor.requests[request_id].sequences]


@pytest.mark.parametrize("spec", [None, "eagle3"])
def test_greedy_sequences_are_transformers_greedy_output(models, spec):
    llm = make_llm(models, spec)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = llm.generate(PROMPTS, greedy, use_tqdm=False)
    four = llm.generate(PROMPTS, replace(greedy, n=4), use_tqdm=False)
    for prompt, single, several in zip(PROMPTS, one, four):
        expected = hf_greedy(models["hf"], llm.tokenizer.encode(prompt), 12)
        assert single.outputs[0].token_ids == expected
        assert [c.index for c in several.outputs] == [0, 1, 2, 3]
        assert all((c.token_ids, c.text) == (expected, single.outputs[0].text) for c in several.outputs)
        assert several.metrics.num_output_tokens == 48 and several.metrics.num_prompt_tokens == len(single.prompt_token_ids)


def test_later_sequences_take_the_first_ones_prompt_blocks(models):
    llm = make_llm(models, None, block_size=16)
    engine = llm.engine
    prompt = list(range(3, 43))  # two full blocks and 8 tokens
    rid = engine.add_request(prompt, SamplingParams(n=4, max_tokens=6, ignore_eos=True))
    ids = core_ids(llm, rid)
    engine.step()  # admits all four: the first registers the full blocks as it allocates them, the others find them
    tables = [engine.kv.block_ids(i) for i in ids]
    assert all(t[:2] == tables[0][:2] for t in tables) and len({t[2] for t in tables}) == 4
    assert all(engine.kv.pool.blocks[b].ref_cnt == 4 for b in tables[0][:2])
    requests = [engine.scheduler.requests[i] for i in ids]
    assert [r.num_cached_tokens for r in requests] == [0, 32, 32, 32]
    assert [r.num_model_tokens for r in requests] == [40, 8, 8, 8]
    assert engine.kv.pool.hits == 3 * 32
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.usage == 0


def test_a_prompt_longer_than_the_token_budget_is_shared_whole(models):
    """The first sequence's prompt takes several steps; the budget it uses up keeps the others waiting until
    its last chunk is scheduled, so they find every full block of it."""
    llm = make_llm(models, None, block_size=16, max_num_batched_tokens=32)
    engine = llm.engine
    rid = engine.add_request(list(range(3, 73)), SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    ids = core_ids(llm, rid)
    for _ in range(3):
        engine.step()
    requests = [engine.scheduler.requests[i] for i in ids]
    assert [r.num_cached_tokens for r in requests] == [0, 64, 64]
    assert [r.num_model_tokens for r in requests] == [70, 6, 6]


@pytest.mark.parametrize("spec", [None, "eagle3"])
def test_seeded_sequences_are_reproducible_and_distinct(models, spec):
    llm = make_llm(models, spec)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    other = SamplingParams(n=3, temperature=0.8, max_tokens=10, ignore_eos=True)
    batched = llm.generate([PROMPTS[1], PROMPTS[0]], [other, params], use_tqdm=False)[1]
    tokens = [c.token_ids for c in alone.outputs]
    assert [c.token_ids for c in batched.outputs] == tokens
    assert len({tuple(t) for t in tokens}) == 4
    # Sequence i draws from seed + i: the single sequence of that seed.
    singles = llm.generate([PROMPTS[0]] * 4, [replace(params, n=1, seed=7 + i) for i in range(4)], use_tqdm=False)
    assert [s.outputs[0].token_ids for s in singles] == tokens


def test_stop_max_tokens_and_logprobs_hold_per_sequence(models):
    llm = make_llm(models, "eagle3")
    params = SamplingParams(n=6, temperature=1.0, max_tokens=20, stop=["e"], logprobs=2, seed=1)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert len(out.outputs) == 6 and out.finished
    assert {c.finish_reason for c in out.outputs} <= {"stop", "length"}
    assert "stop" in {c.finish_reason for c in out.outputs}
    for c in out.outputs:
        assert "e" not in c.text and len(c.token_ids) <= 20
        assert len(c.logprobs) == len(c.token_ids) and c.finish_reason == ("stop" if c.stop_reason else "length")
        assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))
    assert out.metrics.num_output_tokens == sum(len(c.token_ids) for c in out.outputs)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_streamed_outputs_add_up_to_the_final_one(models, kind):
    llm = make_llm(models, None)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=3, stop=["o"])
    final = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    engine = llm.engine
    rid = engine.add_request(PROMPTS[0], replace(params, output_kind=kind))
    texts, tokens = ["", "", ""], [[], [], []]
    finished = False
    while not finished:
        for out in engine.step():
            assert out.request_id == rid
            if kind is RequestOutputKind.CUMULATIVE:
                assert [c.index for c in out.outputs] == [0, 1, 2]
            for c in out.outputs:
                if kind is RequestOutputKind.DELTA:
                    texts[c.index] += c.text
                    tokens[c.index] += c.token_ids
                else:
                    texts[c.index], tokens[c.index] = c.text, c.token_ids
            finished = out.finished
    assert texts == [c.text for c in final.outputs] and tokens == [c.token_ids for c in final.outputs]


def test_delta_outputs_merged_for_a_busy_reader_add_up_to_the_final_one(models):
    """A server's reader that falls behind gets the outputs that came meanwhile merged into one
    (engine/request_stream.py): each sequence's text and tokens in order, and its own finish reason."""
    llm = make_llm(models, None)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=3, stop=["o"])
    final = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    engine = llm.engine
    engine.add_request(PROMPTS[0], replace(params, output_kind=RequestOutputKind.DELTA))
    stream = RequestStream(RequestOutputKind.DELTA)
    while engine.has_unfinished_requests():
        for out in engine.step():
            stream.put(out)
    merged = asyncio.run(stream.get())
    assert merged.finished and all(c.text for c in merged.outputs)
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in merged.outputs] == \
        [(c.index, c.text, c.token_ids, c.finish_reason) for c in final.outputs]


def test_aborting_the_request_aborts_every_sequence(models):
    llm = make_llm(models, None)
    engine = llm.engine
    rid = engine.add_request(PROMPTS[0], SamplingParams(n=5, max_tokens=100, ignore_eos=True))
    engine.step()
    assert engine.num_unfinished_requests == 5
    assert engine.abort_request(rid)
    assert engine.num_unfinished_requests == 0 and engine.kv.usage == 0 and not engine.has_unfinished_requests()
    assert not engine.abort_request(rid)


def test_n_out_of_bounds_is_refused_by_name(models):
    llm = make_llm(models, None)
    for n in (0, 129, 2.0):
        with pytest.raises(InvalidRequestError, match=r"^n: must be an integer in \[1, 128\]"):
            llm.generate(PROMPTS[0], SamplingParams(n=n), use_tqdm=False)


@pytest.mark.parametrize("speculate", [False, True])
def test_sampled_sequences_follow_the_model_distribution(models, tmp_path, speculate):
    """The first two tokens of 800 sequences (8 requests of n = 100), top-k 3 at temperature 0.5: their joint
    distribution is the one transformers' logits give, and not the one of temperature 1. Speculating, the second
    token comes from verifying the drafts of an EAGLE-3 head that drafts only likely tokens, so that drafts are
    both accepted and rejected."""
    params = SamplingParams(n=100, temperature=0.5, top_k=3, max_tokens=2, ignore_eos=True)
    spec = None
    if speculate:
        hf = models["hf"]
        ids = make_llm(models, None).engine.tokenize(PROMPTS[0])
        head = save_eagle_head(tmp_path / "head", hf.config, "eagle3", seed=2,
                               draft_token_ids=drafted_tokens(hf, ids, 0.5, 3))
        spec = {"method": "eagle3", "num_speculative_tokens": 3, "model": str(head)}
    llm = LLM(str(models["path"]), max_model_len=256, max_num_seqs=128, speculative_config=spec)
    first_two_tokens_test(llm, models["hf"], PROMPTS[0], params, requests=8, wrong={"temperature": 1.0})
    if speculate:
        stats = llm.engine.spec_stats
        assert 0 < stats.num_accepted < stats.num_drafted
