"""How close a changed model (FP8 weights, an FP8 KV cache) stays to the original: greedy agreement and perplexity,
shared by benchmarks/fp8_accuracy.py and the FP8 GPU tests.

Greedy outputs part for good at the first near-tie the two models round differently, so agreement reads three
ways: up to the first difference, position by position, and teacher-forced (each position of the original's
output, the changed model's argmax given the same prefix). The one-pass measures score a sequence in one causal
pass of a model built with CausalAttention and torch attention (train/features.attention_in_torch), which has no
KV cache; the paged pass runs it as the engine does, as one request in chunks through the model's attention
backend and a paged KV cache of any element type, so an FP8 cache's rounding reaches every logit.
"""
from __future__ import annotations

import math

import torch

from specserve.attention.kv_quant import kv_cache_torch_dtype
from specserve.attention.metadata import AttentionMetadata
from specserve.train.attention import DenseBatch
from specserve.worker.kv_layout import KVCacheLayout

# The paged pass's cache blocks, in tokens.
BLOCK_SIZE = 16


def prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of positions where two greedy outputs agree, each counted up to its first difference."""
    agreed = sum(next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x)) for x, y in zip(a, b))
    return agreed / sum(len(x) for x in a)


def positionwise_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of positions where two greedy outputs hold the same token, past any difference too."""
    return sum(s == t for x, y in zip(a, b) for s, t in zip(x, y)) / sum(len(x) for x in a)


@torch.no_grad()
def one_pass_logits(model, arch, ids: list[int], device: str, first: int = 0) -> torch.Tensor:
    """The float32 logits of positions first.. of one causal pass over ids."""
    t = torch.tensor(ids, device=device)
    hidden, _ = model(t, torch.arange(len(ids), device=device), [None] * arch.num_layers, DenseBatch(1, len(ids)))
    return model.compute_logits(hidden[first:])


@torch.inference_mode()
def paged_pass_logits(model, arch, ids: list[int], ends: list[int], kv_cache_dtype: str, device: str,
                      first: int = 0) -> torch.Tensor:
    """The float32 logits of positions first.. of ids run as one request in chunks ending at `ends` (rising, the
    last len(ids)) through model's attention backend: each chunk's keys and values are written to a paged cache of
    kv_cache_dtype and every query reads its whole context back from it. A chunk of one token is a decode step."""
    dtype = model.model.embed_tokens.weight.dtype
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    stack = KVCacheLayout.of(arch).allocate(num_blocks, BLOCK_SIZE, kv_cache_torch_dtype(kv_cache_dtype, dtype),
                                            torch.device(device))
    caches = list(stack.unbind(0))
    tokens = torch.tensor(ids, device=device)
    block_table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :]
    logits, start = [], 0
    for end in ends:
        qsl = torch.tensor([0, end - start], dtype=torch.int32)
        seq_lens = torch.tensor([end], dtype=torch.int32)
        metadata = AttentionMetadata(
            num_reqs=1, num_tokens=end - start, max_query_len=end - start, max_seq_len=end,
            query_start_loc=qsl.to(device), seq_lens=seq_lens.to(device), block_table=block_table,
            slot_mapping=torch.arange(start, end, device=device), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
        hidden, _ = model(tokens[start:end], torch.arange(start, end, device=device), caches, metadata)
        if end > first:
            logits.append(model.compute_logits(hidden[max(0, first - start):]).float())
        start = end
    return torch.cat(logits)


def teacher_forced_agreement(model, arch, prompts: list[list[int]], outputs: list[list[int]], device: str,
                             kv_cache_dtype: str | None = None) -> float:
    """The share of the outputs' tokens that are model's argmax given the prompt and the output before them. With
    kv_cache_dtype None in one causal pass (a model built for it: module docstring); with a cache dtype in the
    paged pass of the engine's decode path, the prompt one chunk, then each output token a step of its own (a
    model built with the engine's attention backend)."""
    hits = total = 0
    for prompt, out in zip(prompts, outputs):
        ids, first = prompt + out[:-1], len(prompt) - 1
        if kv_cache_dtype is None:
            logits = one_pass_logits(model, arch, ids, device, first)
        else:
            logits = paged_pass_logits(model, arch, ids, list(range(len(prompt), len(ids) + 1)), kv_cache_dtype,
                                       device, first)
        hits += (logits.argmax(-1).cpu() == torch.tensor(out)).sum().item()
        total += len(out)
    return hits / total


def perplexity(model, arch, ids: list[int], device: str) -> float:
    """exp(mean NLL) of ids[1:], each given the tokens before it, in one pass."""
    logits = one_pass_logits(model, arch, ids[:-1], device)
    return math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:], device=device)).item())


def decode_path_agreement(source, prompts: list[list[int]], outputs: list[list[int]], dtype: torch.dtype, device: str,
                          quantization: str | None = None, kv_cache_dtype: str = "auto") -> float:
    """teacher_forced_agreement through the decode path of source's model (models/loader.ModelSource) as the
    engine builds it on device: its attention backend, quantization and KV cache dtype."""
    from specserve.attention.backend import get_attention_backend
    from specserve.models.loader import build_model

    backend = get_attention_backend("triton" if device.startswith("cuda") else "torch")
    model, arch = build_model(source, dtype, device, backend, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    return teacher_forced_agreement(model, arch, prompts, outputs, device, kv_cache_dtype)
