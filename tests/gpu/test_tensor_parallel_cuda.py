"""Tensor parallelism on two GPUs (NCCL; run with `pytest -m gpu` on a machine with >= 2 GPUs): TP=2 equals
TP=1 in float32 (TF32 off) in every graph mode, with and without EAGLE-3 chains and trees, and chains and trees of
the head sharded like the target, the all-reduces replayed inside CUDA graphs; the KV cache sized by gpu_memory_utilization on every rank; and in bfloat16 on a
real model (SPECSERVE_TP_MODEL, a Hugging Face directory whose heads divide by 2, with an optional EAGLE-3 head
in SPECSERVE_TP_EAGLE3_HEAD) TP=2's greedy tokens agree with TP=1's."""
from __future__ import annotations

import os
import random

import pytest
import torch

from heads import save_eagle_head
from specserve import LLM, SamplingParams
from specserve.worker.cudagraph_mode import CUDAGraphMode as M

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_float32"),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"
SMALL_KV = {"kv_cache_memory_bytes": 256 << 20}
REAL_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                "Explain photosynthesis in one sentence.", "List three prime numbers and say why they are prime."]


@pytest.fixture(scope="module")
def case(tiny_llama, tmp_path_factory):
    path, hf = tiny_llama
    rng = random.Random(5)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(rng.randint(2, 90))] for _ in range(8)]
    head = save_eagle_head(tmp_path_factory.mktemp("tp-cuda") / "eagle3", hf.config, "eagle3", seed=6)
    return path, prompts, head


def _spec(head, drafts, tp: int = 1):
    """No drafter, an EAGLE-3 chain or tree whole on rank 0, or ("sharded-" before either) of the head sharded over
    the tp ranks."""
    if drafts is None:
        return None
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    if drafts.startswith("sharded-"):
        return {**_spec(head, drafts.removeprefix("sharded-")), "draft_tensor_parallel_size": tp}
    return {**spec, "speculative_token_tree": TREE} if drafts == "tree" else spec


def _run(path, prompts, tp: int, **kwargs):
    llm = LLM(str(path), device="cuda", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128,
              cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64, 128], tensor_parallel_size=tp, **kwargs)
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        stats = llm.engine.spec_stats
        return tokens, (stats.num_drafted, stats.num_accepted)
    finally:
        llm.engine.core.close()


@pytest.mark.parametrize("drafts", [None, "chain", "tree", "sharded-chain", "sharded-tree"])
@pytest.mark.parametrize("mode", [M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY, M.PIECEWISE, M.NONE], ids=lambda m: m.name)
def test_tp2_float32_equals_tp1(case, drafts, mode):
    path, prompts, head = case
    kwargs = dict(dtype="float32", cudagraph_mode=mode.name, **SMALL_KV)
    want = _run(path, prompts, 1, speculative_config=_spec(head, drafts), **kwargs)
    assert _run(path, prompts, 2, speculative_config=_spec(head, drafts, tp=2), **kwargs) == want


def test_every_rank_sizes_its_cache_by_utilization(case):
    path, prompts, _ = case
    want, _ = _run(path, prompts, 1, dtype="float32", **SMALL_KV)
    got, _ = _run(path, prompts, 2, dtype="float32", gpu_memory_utilization=0.3)
    assert got == want


def _agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """The share of tokens before each request's first difference."""
    same = 0
    for g, w in zip(got, want, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        same += n
    return same / sum(len(w) for w in want)


@pytest.mark.parametrize("eagle3", [False, True])
def test_tp2_bfloat16_agrees_with_tp1_on_a_real_model(eagle3):
    model = os.environ.get("SPECSERVE_TP_MODEL")
    head = os.environ.get("SPECSERVE_TP_EAGLE3_HEAD")
    if model is None or (eagle3 and head is None):
        pytest.skip("set SPECSERVE_TP_MODEL (and SPECSERVE_TP_EAGLE3_HEAD) to a real model (and its EAGLE-3 head)")
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3} if eagle3 else None
    kwargs = dict(dtype="bfloat16", speculative_config=spec, gpu_memory_utilization=0.8)
    got, _ = _run(model, REAL_PROMPTS, 2, **kwargs)
    want, _ = _run(model, REAL_PROMPTS, 1, **kwargs)
    assert _agreement(got, want) >= 0.8


@pytest.mark.timeout(300)
def test_qwen32b_shape_batch_16_decodes_under_graphs(tmp_path):
    """The Qwen2.5-32B shape (random weights) at TP=2, 16 requests of 64 tokens (a 1,024-token eager prefill,
    then decode steps replaying the whole-step graph): with NCCL's graph buffer registration on, its first step
    hung on H100 and H200 (parallel_state.init_tp_group turns it off). Needs two GPUs of >= 40 GB."""
    from specserve.bench.models import prepare_model

    model = prepare_model("qwen2.5-32b", tmp_path, torch.bfloat16)
    llm = LLM(model.path, load_format=model.load_format, device="cuda", dtype="bfloat16", max_model_len=208,
              max_num_seqs=16, max_num_batched_tokens=2048, num_kv_blocks=241, cudagraph_capture_sizes=[16],
              enable_prefix_caching=False, warmup=False, tensor_parallel_size=2)
    try:
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 150_000) for _ in range(64)] for _ in range(16)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [16] * 16
    finally:
        llm.engine.core.close()
