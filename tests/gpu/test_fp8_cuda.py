"""FP8 weights on a GPU. With the real default model (SPECSERVE_GGUF: its .gguf file, whose Q4_1 projections load as
FP8 codes with block scales; SPECSERVE_MT_BENCH: the MT-bench questions, one JSON object a line): greedy agreement
of FP8 weights with an FP8 KV cache against bfloat16 over the first 64 tokens of every first turn, the perplexity
of a held-out text (tests/data/heldout_fp8.txt), and the shipped EAGLE-3 head lossless under FP8. With the tiny
model: the CUDA paths (the Triton kernel, torch._scaled_mm, graphs) and speculation lossless under FP8."""
from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu
GGUF = os.environ.get("SPECSERVE_GGUF")
MT_BENCH = os.environ.get("SPECSERVE_MT_BENCH")
HELDOUT = Path(__file__).resolve().parents[1] / "data" / "heldout_fp8.txt"
FIRST = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def _tokens(llm: LLM, prompts, params=FIRST) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _greedy_first_turns(conversations, params=FIRST, **engine) -> tuple[list[list[int]], list[list[int]]]:
    """(the first turns' prompts, each one's greedy tokens); the engine goes with the call. A fixed cache (the first
    turns need about 1 GiB) keeps each engine from taking 0.9 of the GPU."""
    from specserve.prompt_files import prompt_token_ids

    llm = LLM(GGUF, max_model_len=2048, kv_cache_memory_bytes=4 << 30, **{"dtype": "bfloat16", **engine})
    prompts = [prompt_token_ids(llm, c) for c in conversations]
    tokens = _tokens(llm, prompts, params)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return prompts, tokens


@pytest.mark.skipif(not (GGUF and MT_BENCH), reason="set SPECSERVE_GGUF and SPECSERVE_MT_BENCH")
def test_fp8_greedy_agrees_with_bf16_on_mt_bench():
    """FP8 weights (the GGUF's codes, rebuilt exactly in the GEMM) and an FP8 KV cache (e4m3, per-tensor scales)
    against bfloat16 weights and cache over the first 64 tokens of every first turn: at each position of the
    bfloat16 engine's greedy output, the FP8 model's argmax given the same prefix, read through the decode path (a
    step a token, the context from the FP8 cache). Free-running outputs part at the first near-tie rounded
    differently and never meet again, so they are printed, not held to 95%: the same bfloat16 model through the
    decode path is the noise floor."""
    from specserve.bench.fidelity import decode_path_agreement, positionwise_agreement, prefix_agreement
    from specserve.models.loader import open_model_source
    from specserve.prompt_files import load_prompt_file

    conversations = load_prompt_file(MT_BENCH)
    prompts, bf16 = _greedy_first_turns(conversations)
    _, fp8 = _greedy_first_turns(conversations, quantization="fp8", kv_cache_dtype="fp8")
    source = open_model_source(GGUF)
    forced = decode_path_agreement(source, prompts, bf16, torch.bfloat16, "cuda", "fp8", "fp8")
    floor = decode_path_agreement(source, prompts, bf16, torch.bfloat16, "cuda")
    print(f"FP8 weights and KV against bfloat16, {len(conversations)} first turns x 64 tokens, teacher-forced "
          f"through the decode path: {forced:.2%} (bfloat16: {floor:.2%}); free-running "
          f"{prefix_agreement(bf16, fp8):.1%} up to the first difference, {positionwise_agreement(bf16, fp8):.1%} "
          f"position by position")
    assert forced >= 0.95


@pytest.mark.skipif(not (GGUF and MT_BENCH), reason="set SPECSERVE_GGUF and SPECSERVE_MT_BENCH")
@pytest.mark.usefixtures("cuda_float32")
def test_the_shipped_head_is_lossless_under_fp8_weights():
    """float32 on CUDA, the GGUF's codes in the block GEMM: EAGLE-3 chains and trees of the shipped head give
    FP8 without speculation's output token for token."""
    from specserve.prompt_files import load_prompt_file

    conversations = load_prompt_file(MT_BENCH)[:12]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    fp8 = dict(dtype="float32", quantization="fp8")
    _, want = _greedy_first_turns(conversations, params, **fp8)
    for spec in ({"num_speculative_tokens": 3}, {"speculative_token_tree": "[(0,), (1,), (0, 0), (0, 0, 0)]"}):
        _, got = _greedy_first_turns(conversations, params, speculative_config={
            "method": "eagle3", "model": "smollm2-135m-eagle3", **spec}, **fp8)
        assert got == want, spec


def _perplexity(quantization: str | None) -> float:
    """The held-out text's perplexity under the model, one causal pass in bfloat16."""
    from specserve.bench.fidelity import perplexity
    from specserve.models.loader import build_model, load_tokenizer, open_model_source
    from specserve.train.attention import CausalAttention
    from specserve.train.features import attention_in_torch

    source = open_model_source(GGUF)
    ids = load_tokenizer(source)(HELDOUT.read_text())["input_ids"]
    model, arch = build_model(source, torch.bfloat16, "cuda", CausalAttention(), quantization=quantization)
    attention_in_torch(model)
    return perplexity(model, arch, ids, "cuda")


@pytest.mark.skipif(not GGUF, reason="set SPECSERVE_GGUF to the default model's .gguf")
def test_fp8_perplexity_rises_under_two_percent():
    bf16, fp8 = _perplexity(None), _perplexity("fp8")
    print(f"perplexity: bf16 {bf16:.3f}, FP8 {fp8:.3f} ({fp8 / bf16 - 1:+.2%})")
    assert fp8 < 1.02 * bf16


@pytest.mark.usefixtures("cuda_float32")
def test_fp8_float32_on_cuda_agrees_with_cpu_and_speculation_is_lossless(tiny_llama, tmp_path):
    """float32 takes the Triton kernels on CUDA, the reference on the CPU: the same sums up to order, but each
    layer rounds its input to e4m3 per token, where a last-bit difference of the norm can move a value across
    a rounding boundary (a step of 2**-4), so CUDA agrees with the CPU rather than equals it. EAGLE-3 chains and
    trees under graphs equal FP8 without speculation on the same device, token for token."""
    from heads import save_eagle_head

    path, hf = tiny_llama
    prompts = [[(7 * i + j) % (hf.config.vocab_size - 3) + 3 for j in range(5 + 9 * i)] for i in range(6)]
    small = dict(max_model_len=256, kv_cache_memory_bytes=256 << 20, quantization="fp8", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cpu = _tokens(LLM(str(path), device="cpu", **{k: v for k, v in small.items() if k != "kv_cache_memory_bytes"}),
                  prompts, params)
    cuda = _tokens(LLM(str(path), device="cuda", **small), prompts, params)
    agree = sum(a == b for x, y in zip(cuda, cpu) for a, b in zip(x, y))
    assert agree >= 0.9 * sum(map(len, cpu))
    head = save_eagle_head(tmp_path / "eagle3", hf.config, "eagle3", seed=2)
    for spec in ({"num_speculative_tokens": 3}, {"speculative_token_tree": "[(0,), (1,), (0, 0), (0, 0, 0)]"}):
        llm = LLM(str(path), device="cuda", speculative_config={"method": "eagle3", "model": str(head),
                                                                "quantization": "fp8", **spec}, **small)
        assert _tokens(llm, prompts, params) == cuda


@pytest.mark.usefixtures("cuda_float32")
def test_fp8_bf16_graphs_run_and_agree_with_eager(tiny_llama):
    """bfloat16 takes torch._scaled_mm (or the table's Triton choice) inside CUDA graphs: per-token activation
    scales are computed on the device, so capture works and replays agree with eager steps (padded batches may
    take other GEMM tiles, so agreement, not equality)."""
    path, hf = tiny_llama
    prompts = [[(5 * i + j) % (hf.config.vocab_size - 3) + 3 for j in range(4 + 7 * i)] for i in range(8)]
    kw = dict(max_model_len=256, kv_cache_memory_bytes=256 << 20, quantization="fp8", dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    graphs = _tokens(LLM(str(path), cudagraph_mode="FULL_AND_PIECEWISE", **kw), prompts, params)
    eager = _tokens(LLM(str(path), cudagraph_mode="NONE", **kw), prompts, params)
    agree = sum(a == b for x, y in zip(graphs, eager) for a, b in zip(x, y))
    assert agree >= 0.9 * sum(map(len, eager))
