"""An FP8 GEMM past the small-M kernel's rows: e4m3 by e4m3 on the tensor cores' FP8 path, rowwise scales.

out [M, N] = (x * x_scale) @ (weight * weight_scale)^T for an e4m3 input x [M, K] quantized per token
(x_scale [M, 1]) and an e4m3 weight [N, K] quantized per output row (weight_scale [N]), the operands and
scales torch._scaled_mm takes with rowwise scaling. The small-M kernel (fused_linear.fp8_linear) widens both
operands to float16 and takes at most 32 rows; from a batch-64 decode step up, a projection multiplies
64-row tiles, which Hopper multiplies in e4m3 directly (wgmma). The MMA sums its products in fewer bits than
float32; every promote_k products (the tile's) its sums are added into a float32 accumulator, as cuBLAS
promotes its own. Each output is scaled once after the K loop and rounded once to the output dtype, as
_scaled_mm does.

Which of the two (or cuBLAS) a projection runs is the measured choice table's (fp8_gemm_choice.py), with this
kernel's tile (fp8_gemm_choice.Fp8DotTile). A tile may split K over SPLIT_K programs per output tile, as the
small-M kernel does (split_parts.py): a projection with few output tiles (o_proj and down_proj of an 8B
model, 4,096 columns) otherwise leaves SMs idle. A gate/up projection may end in SiLU-and-mul instead
(fp8_dot_silu_mul): each program accumulates the same columns of the gate and the up halves and stores their
products and each row's largest product, so the [M, 2I] projection is never written and the SiLU-and-mul
launch disappears; the products' row quantization (fp8_rows.quantize_chunked_rows) follows. Under PDL a
program asks L2 for its weight rows' first lines before it waits for the kernel ahead, as the small-M kernel
does (pdl.py). Launches depend on shapes only (CUDA-graph capturable).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.activation import row_amax, silu_times
from specserve.kernels.fp8_gemm_choice import DEFAULT_DOT_TILE, Fp8DotTile
from specserve.kernels.pdl import PREFETCH_LINES, pdl_args, prefetch_and_wait
from specserve.kernels.small_m_prologue import split_k_range
from specserve.kernels.split_parts import counts_in_last, split_counters, sum_parts


@triton.jit
def _mma(a, w, acc, DOT_FP32: tl.constexpr, PROMOTE_K: tl.constexpr):
    if DOT_FP32:
        # The interpreter's (numpy's) dot has no e4m3: widened exactly, summed in IEEE float32.
        return tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    # Hopper's FP8 MMA sums in fewer bits than float32: left to run over all of K (Triton's default on sm_90),
    # the sums drift with K. Every PROMOTE_K products they are added into the float32 accumulator instead, as
    # cuBLAS promotes its FP8 sums (the tile's promote_k, which the choice table's sweep keeps only where its
    # error is no more than cuBLAS's).
    return tl.dot(a, w, acc, max_num_imprecise_acc=PROMOTE_K)


@triton.jit
def _fp8_dot_kernel(
    x_ptr, w_ptr, out_ptr, x_scale_ptr, w_scale_ptr, part_ptr, counter_ptr, amax_ptr,
    M, N, K, k_per, stride_xm, stride_wn, stride_om,
    DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PROMOTE_K: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr,
):
    """Program (m tile, n tile, part): the m tiles of one n tile are neighbours in the launch order, so a
    weight tile read by one is in L2 for the next. With SILU_MUL (unsplit only) the weight is [2N, K], gate rows
    then up rows: a program accumulates the same N columns of both and stores silu(gate) * up [M, N], and each
    row's largest product magnitude to amax_ptr [M, n tiles]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start, k_end = split_k_range(K, k_per, tl.program_id(2), SPLIT_K)
    prefetch_and_wait(w_ptr, offs_n, N, stride_wn, k_start, K, SILU_MUL, PDL, PREFETCH_LINES)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # int64 rows: a vocabulary-sized weight passes 2**31 elements.
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    up_cols = w_ptr + (offs_n + N).to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a_mask = m_mask[:, None]
            w_mask = n_mask[None, :]
        else:
            k_mask = offs_k < k_end
            a_mask = m_mask[:, None] & k_mask[None, :]
            w_mask = k_mask[:, None] & n_mask[None, :]
        a = tl.load(x_rows + offs_k[None, :], mask=a_mask, other=0.0)
        acc = _mma(a, tl.load(w_cols + offs_k[:, None], mask=w_mask, other=0.0), acc, DOT_FP32, PROMOTE_K)
        if SILU_MUL:
            acc_up = _mma(a, tl.load(up_cols + offs_k[:, None], mask=w_mask, other=0.0), acc_up, DOT_FP32,
                          PROMOTE_K)
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        parts = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(parts + tl.program_id(2) * M * N, acc, mask=mask)
        if not counts_in_last(counter_ptr, pid_m * tl.num_programs(1) + pid_n, SPLIT_K):
            return
        acc = sum_parts(parts, mask, M * N, SPLIT_K, BLOCK_M, BLOCK_N)
    x_scale = tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
    acc = acc * tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    acc = acc * x_scale
    out_ty = out_ptr.dtype.element_ty
    if SILU_MUL:
        up = acc_up * tl.load(w_scale_ptr + offs_n + N, mask=n_mask, other=0.0)[None, :]
        # Masked rows and columns multiply zeros: their products are 0, below any row's largest magnitude.
        out = silu_times(acc, up * x_scale, out_ty)
        tl.store(amax_ptr + offs_m * tl.num_programs(1) + pid_n, row_amax(out), mask=m_mask)
    else:
        out = acc.to(out_ty)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask)


def fp8_dot(
    x: torch.Tensor,  # [M, K] float8_e4m3fn
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N] float32
    x_scale: torch.Tensor,  # [M, 1] float32
    out_dtype: torch.dtype = torch.bfloat16,
    tile: Fp8DotTile | None = None,
) -> torch.Tensor:
    """(x * x_scale) @ (weight * weight_scale)^T as out_dtype [M, N], in tile (DEFAULT_DOT_TILE if None)."""
    check_fp8_operands(x, weight, weight_scale, x_scale, out_dtype)
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=out_dtype, device=x.device)
    _launch(x, weight, weight_scale, x_scale, out, None, tile or DEFAULT_DOT_TILE)
    return out


def fp8_dot_silu_mul(
    x: torch.Tensor,  # [M, K] float8_e4m3fn
    weight: torch.Tensor,  # [2I, K] float8_e4m3fn: the gate's rows, then the up's
    weight_scale: torch.Tensor,  # [2I] float32
    x_scale: torch.Tensor,  # [M, 1] float32
    out_dtype: torch.dtype = torch.bfloat16,
    tile: Fp8DotTile | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate) * up as out_dtype [M, I], amax [M, cdiv(I, block_n)] float32): the gate/up projection's two
    halves rounded to out_dtype as fp8_dot stores them, multiplied as activation.silu_and_mul rounds, and each
    row's largest product magnitude in each program's block_n columns (fp8_rows.quantize_chunked_rows' amax).
    The [M, 2I] projection is never stored. A program reads block_n rows of each half; K is not split."""
    check_fp8_operands(x, weight, weight_scale, x_scale, out_dtype)
    tile = tile or DEFAULT_DOT_TILE
    if weight.shape[0] % 2 or tile.split_k != 1:
        raise ValueError(f"a gate/up weight of an even number of rows and an unsplit tile expected, got "
                         f"{weight.shape[0]} rows and split_k {tile.split_k}")
    m, inter = x.shape[0], weight.shape[0] // 2
    out = torch.empty((m, inter), dtype=out_dtype, device=x.device)
    amax = torch.empty((m, triton.cdiv(inter, tile.block_n)), dtype=torch.float32, device=x.device)
    _launch(x, weight, weight_scale, x_scale, out, amax, tile)
    return out, amax


def _launch(x, weight, weight_scale, x_scale, out, amax, tile: Fp8DotTile) -> None:
    """The kernel over x into out [M, N] (with amax: silu(gate) * up of a [2N, K] gate/up weight)."""
    m, k = x.shape
    n = out.shape[1]
    if m == 0 or n == 0:
        return
    grid = (triton.cdiv(m, tile.block_m), triton.cdiv(n, tile.block_n), tile.split_k)
    parts, counters, k_per = out, out, k
    if tile.split_k > 1:
        parts = torch.empty((tile.split_k, m, n), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, grid[0] * grid[1])
        k_per = triton.cdiv(triton.cdiv(k, tile.split_k), tile.block_k) * tile.block_k
    _fp8_dot_kernel[grid](
        x, weight, out, x_scale, weight_scale, parts, counters, amax if amax is not None else out, m, n, k, k_per,
        x.stride(0), weight.stride(0), out.stride(0), DOT_FP32=x.device.type == "cpu",
        EVEN_K=k_per % tile.block_k == 0 and k % tile.block_k == 0, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, SPLIT_K=tile.split_k, PROMOTE_K=tile.promote_k, SILU_MUL=amax is not None,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_args(x.device), PREFETCH_LINES=PREFETCH_LINES,
    )


def check_fp8_operands(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, x_scale: torch.Tensor,
                       out_dtype: torch.dtype) -> None:
    """Validate e4m3 rows x [M, K] with x_scale [M, 1] and an e4m3 weight [N, K] with weight_scale [N] (float32
    scales) for a projection into out_dtype; raises ValueError naming what is wrong."""
    from specserve.quantization.fp8 import FP8_DTYPE

    m, n = x.shape[0], weight.shape[0]
    if x.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE or x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{FP8_DTYPE} x [M, K] and weight [N, K] expected, got {x.dtype} {tuple(x.shape)} and "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if weight_scale.shape != (n,) or x_scale.shape != (m, 1) or {weight_scale.dtype, x_scale.dtype} != {torch.float32}:
        raise ValueError(f"float32 weight_scale [{n}] and x_scale [{m}, 1] expected, got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)} and {x_scale.dtype} {tuple(x_scale.shape)}")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the output must be float32, bfloat16 or float16, got {out_dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1 or x.device != weight.device:
        raise ValueError("x and weight must share a device and have unit stride along K")
