"""Perplexity of a text under the engine's own model, attention backend and KV cache (of any element type).

The text runs as one request prefilled in chunks (specserve/bench/fidelity.py, paged_pass_logits): each chunk's
keys and values are written to the paged cache and every query reads the whole context back from it, so an FP8
cache's rounding reaches every logit.
"""
from __future__ import annotations

import math

import torch

from specserve.attention.backend import get_attention_backend
from specserve.bench.fidelity import paged_pass_logits
from specserve.models.loader import build_model, open_model_source


def perplexity(model_path: str, token_ids: list[int], *, kv_cache_dtype: str = "auto", dtype=torch.float32,
               device: str = "cpu", backend: str = "torch", chunk: int = 64) -> float:
    """exp of the mean negative log-likelihood of token_ids[1:], each given the tokens before it."""
    model, arch = build_model(open_model_source(model_path), dtype, device, get_attention_backend(backend),
                              kv_cache_dtype=kv_cache_dtype)
    n = len(token_ids)
    ends = [*range(chunk, n, chunk), n]
    logprobs = torch.log_softmax(paged_pass_logits(model, arch, token_ids, ends, kv_cache_dtype, device).double(), -1)
    targets = torch.tensor(token_ids[1:], device=logprobs.device)
    return math.exp(-logprobs[:-1].gather(1, targets[:, None]).sum().item() / (n - 1))
