"""Perplexity of a text under the engine's own model, attention backend and KV cache (of any element type).

The text runs as one request prefilled in chunks: each chunk's keys and values are written to the paged cache
and every query reads the whole context back from it, so an FP8 cache's rounding reaches every logit.
"""
from __future__ import annotations

import math

import torch

from specserve.attention.backend import get_attention_backend
from specserve.attention.kv_quant import kv_cache_torch_dtype
from specserve.attention.metadata import AttentionMetadata
from specserve.models.loader import build_model, open_model_source
from specserve.worker.kv_layout import KVCacheLayout

BLOCK_SIZE = 16


def perplexity(model_path: str, token_ids: list[int], *, kv_cache_dtype: str = "auto", dtype=torch.float32,
               device: str = "cpu", backend: str = "torch", chunk: int = 64) -> float:
    """exp of the mean negative log-likelihood of token_ids[1:], each given the tokens before it."""
    model, arch = build_model(open_model_source(model_path), dtype, device, get_attention_backend(backend),
                              kv_cache_dtype=kv_cache_dtype)
    n = len(token_ids)
    num_blocks = -(-n // BLOCK_SIZE)
    stack = KVCacheLayout.of(arch).allocate(num_blocks, BLOCK_SIZE, kv_cache_torch_dtype(kv_cache_dtype, dtype),
                                            torch.device(device))
    ids = torch.tensor(token_ids, device=device)
    block_table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :]
    nll = 0.0
    with torch.inference_mode():
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            qsl = torch.tensor([0, end - start], dtype=torch.int32)
            seq_lens = torch.tensor([end], dtype=torch.int32)
            metadata = AttentionMetadata(
                num_reqs=1, num_tokens=end - start, max_query_len=end - start, max_seq_len=end,
                query_start_loc=qsl.to(device), seq_lens=seq_lens.to(device), block_table=block_table,
                slot_mapping=torch.arange(start, end, device=device), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
            hidden, _ = model(ids[start:end], torch.arange(start, end, device=device), list(stack.unbind(0)), metadata)
            logprobs = torch.log_softmax(model.compute_logits(hidden).double(), dim=-1)
            targets = ids[start + 1:end + 1]
            nll -= logprobs[:len(targets)].gather(1, targets[:, None]).sum().item()
    return math.exp(nll / (n - 1))
