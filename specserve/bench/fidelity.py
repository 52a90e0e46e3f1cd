"""How close a changed model (FP8 weights, an FP8 KV cache) stays to the original: greedy agreement and perplexity,
shared by benchmarks/fp8_accuracy.py and the FP8 GPU tests.

Greedy outputs part for good at the first near-tie the two models round differently, so agreement reads three
ways: up to the first difference, position by position, and teacher-forced (each position of the original's
output, the changed model's argmax given the same prefix). The one-pass measures score a sequence in one causal
pass of a model built with CausalAttention and torch attention (train/features.attention_in_torch).
"""
from __future__ import annotations

import math

import torch

from specserve.train.attention import DenseBatch


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


def teacher_forced_agreement(model, arch, prompts: list[list[int]], outputs: list[list[int]], device: str) -> float:
    """The share of the outputs' tokens that are model's argmax given the prompt and the output before them."""
    hits = total = 0
    for prompt, out in zip(prompts, outputs):
        logits = one_pass_logits(model, arch, prompt + out[:-1], device, len(prompt) - 1)
        hits += (logits.argmax(-1).cpu() == torch.tensor(out)).sum().item()
        total += len(out)
    return hits / total


def perplexity(model, arch, ids: list[int], device: str) -> float:
    """exp(mean NLL) of ids[1:], each given the tokens before it, in one pass."""
    logits = one_pass_logits(model, arch, ids[:-1], device)
    return math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:], device=device)).item())
