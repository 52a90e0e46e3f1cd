"""Greedy output must not depend on batching, chunking, prefix caching or preemption."""
from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def mixed_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 150))] for _ in range(n)]


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    _, hf = tiny_llama
    return mixed_prompts(16, hf.config.vocab_size)


@pytest.fixture(scope="module")
def alone(tiny_llama, prompts):
    """Each prompt run by itself, no chunking, no prefix cache: the reference."""
    llm = LLM(str(tiny_llama[0]), max_model_len=256, enable_prefix_caching=False, enable_chunked_prefill=False)
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.parametrize("chunked", [True, False])
def test_batch_of_16_equals_alone(tiny_llama, prompts, alone, chunked):
    # A small token budget forces prompts to be split across steps when chunking is on.
    llm = LLM(str(tiny_llama[0]), max_model_len=256, enable_chunked_prefill=chunked,
              max_num_batched_tokens=64 if chunked else 256)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    if chunked:
        assert max(len(p) for p in prompts) > 64  # some prompt really was chunked


def test_prefix_cache_hit_computes_only_the_rest(tiny_llama):
    llm = LLM(str(tiny_llama[0]), max_model_len=256, block_size=16)
    rng = random.Random(1)
    shared = [rng.randrange(3, 300) for _ in range(48)] + [5]  # 3 full blocks + 1 token
    first = shared + [7, 8, 9, 10]
    second = shared + [11, 12, 13]
    a = llm.generate([first], GREEDY, use_tqdm=False)[0]
    b = llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert a.metrics.num_cached_tokens == 0
    assert b.metrics.num_cached_tokens == 48
    # The model ran the 4 uncached prompt tokens and one token per generated token after the first.
    assert b.metrics.num_model_tokens == len(second) - 48 + GREEDY.max_tokens - 1
    fresh = LLM(str(tiny_llama[0]), max_model_len=256, enable_prefix_caching=False)
    assert b.outputs[0].token_ids == fresh.generate([second], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_full_prompt_hit_recomputes_last_token(tiny_llama, prompts, alone):
    llm = LLM(str(tiny_llama[0]), max_model_len=256, block_size=16)
    p = prompts[0][:32]  # exactly two blocks
    first = llm.generate([p], GREEDY, use_tqdm=False)[0]
    again = llm.generate([p], GREEDY, use_tqdm=False)[0]
    assert again.metrics.num_cached_tokens == 16  # the last block is recomputed to get logits
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_prefix_hit_inside_batch_equals_alone(tiny_llama, prompts, alone):
    llm = LLM(str(tiny_llama[0]), max_model_len=256)
    llm.generate(prompts[:4], GREEDY, use_tqdm=False)  # warms the prefix cache
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert sum(o.metrics.num_cached_tokens for o in outs[:4]) > 0
    assert [o.outputs[0].token_ids for o in outs] == alone


def test_preemption_keeps_outputs(tiny_llama, prompts, alone):
    # 20 blocks of 16 tokens cannot hold 16 requests of up to ~160 tokens at once.
    llm = LLM(str(tiny_llama[0]), max_model_len=256, num_kv_blocks=20, block_size=16)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert llm.engine.kv.pool.num_free == 20  # every block came back


def test_abort_frees_blocks(tiny_llama, prompts):
    llm = LLM(str(tiny_llama[0]), max_model_len=256, num_kv_blocks=40)
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in prompts[:4]]
    engine.step()
    assert engine.kv.pool.num_free < 40
    for rid in ids:
        assert engine.abort_request(rid)
    assert engine.kv.pool.num_free == 40
    assert not engine.has_unfinished_requests()
