"""Triton kernel that scatters this step's keys and values into the paged KV cache.

One program per token of slot_mapping. A PAD_SLOT_ID entry masks every store
of its program, so padded tokens write nothing without a host-side filter:
the launch depends only on tensor shapes and is CUDA-graph capturable. An FP8
cache stores keys and values quantized with the layer's scales (kernels/fp8_kv.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.metadata import PAD_SLOT_ID
from specserve.kernels.fp8_kv import cache_scales, store_to_cache


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,  # the key and value caches share one layout
    block_size, num_kv_heads, head_dim,
    PAD_SLOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    # A pad slot writes zero heads. (Folding the check into a block comparison
    # also sidesteps the interpreter mistyping a broadcast scalar comparison.)
    heads = tl.where(slot == PAD_SLOT, 0, num_kv_heads)
    mask = (offs_h < heads) & (offs_d < head_dim)

    src_k = token.to(tl.int64) * stride_kt + offs_h * stride_kh + offs_d
    src_v = token.to(tl.int64) * stride_vt + offs_h * stride_vh + offs_d
    # A pad slot's block index is garbage, but every access through it is masked off.
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + offs_h * stride_ch + offs_d

    k = tl.load(k_ptr + src_k, mask=mask)
    v = tl.load(v_ptr + src_v, mask=mask)
    store_to_cache(k_cache_ptr + dst, k, k_scale_ptr, mask, FP8)
    store_to_cache(v_cache_ptr + dst, v, v_scale_ptr, mask, FP8)


def write_kv_cache_triton(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          scales=None) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into kv_cache at slot_mapping.

    kv_cache is [2, num_blocks, block_size, num_kv_heads, head_dim]. Tokens past
    slot_mapping.shape[0] are ignored; PAD_SLOT_ID entries write nothing. An FP8
    cache needs scales (attention/kv_quant.KVScales).
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    # The kernel indexes the innermost dimension with unit stride.
    assert k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.stride(4) == 1
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k_scale, v_scale, fp8 = cache_scales(kv_cache, scales)
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        kv_cache.shape[2], num_kv_heads, head_dim,
        PAD_SLOT=PAD_SLOT_ID,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), FP8=fp8,
    )
