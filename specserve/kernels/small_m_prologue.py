"""The input side shared by the small-M projection kernels: x, optionally plus the residual, RMS-normed.

A projection over few tokens is bound by reading its weight, so its input
rows (at most 16 x K) are cheap to reread: every program of the projection
recomputes the prologue for the K chunk it multiplies, instead of a separate
norm kernel writing the normed rows for the projection to read back.

RMSNorm is applied in the same single pass over K: the chunk is multiplied
by the norm weight and fed to the dot, the sum of squares accumulates beside
it, and the caller scales the finished rows by rstd. Rounding follows the
unfused path where it is cheap to: the residual sum is rounded to its dtype
before it is normed, as the torch path stores it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows of every tile: tl.dot needs 16. A projection over fewer tokens masks the rest;
# it is memory-bound, so the idle rows of the MMA cost nothing.
BLOCK_M = 16


@triton.jit
def input_chunk(
    x_ptr, res_ptr, norm_w_ptr, offs_k, M, K, stride_xm, stride_rm,
    ADD: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """(chunk [BLOCK_M, BLOCK_K] float32 ready for the dot, its rows' sums of squares before the norm weight).

    With ADD, the chunk is x + residual rounded to x's dtype, as the unfused path stores it. Nothing is
    stored here: a store in the K loop keeps Triton from prefetching the weight tiles (measured 2-3x
    slower on an H100), so the residual sum is written after the loop (store_residual_sum).
    """
    offs_m = tl.arange(0, BLOCK_M)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    if ADD:
        r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    x = x.to(tl.float32)
    sum_sq = tl.sum(x * x, axis=1)
    if NORM:
        x = x * tl.load(norm_w_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)[None, :]
    return x, sum_sq


@triton.jit
def store_residual_sum(x_ptr, res_ptr, res_out_ptr, M, K, stride_xm, stride_rm, stride_rom,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """res_out = x + residual (the next residual stream), rounded as input_chunk rounds it; one program's job."""
    offs_m = tl.arange(0, BLOCK_M)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
        r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :], mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + offs_m[:, None] * stride_rom + offs_k[None, :], s, mask=mask)


@triton.jit
def norm_scale(sum_sq, K, eps, NORM: tl.constexpr):
    """Per-row factor [BLOCK_M, 1] that finishes the prologue's RMSNorm on an accumulator (1 without norm)."""
    if NORM:
        return (1.0 / tl.sqrt(sum_sq / K + eps))[:, None]
    return tl.full(sum_sq.shape, 1.0, tl.float32)[:, None]


def check_prologue(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None,
                   residual: torch.Tensor | None) -> None:
    """Validate the operands of a small-M projection; raises ValueError naming what is wrong."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(what)

    need(x.dim() == 2 and weight.dim() == 2, f"x [M, K] and weight [N, K] expected, got {tuple(x.shape)} and "
         f"{tuple(weight.shape)}")
    need(x.shape[0] <= BLOCK_M, f"a small-M projection takes at most {BLOCK_M} rows, got {x.shape[0]}")
    need(x.shape[1] == weight.shape[1], f"x has K={x.shape[1]} but weight has K={weight.shape[1]}")
    need(x.dtype == weight.dtype and x.dtype in (torch.float32, torch.bfloat16, torch.float16),
         f"x and weight must share a float32/bfloat16/float16 dtype, got {x.dtype} and {weight.dtype}")
    need(x.device == weight.device, "x and weight must be on one device")
    need(x.stride(1) == 1 and weight.stride(1) == 1, "x and weight need unit stride along K")
    if norm_weight is not None:
        need(norm_weight.shape == (x.shape[1],) and norm_weight.stride(0) == 1,
             f"norm_weight must be a contiguous [{x.shape[1]}] vector")
    if residual is not None:
        need(norm_weight is not None, "a residual is only added in front of an RMSNorm")
        need(residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1,
             "residual must match x in shape and dtype, with unit stride along K")


def dot_in_float32(x: torch.Tensor) -> bool:
    """Whether to multiply in float32: Triton's interpreter multiplies bfloat16 dot operands as raw integer bits."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16
