"""Small-M qkv projection with rotary embedding and the paged KV-cache write in its epilogue, in Triton.

One kernel for an attention layer's whole input side at <= 32 tokens: the
prologue of small_m_prologue.py (residual add and RMSNorm), the fused q/k/v
projection, the optional qkv bias, neox rotary embedding of q and k (float32
cos/sin tables [max_positions, head_dim / 2], as models/layers.py
RotaryEmbedding), and the store of the rotated keys and the values at the
tokens' cache slots. Only q comes back, [M, num_heads, head_dim] for the
attention kernel; k and v exist in the cache alone.

A program owns BLOCK_P rotary pairs (d, d + head_dim / 2) of one head and
accumulates them as two [BLOCK_M, BLOCK_P] halves, so rotate-halves pairs live in
the same program and need no slicing; several programs share a wide head
(8B: four of 16 pairs) to give the grid enough programs. Programs of value
heads skip the rotation. A PAD_SLOT_ID slot (or a token past the end of
slot_mapping) writes nothing to the cache; an FP8 cache stores keys and values
quantized with the layer's scales (kernels/fp8_kv.py). Launches depend on shapes only.

A rank's qkv under tensor parallelism has few heads (Llama-3-8B at TP=2: 24 heads of 2 pair tiles, 48
programs on 132 SMs), so the config may split K over SPLIT_K programs per (head, pair tile), as
fused_linear.py splits plain projections: every part redoes the prologue's row statistics (a few KB of x
from L2), stores its float32 partial sums to a workspace and counts itself in; the last adds the parts in
part order (the same sum every run) and runs the epilogue. Part 0 alone stores its slice of x + residual.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.metadata import PAD_SLOT_ID
from specserve.kernels.fp8_kv import cache_scales, store_to_cache
from specserve.kernels.pdl import PREFETCH_LINES, pdl_args, prefetch_weight_rows, wait_for_previous
from specserve.kernels.small_m_configs import SmallMConfig, qkv_config
from specserve.kernels.small_m_prologue import (check_prologue, dot_in_float32, input_chunk, prologue_meta,
                                                 prologue_rows, row_rstd, split_k_range, store_residual_slice)
from specserve.kernels.split_parts import counts_in_last, split_counters, sum_parts


@triton.jit
def _finish_half(acc, bias_ptr, cols, col_mask, out_ptr, BIAS: tl.constexpr):
    """A half-head accumulator as the unfused path stores the projection: biased, rounded to out's dtype."""
    y = acc
    if BIAS:
        y += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return y.to(out_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _store_cache(cache_ptr, scale_ptr, lo, hi, slots, kv_head, offs_p, half, row_mask,
                 block_size, stride_cb, stride_cs, stride_ch, PAD_SLOT: tl.constexpr, FP8: tl.constexpr):
    mask = row_mask[:, None] & (slots != PAD_SLOT)[:, None] & (offs_p < half)[None, :]
    # A pad slot's block index is garbage, but every access through it is masked off.
    dst = (slots // block_size * stride_cb + slots % block_size * stride_cs)[:, None] + kv_head * stride_ch
    store_to_cache(cache_ptr + dst + offs_p[None, :], lo, scale_ptr, mask, FP8)
    store_to_cache(cache_ptr + dst + half + offs_p[None, :], hi, scale_ptr, mask, FP8)


@triton.jit
def _qkv_rotary_cache_kernel(
    x_ptr, res_ptr, res_out_ptr, norm_w_ptr, w_ptr, bias_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    k_scale_ptr, v_scale_ptr, cos_ptr, sin_ptr, positions_ptr, slot_mapping_ptr, part_ptr, counter_ptr,
    M, N, K, k_per, num_slots, stride_xm, stride_rm, stride_rom, stride_wn, stride_qm, stride_qh, stride_pos,
    stride_cb, stride_cs, stride_ch,  # the key and value caches share one layout
    block_size, num_heads, num_kv_heads, half, eps,
    ADD: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr, DOT_FP32: tl.constexpr, PAD_SLOT: tl.constexpr,
    COMPACT: tl.constexpr, ROWS: tl.constexpr, PRE_K: tl.constexpr, SLICE_K: tl.constexpr, LATE_RSTD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
):
    """With SPLIT_K > 1, program (head, pair_tile, s) sums K from s * k_per (a multiple of BLOCK_K) into
    part_ptr's float32 [SPLIT_K, M, N] (N: the weight's rows); counter_ptr holds a zero per (head, pair_tile),
    back at zero when the launch ends."""
    head = tl.program_id(0)  # q heads, then k heads, then v heads, as the fused weight's rows
    pair_tile = tl.program_id(1)
    offs_p = pair_tile * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = offs_p < half
    lo_cols = head * 2 * half + offs_p
    k_start, k_end = split_k_range(K, k_per, tl.program_id(2), SPLIT_K)
    if PDL and PREFETCH_LINES > 0:
        # The weight is no kernel's output: its first lines may be asked for before the wait.
        prefetch_weight_rows(w_ptr, lo_cols, N, stride_wn, k_start, K, PREFETCH_LINES)
        prefetch_weight_rows(w_ptr, lo_cols + half, N, stride_wn, k_start, K, PREFETCH_LINES)
    wait_for_previous(PDL)
    w_ty = w_ptr.dtype.element_ty
    dot_ty = tl.float32 if DOT_FP32 else w_ty
    lo_rows = w_ptr + lo_cols.to(tl.int64)[None, :] * stride_wn
    hi_rows = lo_rows + half * stride_wn

    # The programs in order, for the slices of x + residual each stores.
    program = head * tl.num_programs(1) + pair_tile
    res_sum, rstd = prologue_rows(x_ptr, res_ptr, program, M, K, stride_xm, stride_rm, eps,
                                  ADD, NORM, COMPACT, ROWS, PRE_K, SLICE_K, BLOCK_M, LATE_RSTD)

    # The epilogue's loads are issued before the weight loop, so their chain (position, then its cos and
    # sin) is in flight while the weights stream instead of adding its latency after them.
    offs_m = tl.arange(0, BLOCK_M)
    row_mask = offs_m < M
    # Value heads load the tables too (a few hundred bytes from L2) and leave them unused.
    pos = tl.load(positions_ptr + offs_m, mask=row_mask, other=0)
    table = pos[:, None] * stride_pos + offs_p[None, :]
    table_mask = row_mask[:, None] & p_mask[None, :]
    cos = tl.load(cos_ptr + table, mask=table_mask, other=0.0)
    sin = tl.load(sin_ptr + table, mask=table_mask, other=0.0)
    # Tokens past the end of slot_mapping count as padding.
    slots = tl.load(slot_mapping_ptr + offs_m, mask=offs_m < num_slots, other=PAD_SLOT)

    if ADD:
        if tl.program_id(2) == 0:
            store_residual_slice(res_out_ptr, res_sum, program, M, K, stride_rom, ROWS, SLICE_K)

    acc_lo = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = input_chunk(x_ptr, res_ptr, norm_w_ptr, rstd, offs_k, M, K, stride_xm, stride_rm,
                        ADD, NORM, COMPACT, ROWS, BLOCK_M, LATE_RSTD).to(dot_ty)
        w_mask = (offs_k[:, None] < K) & p_mask[None, :]
        w_lo = tl.load(lo_rows + offs_k[:, None], mask=w_mask, other=0.0)
        w_hi = tl.load(hi_rows + offs_k[:, None], mask=w_mask, other=0.0)
        # IEEE: float32 operands must not silently drop to tf32.
        acc_lo = tl.dot(a, w_lo.to(dot_ty), acc_lo, input_precision="ieee")
        acc_hi = tl.dot(a, w_hi.to(dot_ty), acc_hi, input_precision="ieee")
    if NORM and LATE_RSTD:
        # One per accumulator row; 0 past the ROWS token rows, whose COMPACT repeats are never stored.
        rstd = row_rstd(x_ptr, res_ptr, M, K, stride_xm, stride_rm, eps, ADD, ROWS, PRE_K, BLOCK_M)
        acc_lo = acc_lo * rstd[:, None]
        acc_hi = acc_hi * rstd[:, None]
    if SPLIT_K > 1:
        part_mask = row_mask[:, None] & p_mask[None, :]
        lo_parts = part_ptr + offs_m[:, None] * N + lo_cols[None, :]
        tl.store(lo_parts + tl.program_id(2) * M * N, acc_lo, mask=part_mask)
        tl.store(lo_parts + tl.program_id(2) * M * N + half, acc_hi, mask=part_mask)
        if not counts_in_last(counter_ptr, program, SPLIT_K):
            return
        acc_lo = sum_parts(lo_parts, part_mask, M * N, SPLIT_K, BLOCK_M, BLOCK_P)
        acc_hi = sum_parts(lo_parts + half, part_mask, M * N, SPLIT_K, BLOCK_M, BLOCK_P)

    out_ty = q_ptr.dtype.element_ty
    lo = _finish_half(acc_lo, bias_ptr, lo_cols, p_mask, q_ptr, BIAS)
    hi = _finish_half(acc_hi, bias_ptr, lo_cols + half, p_mask, q_ptr, BIAS)

    if head < num_heads + num_kv_heads:
        lo, hi = lo * cos - hi * sin, hi * cos + lo * sin
    if head < num_heads:
        dst = q_ptr + offs_m[:, None] * stride_qm + head * stride_qh + offs_p[None, :]
        mask = row_mask[:, None] & p_mask[None, :]
        tl.store(dst, lo.to(out_ty), mask=mask)
        tl.store(dst + half, hi.to(out_ty), mask=mask)
    elif head < num_heads + num_kv_heads:
        # Keys in q's dtype, as the unfused path rotates them, before an FP8 cache quantizes them.
        _store_cache(k_cache_ptr, k_scale_ptr, lo.to(out_ty), hi.to(out_ty), slots, head - num_heads, offs_p, half, row_mask,
                     block_size, stride_cb, stride_cs, stride_ch, PAD_SLOT, FP8)
    else:
        _store_cache(v_cache_ptr, v_scale_ptr, lo, hi, slots, head - num_heads - num_kv_heads, offs_p, half,
                     row_mask, block_size, stride_cb, stride_cs, stride_ch, PAD_SLOT, FP8)


def qkv_rotary_cache(
    x: torch.Tensor,  # [M, K], M <= 32
    weight: torch.Tensor,  # [(num_heads + 2 * num_kv_heads) * head_dim, K]: q, k, v heads
    positions: torch.Tensor,  # [>= M] int: the first M are x's
    cos: torch.Tensor,  # [max_positions, head_dim // 2] float32
    sin: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64, PAD_SLOT_ID writes nothing; tokens past its end nothing either
    num_heads: int,
    *,
    bias: torch.Tensor | None = None,  # [(num_heads + 2 * num_kv_heads) * head_dim], added before rotary
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    config: SmallMConfig | None = None,
    scales=None,  # attention/kv_quant.KVScales, for an FP8 kv_cache
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rotated q [M, num_heads, head_dim], x + residual or None); rotated k and v go to kv_cache only.

    The prologue is fused_linear's: norm_weight RMS-normalises x (x + residual, given one) first.
    """
    check_prologue(x, weight, norm_weight, residual)
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.stride(4) != 1:
        raise ValueError("kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], unit stride last")
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    if weight.shape[0] != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
        raise ValueError(f"weight rows {weight.shape[0]} are not (num_heads {num_heads} + 2 x num_kv_heads "
                         f"{num_kv_heads}) x even head_dim {head_dim}")
    k_scale, v_scale, fp8 = cache_scales(kv_cache, scales)
    if kv_cache.dtype != x.dtype and not fp8:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} differs from x's {x.dtype} (and is not FP8)")
    half = head_dim // 2
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != half or cos.stride() != sin.stride() \
            or cos.stride(1) != 1 or cos.dtype != torch.float32:
        raise ValueError(f"cos and sin must be float32 [max_positions, {half}] tables of one layout")
    m = x.shape[0]
    if positions.dim() != 1 or positions.shape[0] < m or slot_mapping.dim() != 1:
        raise ValueError(f"positions must be [>= {m}] and slot_mapping one-dimensional")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{weight.shape[0]}] vector")

    q = torch.empty((m, num_heads, head_dim), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else None
    if m == 0:
        return q, residual_out
    norm = norm_weight is not None
    cfg = config or qkv_config(weight, norm=norm, m=m)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (num_heads + 2 * num_kv_heads, triton.cdiv(half, cfg.block_n), cfg.split_k)
    k = x.shape[1]
    parts, counters, k_per = q, q, k
    if cfg.split_k > 1:
        parts = torch.empty((cfg.split_k, m, weight.shape[0]), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, grid[0] * grid[1])
        k_per = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    _qkv_rotary_cache_kernel[grid](
        x, residual if residual is not None else x, residual_out if residual_out is not None else q,
        norm_weight if norm_weight is not None else x, weight, bias if bias is not None else weight,
        q, k_cache, v_cache, k_scale, v_scale, cos, sin, positions, slot_mapping, parts, counters,
        m, weight.shape[0], k, k_per, min(slot_mapping.shape[0], m), x.stride(0), residual.stride(0) if residual is not None else 0,
        residual_out.stride(0) if residual_out is not None else 0, weight.stride(0), q.stride(0), q.stride(1),
        cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        kv_cache.shape[2], num_heads, num_kv_heads, half, eps,
        ADD=residual is not None, NORM=norm, BIAS=bias is not None,
        DOT_FP32=dot_in_float32(x), PAD_SLOT=PAD_SLOT_ID,
        **prologue_meta(x, norm, cfg.compact, grid[0] * grid[1]), BLOCK_P=cfg.block_n, BLOCK_K=cfg.block_k,
        FP8=fp8, SPLIT_K=cfg.split_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_args(x.device), PREFETCH_LINES=PREFETCH_LINES,
    )
    return q, residual_out
