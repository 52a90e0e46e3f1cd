"""Rotary embedding of q and k fused with the paged KV-cache write, in Triton.

Neox style (rotate halves) with float32 cos/sin tables indexed by position,
as models/layers.py RotaryEmbedding. One program per token rotates all of
its query and key heads in place and stores the rotated key and the value at
the token's cache slot, so the keys are read once and the attention backend
no longer writes the cache. A PAD_SLOT_ID slot (or a token past the end of
slot_mapping) writes nothing; the launch depends only on tensor shapes and
is CUDA-graph capturable. An FP8 cache stores them quantized with the layer's
scales (kernels/fp8_kv.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.metadata import PAD_SLOT_ID
from specserve.kernels.fp8_kv import cache_scales, store_to_cache
from specserve.kernels.pdl import pdl_args, wait_for_previous


@triton.jit
def _rotate_heads(ptr, stride_h, num_heads, cos, sin, offs, half, BLOCK_H: tl.constexpr):
    """Rotate num_heads heads at ptr in place; returns the rotated halves as stored (in the heads' dtype)."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    mask = (heads < num_heads) & (offs[None, :] < half)
    lo = ptr + heads * stride_h + offs[None, :]
    x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo + half, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    ty = ptr.dtype.element_ty
    tl.store(lo, y1.to(ty), mask=mask)
    tl.store(lo + half, y2.to(ty), mask=mask)
    return y1.to(ty), y2.to(ty)


@triton.jit
def _rotary_cache_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, positions_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr,
    k_scale_ptr, v_scale_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pos,
    stride_cb, stride_cs, stride_ch,  # the key and value caches share one layout
    num_slots, block_size, num_heads, num_kv_heads, half,
    PAD_SLOT: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    FP8: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    tok = tl.program_id(0)
    tok64 = tok.to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    pos = tl.load(positions_ptr + tok)
    cos = tl.load(cos_ptr + pos * stride_pos + offs, mask=offs < half, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_pos + offs, mask=offs < half, other=0.0)[None, :]

    _rotate_heads(q_ptr + tok64 * stride_qt, stride_qh, num_heads, cos, sin, offs, half, BLOCK_HQ)
    k1, k2 = _rotate_heads(k_ptr + tok64 * stride_kt, stride_kh, num_kv_heads, cos, sin, offs, half, BLOCK_HK)

    # Tokens past the end of slot_mapping count as padding; pad slots write zero heads.
    slot = tl.load(slot_mapping_ptr + tok, mask=tok < num_slots, other=PAD_SLOT)
    written = tl.where(slot == PAD_SLOT, 0, num_kv_heads)
    heads = tl.arange(0, BLOCK_HK)[:, None]
    mask = (heads < written) & (offs[None, :] < half)
    # A pad slot's block index is garbage, but every access through it is masked off.
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + heads * stride_ch + offs[None, :]
    src_v = v_ptr + tok64 * stride_vt + heads * stride_vh + offs[None, :]
    store_to_cache(k_cache_ptr + dst, k1, k_scale_ptr, mask, FP8)
    store_to_cache(k_cache_ptr + dst + half, k2, k_scale_ptr, mask, FP8)
    store_to_cache(v_cache_ptr + dst, tl.load(src_v, mask=mask), v_scale_ptr, mask, FP8)
    store_to_cache(v_cache_ptr + dst + half, tl.load(src_v + half, mask=mask), v_scale_ptr, mask, FP8)


def rotary_and_cache(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [max_positions, head_dim // 2] float32
    sin: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [<= num_tokens] int64, PAD_SLOT_ID writes nothing
    scales=None,  # attention/kv_quant.KVScales, for an FP8 kv_cache
) -> None:
    """Rotate q and k in place and write the rotated k and v into kv_cache at slot_mapping."""
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    assert head_dim % 2 == 0 and cos.shape[1] == half and cos.stride() == sin.stride()
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.stride(4) == 1
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k_scale, v_scale, fp8 = cache_scales(kv_cache, scales)
    _rotary_cache_kernel[(num_tokens,)](
        q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        slot_mapping.shape[0], kv_cache.shape[2], num_heads, num_kv_heads, half,
        PAD_SLOT=PAD_SLOT_ID,
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half), FP8=fp8, **pdl_args(q.device),
    )
