"""KV cache sizing on a GPU: the profiled cache fits the share of memory it was given, CUDA graphs, a warm-up and
a full batch included, and the trial capture measures the graphs the engine keeps."""
from __future__ import annotations

import gc
import random

import pytest
import torch

from specserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu
MAX_LEN, SEQS = 2048, 64


def device_used() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "eagle3"])
def test_the_profiled_cache_fits_the_share(smollm2_shape, spec):
    model, head = smollm2_shape
    util, total = 0.3, torch.cuda.mem_get_info()[1]
    before = device_used()
    cfg = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3} if spec else None
    llm = LLM(model.path, load_format=model.load_format, dtype="bfloat16", max_model_len=MAX_LEN, max_num_seqs=SEQS,
              gpu_memory_utilization=util, speculative_config=cfg)
    runner = llm.engine.runner
    plan, profile = runner.kv_plan, runner.kv_plan.profile
    assert profile is not None and plan.num_tokens >= MAX_LEN
    # The trial capture measured what the engine's own capture took.
    assert runner.graph_memory_bytes <= profile.cuda_graphs + (64 << 20)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randint(10, 1500))] for _ in range(2 * SEQS)]
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, logprobs=5, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)]
    llm.generate(prompts, [params[i % 2] for i in range(len(prompts))], use_tqdm=False)
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    used = total - free - before
    assert used <= util * total, (
        f"the engine holds {used / 2**30:.2f} GiB, over {util} of {total / 2**30:.2f} GiB; profile: "
        f"{profile.describe()}; KV cache {plan.bytes / 2**30:.2f} GiB; torch allocated "
        f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB, reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB "
        f"(peak {torch.cuda.max_memory_reserved() / 2**30:.2f}); graphs kept {runner.graph_memory_bytes / 2**30:.2f} GiB")
    # The share went to the cache rather than lying idle.
    assert used >= 0.8 * util * total
    del llm, runner
    device_used()


def test_an_explicit_size_is_what_the_caches_take(smollm2_shape):
    model, head = smollm2_shape
    llm = LLM(model.path, load_format=model.load_format, dtype="bfloat16", max_model_len=MAX_LEN,
              kv_cache_memory_bytes=1 << 30,
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    runner = llm.engine.runner
    caches = [runner.kv.stack, runner.speculator.kv_cache]
    held = sum(c.numel() * c.element_size() for c in caches)
    assert held == runner.kv_plan.bytes <= 1 << 30 < held + runner.kv.block_bytes
    del llm, runner, caches
    device_used()
