"""The engine on a GPU: Triton attention and CUDA sampling give the CPU reference's greedy output."""
from __future__ import annotations

import random

import pytest
import torch

from heads import save_eagle_head, save_perturbed_copy
from specserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_float32")]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# The tiny model's engines get a small cache: sized by a share of the GPU, its 8 KiB blocks would number millions.
SMALL_KV = {"kv_cache_memory_bytes": 256 << 20}



@pytest.fixture(scope="module")
def case(tiny_llama):
    path, hf = tiny_llama
    rng = random.Random(3)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(rng.randint(3, 150))] for _ in range(12)]
    cpu = LLM(str(path), max_model_len=256, device="cpu")
    ref = [o.outputs[0].token_ids for o in cpu.generate(prompts, GREEDY, use_tqdm=False)]
    return path, hf, prompts, ref


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_float32_equals_cpu(case, backend):
    path, _, prompts, ref = case
    llm = LLM(str(path), max_model_len=256, device="cuda", **SMALL_KV, dtype="float32", attention_backend=backend,
              max_num_batched_tokens=64)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == ref


@pytest.mark.parametrize("method,widen", [("eagle", 1), ("eagle3", 1), ("eagle3", 4)])
def test_cuda_eagle_greedy_equals_no_speculation(case, tmp_path, method, widen):
    """widen: the head's MLP that many times the target's (the shipped SmolLM2 head's is 4x)."""
    path, hf, prompts, ref = case
    head = save_eagle_head(tmp_path / method, hf.config, method, intermediate=widen * hf.config.intermediate_size)
    llm = LLM(str(path), max_model_len=256, device="cuda", **SMALL_KV, dtype="float32", attention_backend="triton",
              speculative_config={"method": method, "model": str(head), "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == ref
    assert llm.engine.spec_stats.num_drafted > 0


def test_cuda_bf16_agrees_mostly(case):
    path, _, prompts, ref = case
    llm = LLM(str(path), max_model_len=256, device="cuda", **SMALL_KV, dtype="bfloat16")
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    # bf16 rounding may flip near-ties; most first tokens must still agree with float32.
    assert sum(o[0] == r[0] for o, r in zip(outs, ref)) >= len(ref) * 3 // 4


@pytest.mark.parametrize("spec", [None, "near", "self"])
def test_cuda_async_scheduling_equals_cpu(case, tmp_path, spec):
    """Asynchronous scheduling under CUDA graphs (every replay checked against eager): the CPU reference's
    greedy output with drafts partly accepted (a perturbed copy of the target), all accepted (the target
    itself) or none, with chunked prefill and preemption, and the steps really overlap."""
    path, _, prompts, ref = case
    cfg = None
    if spec is not None:
        draft = save_perturbed_copy(tmp_path / "near", path) if spec == "near" else path
        cfg = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(str(path), max_model_len=256, device="cuda", dtype="float32", speculative_config=cfg,
              max_num_batched_tokens=64, num_kv_blocks=40, block_size=16, debug_cudagraph=True,
              cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64])
    assert llm.engine.config.async_scheduling
    runner, launched, overlapped = llm.engine.runner, [], []
    launch, resolve = runner.launch, runner.resolve
    runner.launch = lambda sched, *args: launched.append(launch(sched, *args)) or launched[-1]
    runner.resolve = lambda handle: overlapped.append(launched[-1] is not handle) or resolve(handle)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    if spec != "self":  # accepting every draft, requests finish before the pool runs short
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert sum(overlapped) > len(overlapped) // 2
    if spec is not None:
        stats = llm.engine.spec_stats
        assert stats.num_accepted > 0 and (stats.num_accepted < stats.num_drafted) == (spec == "near")


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "eagle3"])
def test_launching_a_step_never_syncs_the_host(case, tmp_path, spec):
    """docs/invariants.md, 'Metadata on the device': everything a step enqueues (inputs, in-flight corrections, forward, sampling or
    verification, drafts, the copy of the results) runs under CUDA's sync debug mode set to raise, for
    greedy and sampled requests, prefill chunks and decode; only resolve() waits, on one event."""
    path, hf, prompts, ref = case
    cfg = None
    if spec:
        head = save_eagle_head(tmp_path / "eagle3", hf.config, "eagle3")
        cfg = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    llm = LLM(str(path), max_model_len=256, device="cuda", **SMALL_KV, dtype="float32", speculative_config=cfg,
              max_num_batched_tokens=64, cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64])
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True)
    llm.generate(prompts[:3], [GREEDY, sampled, GREEDY], use_tqdm=False)  # compiles kernels, allocates
    runner = llm.engine.runner
    launch = runner.launch

    def launch_without_sync(sched, *args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(sched, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.launch = launch_without_sync
    params = [GREEDY if i % 2 else sampled for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    greedy = [o.outputs[0].token_ids for o, p in zip(outs, params) if p is GREEDY]
    assert greedy == [r for r, p in zip(ref, params) if p is GREEDY]
