"""The start-up warm-up: its plan covers every compiled variant the shape model knows, it leaves nothing behind
(a seeded run is the same with and without it), and after it no request launches a kernel variant it did not."""
from __future__ import annotations

import logging
import random

import pytest

from conftest import make_hf_model
from heads import save_eagle_head
from kernel_variants import KernelVariants, describe_new
from specserve import LLM, SamplingParams
from specserve.engine.warmup import warm_up
from specserve.engine.warmup_plan import (PREFIX_BLOCKS, EngineShapes, WarmupRequest, VariantCover, batch_prefills,
                                          batch_sizes, int_class, plan, prefill_lengths, rows_class, step_variants)
from specserve.models.layers import set_fused_kernels
from specserve.worker.cudagraph import BatchDescriptor
from specserve.worker.cudagraph_mode import CUDAGraphMode as M
from specserve.worker.graph_recorder import EagerRecorder


def eager_shapes(**kw) -> EngineShapes:
    """Every step eager, attention compiling one variant per query length up to 4 and one past it."""
    values = dict(dispatch=lambda n, q: BatchDescriptor(M.NONE, n, len(q)), attention=lambda r, q: (min(q, 5),),
                  max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128, block_size=16, num_drafts=0,
                  chunked_prefill=True)
    return EngineShapes(**{**values, **kw})


def test_integers_and_rows_class_as_triton_and_the_small_m_kernels_see_them():
    assert [int_class(n) for n in (1, 2, 15, 16, 17, 32, 48)] == ["1", "n", "n", "16n", "n", "16n", "16n"]
    assert [rows_class(m) for m in (1, 2, 3, 4, 5, 16, 17, 32, 33, 500)] == [1, 2, 4, 4, 8, 16, 32, 32, 64, 64]


def test_prefill_lengths_take_the_first_of_each_variant():
    # Rows 1, 2, 4, 8, 16, 32 and past, integers 1 / 16n / n, attention by length up to 5.
    assert prefill_lengths(eager_shapes(attention=lambda r, q: ())) == [1, 2, 3, 5, 9, 16, 17, 32, 33, 48]
    assert prefill_lengths(eager_shapes()) == [1, 2, 3, 4, 5, 9, 16, 17, 32, 33, 48]
    # Up to the longest prompt one step holds: the budget, or one less than the context.
    assert max(prefill_lengths(eager_shapes(max_model_len=33))) == 32
    assert max(prefill_lengths(eager_shapes(max_num_batched_tokens=20))) == 17


def test_every_step_launches_only_variants_a_planned_one_launched():
    shapes = eager_shapes(num_drafts=3, max_num_seqs=40, max_num_batched_tokens=160)
    cover = VariantCover(shapes)
    assert prefill_lengths(shapes, cover)[0] == 1 and batch_prefills(shapes, cover)
    batch_sizes(shapes, cover)
    assert batch_sizes(shapes)[0] == 2  # on their own, decode batches start at two requests
    rng = random.Random(0)
    for _ in range(300):
        r = rng.randint(1, 40)
        lens = [rng.randint(1, 160 // r) for _ in range(r)]
        assert step_variants(shapes, lens) <= cover.seen, lens
    for r in range(2, 41):
        for q in (1, 4):
            assert step_variants(shapes, [q] * r) <= cover.seen


def test_a_full_graph_needs_one_request_count_of_each_class():
    def dispatch(n, query_lens):
        if n <= 16:
            return BatchDescriptor(M.FULL, 16, 16, query_lens[0])
        return BatchDescriptor(M.NONE, n, len(query_lens))

    shapes = eager_shapes(dispatch=dispatch, attention=lambda r, q: ())
    assert prefill_lengths(shapes)[:2] == [1, 2]  # 3..16 replay the graph like 2: the same sampling around it
    assert 3 not in prefill_lengths(shapes) and 17 in prefill_lengths(shapes)


def test_the_plan_runs_each_length_alone_as_a_cached_tail_in_batches_and_in_chunks():
    shapes = eager_shapes(num_drafts=2)
    scenarios = plan(shapes)
    lengths = prefill_lengths(shapes)
    alone = [s.first[0].prompt_len for s in scenarios if s.name.startswith("prefill") and len(s.requests) == 1]
    assert alone == lengths
    together = [s for s in scenarios if s.name.startswith("prefill") and len(s.requests) > 1]
    assert together and all(len(s.first) <= 8 and sum(r.prompt_len for r in s.first) <= 64 and not s.later
                            for s in together)
    prefix = PREFIX_BLOCKS * 16
    tails = [s.first[0] for s in scenarios if s.name.startswith("cached prefix")]
    assert [r.prompt_len - prefix for r in tails] == [q for q in lengths if q <= prefix]
    assert all(r.cached_prefix == prefix for r in tails)
    batches = [s for s in scenarios if s.name.startswith(("greedy", "sampled "))]
    sizes = set(batch_sizes(shapes))
    assert {len(s.requests) for s in batches if s.name.startswith("greedy")} == sizes
    assert {len(s.requests) for s in batches if s.name.startswith("sampled")} == sizes | {1}
    kinds = {r.sampled for s in batches for r in s.requests}
    assert kinds == {False, True}
    chunked = [s for s in scenarios if s.name.startswith("chunked")]
    assert len(chunked) == 2 and all(s.requests[-1].prompt_len > 64 for s in chunked)
    assert not [s for s in plan(eager_shapes(chunked_prefill=False)) if s.name.startswith("chunked")]
    assert all(r.prompt_len < 128 for s in scenarios for r in s.requests)
    with pytest.raises(ValueError):
        WarmupRequest(4, cached_prefix=4)


@pytest.fixture(scope="module")
def head(tiny_llama, tmp_path_factory):
    return save_eagle_head(tmp_path_factory.mktemp("warm") / "eagle3", tiny_llama[1].config, "eagle3", seed=3)


def workload(vocab: int, n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 1 to 60 tokens, some sharing a prefix of two or three blocks, half sampled (some seeded, some
    with logprobs or penalties), the rest greedy."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(48)]
    prompts, params = [], []
    for i in range(n):
        fresh = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))]
        prompts.append((shared[:rng.choice((32, 48))] + fresh)[:60] if i % 3 == 0 else fresh)
        if i % 2:
            params.append(SamplingParams(temperature=0, max_tokens=rng.randint(1, 8), ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.9, top_p=0.95, top_k=30, max_tokens=rng.randint(1, 8),
                                         seed=i if i % 4 == 0 else None, logprobs=3 if i % 3 == 1 else None,
                                         presence_penalty=0.3 if i % 5 == 2 else 0.0, ignore_eos=True))
    return prompts, params


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_seeded_run_is_the_same_with_and_without_the_warm_up(tiny_llama, head, caplog, async_scheduling):
    path, hf = tiny_llama
    kw = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=48, num_kv_blocks=64, seed=5,
              async_scheduling=async_scheduling,
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    prompts, params = workload(hf.config.vocab_size, 12, seed=1)
    runs = []
    for warmup in (False, True):
        with caplog.at_level(logging.INFO, logger="specserve.engine.warmup"):
            llm = LLM(str(path), warmup=warmup, **kw)
        assert ("Warm-up:" in caplog.text) == warmup
        engine = llm.engine
        assert engine.kv.pool.num_free == 64 and not engine.kv.pool.cached and not engine.runner.rows
        core = engine.core
        assert core.num_prompt_tokens == core.num_cached_prompt_tokens == core.num_generated_tokens == 0
        assert engine.spec_stats.num_steps == 0
        outs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]  # the second hits the cache
        runs.append(([[(o.outputs[0].token_ids, o.outputs[0].logprobs, o.metrics.num_cached_tokens) for o in out]
                      for out in outs],
                     core.num_prompt_tokens, core.num_cached_prompt_tokens, core.num_generated_tokens,
                     engine.spec_stats.as_dict(),
                     engine.kv.prefix_cache_hit_rate, engine.kv.pool.num_free, sorted(engine.kv.pool.cached)))
        caplog.clear()
    assert runs[0] == runs[1]
    assert runs[0][5] > 0 and runs[0][2] > 0  # the workload did hit the prefix cache


@pytest.fixture(scope="module")
def narrow_llama(tmp_path_factory, tokenizer_dir):
    """(directory, EAGLE-3 head) of a Llama narrower than tiny_llama: tiny_llama's head size (16) with 2 query
    heads on 1 KV head, half its widths (hidden 32, MLP 64) and 1 layer. The interpreter runs a program per head
    in the attention kernels and one per column tile and K chunk in the projections, so each launch costs fewer
    programs, while the kernels and the integer classes a batch decides (widths that are multiples of 16) are
    those of the wider model. A second layer would add only variants whose residual-add constexpr differs,
    launched in the same steps with the same integer classes as the first layer's."""
    path = tmp_path_factory.mktemp("narrow_llama")
    hf = make_hf_model(path, tokenizer_dir, "llama", hidden_size=32, intermediate_size=64, num_attention_heads=2,
                       num_key_value_heads=1, num_hidden_layers=1)
    return path, save_eagle_head(path.parent / "narrow_eagle3", hf.config, "eagle3", seed=3)


def test_after_the_warm_up_no_request_launches_a_new_kernel_variant(narrow_llama):
    """Under the interpreter, the triton backend and the fused kernels on, graphs as on a GPU (the CPU stand-in):
    a random workload afterwards launches only kernel variants the capture and the warm-up launched
    (tests/kernel_variants.py). Without the warm-up, the workload's eager steps of more than 16 tokens launch
    variants the capture did not."""
    path, head = narrow_llama
    # Blocks of 8 tokens: a lone request's full graphs cover query lengths up to a block (2 to 8, not to 16), and
    # lengths 9 to 16 replay the piecewise graphs, whose variants the warm-up plans as well.
    llm = LLM(str(path), attention_backend="triton", max_model_len=48, max_num_seqs=3, max_num_batched_tokens=20,
              block_size=8, num_kv_blocks=80, cudagraph_capture_sizes=[1, 2, 4, 8, 16],
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 2})
    engine = llm.engine
    for model in (engine.core.model, engine.runner.speculator.head):
        set_fused_kernels(model, True)
    with KernelVariants() as seen:
        # A capture compiles its graphs' kernels (the stand-in's replays launch them again).
        engine.runner.capture_graphs(M.FULL_AND_PIECEWISE, EagerRecorder(), engine.attention_backend)
        warm_up(engine.core)
        warmed = set(seen)
        prompts, params = workload(engine.core.arch.vocab_size, 6, seed=2)
        llm.generate([p[:40] for p in prompts], params, use_tqdm=False)
        for p, sp in zip(prompts[:2], params[:2]):
            llm.generate(p[:40], sp, use_tqdm=False)
    assert warmed and not seen - warmed, describe_new(seen, warmed)
