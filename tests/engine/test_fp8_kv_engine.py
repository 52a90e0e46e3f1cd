"""The FP8 KV cache end to end on the CPU (tiny random Llama, float32 weights): greedy output close to the
model-dtype cache's, speculation still exactly lossless, twice the tokens in the same memory, and clear errors
for what it cannot do."""
from __future__ import annotations

import pytest
import torch

from conftest import repetitive_prompts
from heads import save_eagle_head
from specserve import LLM, ConfigError, SamplingParams
from specserve.config import EngineConfig
from specserve.entrypoints.cli import build_parser, engine_kwargs

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


@pytest.fixture(scope="module")
def fp8_reference(tiny_llama):
    """(model path, prompts, greedy tokens with the model's dtype in the cache, with FP8 in it)."""
    path, hf = tiny_llama
    prompts = repetitive_prompts(hf.config.vocab_size)
    outputs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(str(path), max_model_len=256, kv_cache_dtype=kv)
        assert llm.engine.runner.kv.stack.dtype == (torch.float8_e4m3fn if kv == "fp8" else torch.float32)
        outputs[kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return path, prompts, outputs["auto"], outputs["fp8"]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of positions where two greedy outputs agree, each output counted up to its first difference
    (after it, the contexts differ)."""
    agreed = 0
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x))
        agreed += n
    return agreed / sum(len(x) for x in a)


def test_fp8_greedy_mostly_agrees_with_the_model_dtype_cache(fp8_reference):
    _, _, auto, fp8 = fp8_reference
    # e4m3 keeps 3 mantissa bits: a random tiny model's near-ties may flip, but most positions agree. A cache
    # read without its scale or written unrounded fails this by far.
    assert agreement(auto, fp8) >= 0.75


def test_the_triton_kernels_serve_an_fp8_engine(fp8_reference):
    """The Triton backend (interpreted) writes and reads the FP8 cache as the torch reference does: the same
    quantization, attention differing in float32 rounding only."""
    path, prompts, _, fp8 = fp8_reference
    llm = LLM(str(path), max_model_len=256, kv_cache_dtype="fp8", attention_backend="triton")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params, use_tqdm=False)]
    assert agreement([r[:8] for r in fp8[:3]], outs) >= 0.9


@pytest.mark.parametrize("spec", ["chain", "tree"])
def test_eagle3_is_lossless_under_fp8(fp8_reference, tiny_llama, tmp_path, spec):
    """EAGLE-3's greedy output equals the FP8 engine's without speculation, token for token, with chunked
    prefill, prefix hits and preemption in the mix; the head's own cache is FP8 too."""
    path, prompts, _, fp8 = fp8_reference
    head = save_eagle_head(tmp_path / "eagle3", tiny_llama[1].config, "eagle3", seed=2)
    shape = {"num_speculative_tokens": 3} if spec == "chain" else {"speculative_token_tree": TREE}
    llm = LLM(str(path), max_model_len=256, kv_cache_dtype="fp8", max_num_batched_tokens=48, num_kv_blocks=17,
              block_size=16, speculative_config={"method": "eagle3", "model": str(head), **shape})
    assert all(stack.dtype == torch.float8_e4m3fn for stack in llm.engine.runner.kv.stacks)
    assert len(llm.engine.runner.kv.stacks) == 2, "the head's layer has a cache of its own"
    llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == fp8
    assert llm.engine.spec_stats.num_drafted > 0
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "no preemption in the mix"


def test_fp8_holds_twice_the_tokens_of_bfloat16(tiny_llama, tmp_path):
    path, hf = tiny_llama
    head = save_eagle_head(tmp_path / "eagle3", hf.config, "eagle3", seed=2)
    plans = {}
    for kv in ("auto", "fp8"):
        llm = LLM(str(path), max_model_len=256, dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory_bytes=1 << 20,
                  speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 2})
        plans[kv] = llm.engine.runner.kv_plan
    # A block of 16 tokens over the target's 2 layers and the head's 1: 3 x 2 (k, v) x 16 x 2 heads x 16 dims.
    assert plans["auto"].block_bytes == 3 * 2 * 16 * 2 * 16 * 2
    assert plans["fp8"].block_bytes * 2 == plans["auto"].block_bytes
    # The same memory, the spare block included: (1 MiB / block) - 1 blocks each, so at least twice the tokens.
    for plan in plans.values():
        assert plan.num_blocks == (1 << 20) // plan.block_bytes - 1
    assert plans["fp8"].num_tokens >= 2 * plans["auto"].num_tokens


def test_the_flag_reaches_the_engine_from_the_command_line():
    for command in ("generate", "serve"):
        args = build_parser().parse_args([command, "--kv-cache-dtype", "fp8"] + (["x"] if command == "generate" else []))
        assert engine_kwargs(args)["kv_cache_dtype"] == "fp8"
    assert engine_kwargs(build_parser().parse_args(["generate", "x"]))["kv_cache_dtype"] == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--kv-cache-dtype", "fp16", "x"])


@pytest.mark.parametrize("value", ["fp16", "float8", "FP8", None])
def test_an_unknown_kv_cache_dtype_is_refused(value):
    with pytest.raises(ConfigError) as e:
        EngineConfig(kv_cache_dtype=value)
    assert e.value.field == "kv_cache_dtype" and "auto, fp8" in str(e.value)
