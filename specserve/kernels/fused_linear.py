"""Small-M projection in Triton: out = prologue(x) @ weight^T for at most 32 tokens, optionally SiLU-and-mul.

For decode and small verify batches a projection is a matrix-vector product
bound by reading its weight; cuBLAS runs a small one at a fraction of the
bandwidth (BENCHMARKS.md, 'Kernel choices'), and the norm before it and the
activation after it are kernels of their own. Here one kernel does all
three: programs own BLOCK_N output columns (the grid covers N), each runs
the prologue of small_m_prologue.py (residual add and RMSNorm: a weight-free
prepass over x for the rows' rstd, then the K loop normalising each chunk as
it loads it), accumulates in float32, and the
epilogue optionally applies SiLU-and-mul to a gate/up weight [2I, K]: each
program accumulates the same columns of both halves and stores
silu(gate) * up [M, I], so the [M, 2I] intermediate is never written.

With TOP the logits never reach memory either: each program stores the
first maximum of its columns per row, or its TOP best (after rounding to
the weight's dtype, as the unfused projection stores them), and argmax.py's
pick kernel chooses among the programs, so a draft head's lm_head, its
argmax (or a tree's top guesses) and the norm in front of it are two
launches (fused_linear_argmax, fused_linear_topk).

A plain projection (no prologue, no epilogue) may split K over SPLIT_K
programs per column tile (split_parts.py): one with few columns and a long
K (an EAGLE-3 head's down_proj, 576 x 6144: 36 tiles of 16 columns on 132
SMs) otherwise leaves most SMs idle while a few stream the weight. The
prologues and epilogues stay unsplit: each would have to be redone or
deferred to the last part. Launches depend on shapes only (CUDA-graph capturable).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.activation import row_amax, silu_times
from specserve.kernels.argmax import pick_chunks
from specserve.kernels.pdl import PREFETCH_LINES, pdl_args, prefetch_and_wait
from specserve.kernels.small_m_configs import SmallMConfig, linear_config
from specserve.kernels.small_m_prologue import (MAX_ROWS, check_prologue, dot_in_float32, input_chunk,
                                                 prologue_meta, prologue_rows, row_rstd, split_k_range,
                                                 store_residual_slice)
from specserve.kernels.split_parts import counts_in_last, split_counters, sum_parts
from specserve.spec_decode.pick_scatter import PickScatter


@triton.jit
def _fused_linear_kernel(
    x_ptr, res_ptr, res_out_ptr, norm_w_ptr, w_ptr, out_ptr, idx_ptr, part_ptr, counter_ptr, w_scale_ptr, x_scale_ptr,
    amax_ptr, M, N, K, k_per, stride_xm, stride_rm, stride_rom, stride_wn, stride_om, eps,
    ADD: tl.constexpr, NORM: tl.constexpr, SILU_MUL: tl.constexpr, AMAX: tl.constexpr, TOP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    W_SCALED: tl.constexpr, X_SCALED: tl.constexpr,
    COMPACT: tl.constexpr, ROWS: tl.constexpr, PRE_K: tl.constexpr, SLICE_K: tl.constexpr, LATE_RSTD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
):
    """With SPLIT_K > 1 (plain projections only), program (pid, s) of the grid (column tiles, SPLIT_K) sums
    K from s * k_per (a multiple of BLOCK_K) into part_ptr's float32 [SPLIT_K, M, N]; counter_ptr holds a
    zero per column tile, back at zero when the launch ends. With W_SCALED the weight is FP8 with a float32 scale
    per output column (w_scale_ptr [N]), with X_SCALED x is FP8 with one per row (x_scale_ptr [M], no prologue):
    both operands are widened exactly to the dot's dtype and the float32 sums scaled once, after the K loop.
    With AMAX (and SILU_MUL) each row's largest product magnitude goes to amax_ptr [M, programs]."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start, k_end = split_k_range(K, k_per, tl.program_id(1), SPLIT_K)
    prefetch_and_wait(w_ptr, offs_n, N, stride_wn, k_start, K, SILU_MUL, PDL, PREFETCH_LINES)
    offs_m = tl.arange(0, BLOCK_M)
    w_ty = w_ptr.dtype.element_ty
    # An FP8 weight multiplies in the output's dtype, into which e4m3 widens exactly; with an FP8 input too, in
    # float16, which holds every e4m3 value and into which the hardware widens e4m3 in one instruction (bfloat16
    # takes several: measured twice as slow, BENCHMARKS.md 'FP8 weights').
    dot_ty = tl.float32 if DOT_FP32 else (tl.float16 if X_SCALED else (out_ptr.dtype.element_ty if W_SCALED
                                                                         else w_ty))
    # int64 rows: a vocabulary-sized weight passes 2**31 elements.
    gate_rows = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    up_rows = w_ptr + (offs_n + N).to(tl.int64)[None, :] * stride_wn

    res_sum, rstd = prologue_rows(x_ptr, res_ptr, pid, M, K, stride_xm, stride_rm, eps,
                                  ADD, NORM, COMPACT, ROWS, PRE_K, SLICE_K, BLOCK_M, LATE_RSTD)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if X_SCALED:
            # Loaded as it is and widened once (input_chunk's prologue would round-trip it through float32).
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0).to(dot_ty)
        else:
            a = input_chunk(x_ptr, res_ptr, norm_w_ptr, rstd, offs_k, M, K, stride_xm, stride_rm,
                            ADD, NORM, COMPACT, ROWS, BLOCK_M, LATE_RSTD).to(dot_ty)
        w_mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
        w = tl.load(gate_rows + offs_k[:, None], mask=w_mask, other=0.0)
        # IEEE: float32 operands must not silently drop to tf32.
        acc = tl.dot(a, w.to(dot_ty), acc, input_precision="ieee")
        if SILU_MUL:
            w_up = tl.load(up_rows + offs_k[:, None], mask=w_mask, other=0.0)
            acc_up = tl.dot(a, w_up.to(dot_ty), acc_up, input_precision="ieee")
    if NORM and LATE_RSTD:
        # One per accumulator row; 0 past the ROWS token rows, whose COMPACT repeats are never stored.
        rstd = row_rstd(x_ptr, res_ptr, M, K, stride_xm, stride_rm, eps, ADD, ROWS, PRE_K, BLOCK_M)
        acc = acc * rstd[:, None]
        acc_up = acc_up * rstd[:, None]

    if SPLIT_K > 1:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        parts = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(parts + tl.program_id(1) * M * N, acc, mask=mask)
        if not counts_in_last(counter_ptr, pid, SPLIT_K):
            return
        acc = sum_parts(parts, mask, M * N, SPLIT_K, BLOCK_M, BLOCK_N)
    if W_SCALED:
        acc = acc * tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
        if SILU_MUL:
            acc_up = acc_up * tl.load(w_scale_ptr + offs_n + N, mask=offs_n < N, other=0.0)[None, :]
    if X_SCALED:
        x_scale = tl.load(x_scale_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
        acc = acc * x_scale
        if SILU_MUL:
            acc_up = acc_up * x_scale
    if TOP > 0:
        # Per row, the TOP best of this program's columns, best first, ties to the first; out holds [M, programs
        # x TOP] float32 values. A NaN never wins (as in argmax.py's chunk kernel), so a row of NaN still picks
        # columns in range.
        logits = acc.to(w_ty).to(tl.float32)
        logits = tl.where((offs_n < N)[None, :] & (logits == logits), logits, float("-inf"))
        # The columns still to choose from, N for those taken (or past N): -inf columns stay distinct.
        cols = tl.where(offs_n < N, offs_n, N)[None, :] + tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for rank in tl.static_range(TOP):
            top = tl.max(logits, 1)
            first = tl.min(tl.where(logits == top[:, None], cols, N), 1)
            tl.store(out_ptr + offs_m * stride_om + pid * TOP + rank, top, mask=offs_m < M)
            tl.store(idx_ptr + offs_m * stride_om + pid * TOP + rank, first, mask=offs_m < M)
            taken = cols == first[:, None]
            logits = tl.where(taken, float("-inf"), logits)
            cols = tl.where(taken, N, cols)
    else:
        out_ty = out_ptr.dtype.element_ty
        # Rounded to the output dtype where the unfused path stores a tensor, so the paths differ in
        # reduction order only.
        out = silu_times(acc, acc_up, out_ty) if SILU_MUL else acc.to(out_ty)
        if AMAX:
            # Rows and columns past M and N multiplied zeros: their products are 0.
            tl.store(amax_ptr + offs_m * tl.num_programs(0) + pid, row_amax(out), mask=offs_m < M)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask)
    if ADD:
        store_residual_slice(res_out_ptr, res_sum, pid, M, K, stride_rom, ROWS, SLICE_K)


def fused_linear(
    x: torch.Tensor,  # [M, K], M <= 32
    weight: torch.Tensor,  # [N, K]; with silu_mul [2I, K]: the gate rows, then the up rows
    *,
    norm_weight: torch.Tensor | None = None,  # [K]: RMSNorm x (or x + residual) first
    eps: float = 0.0,
    residual: torch.Tensor | None = None,  # [M, K]: normalise x + residual (needs norm_weight)
    silu_mul: bool = False,
    config: SmallMConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, x + residual): out = norm(x [+ residual]) @ weight^T [M, N], or silu(gate) * up [M, I].

    x + residual is a new tensor (the next residual stream), None without a residual. Inputs are
    never written. config overrides small_m_configs' choice (for benchmarking). An FP8 weight takes
    fp8_linear instead.
    """
    check_prologue(x, weight, norm_weight, residual)
    if silu_mul and weight.shape[0] % 2:
        raise ValueError(f"a gate/up weight needs an even number of rows, got {weight.shape[0]}")
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    residual_out = _launch(x, weight, norm_weight, eps, residual, silu_mul, config, n, out, None)
    return out, residual_out


def fp8_linear(
    x: torch.Tensor,  # [M, K], M <= 32: FP8 with x_scale, else the output's dtype (float32/bfloat16/float16)
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N] float32: weight row n is weight[n] * weight_scale[n]
    x_scale: torch.Tensor | None = None,  # [M, 1] float32: x row m is x[m] * x_scale[m]
    out_dtype: torch.dtype | None = None,  # with an FP8 x; otherwise x's dtype
    config: SmallMConfig | None = None,
) -> torch.Tensor:
    """(x * x_scale) @ (weight * weight_scale)^T as out_dtype [M, N]: the small-M kernel with an FP8 weight (W8A16),
    and with x_scale an FP8 input too (W8A8); the weight is widened tile by tile, never stored wider."""
    out_dtype = _check_fp8_linear(x, weight, weight_scale, x_scale, out_dtype)
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=out_dtype, device=x.device)
    _launch(x, weight, None, 0.0, None, False, config, weight.shape[0], out, None, scales=(weight_scale, x_scale))
    return out


def fp8_linear_silu_mul(
    x: torch.Tensor,  # [M, K], M <= 32, float8_e4m3fn
    weight: torch.Tensor,  # [2I, K] float8_e4m3fn: the gate's rows, then the up's
    weight_scale: torch.Tensor,  # [2I] float32
    x_scale: torch.Tensor,  # [M, 1] float32
    out_dtype: torch.dtype,
    config: SmallMConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate) * up as out_dtype [M, I], amax [M, programs] float32) of fp8_linear's gate/up projection
    (W8A8): its halves rounded to out_dtype as fp8_linear stores them, multiplied as activation.silu_and_mul
    rounds, and each row's largest product magnitude in each program's columns (fp8_rows.quantize_chunked_rows'
    amax). config.block_n columns of each half a program; K is not split."""
    if x_scale is None:
        raise ValueError("the SiLU-and-mul epilogue takes an FP8 x with its x_scale")
    out_dtype = _check_fp8_linear(x, weight, weight_scale, x_scale, out_dtype)
    m, inter = x.shape[0], weight.shape[0] // 2
    cfg = config or linear_config(weight, wide=True, norm=False, m=m)
    if weight.shape[0] % 2 or cfg.split_k != 1:
        raise ValueError(f"a gate/up weight of an even number of rows and an unsplit tile expected, got "
                         f"{weight.shape[0]} rows and split_k {cfg.split_k}")
    out = torch.empty((m, inter), dtype=out_dtype, device=x.device)
    amax = torch.empty((m, triton.cdiv(inter, cfg.block_n)), dtype=torch.float32, device=x.device)
    _launch(x, weight, None, 0.0, None, True, cfg, inter, out, None, scales=(weight_scale, x_scale), amax=amax)
    return out, amax


def _check_fp8_linear(x, weight, weight_scale, x_scale, out_dtype) -> torch.dtype:
    """Validate fp8_linear's operands (raises ValueError naming what is wrong); returns the output dtype."""
    from specserve.quantization.fp8 import FP8_DTYPE

    m, n = x.shape[0], weight.shape[0]
    if weight.dtype != FP8_DTYPE or weight_scale.shape != (n,) or weight_scale.dtype != torch.float32:
        raise ValueError(f"an {FP8_DTYPE} weight [N, K] and a float32 weight_scale [N] expected, got {weight.dtype} "
                         f"and {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if (x_scale is None) == (x.dtype == FP8_DTYPE):
        raise ValueError(f"an FP8 x takes an x_scale and any other x none; got {x.dtype} x and "
                         f"{'an' if x_scale is not None else 'no'} x_scale")
    out_dtype = out_dtype or x.dtype
    if x_scale is not None and (x_scale.shape != (m, 1) or x_scale.dtype != torch.float32):
        raise ValueError(f"x_scale must be float32 [{m}, 1], got {x_scale.dtype} {tuple(x_scale.shape)}")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the output must be float32, bfloat16 or float16, got {out_dtype}")
    if x.dim() != 2 or m > MAX_ROWS or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M <= {MAX_ROWS}, K] for weight {tuple(weight.shape)} expected, got {tuple(x.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1 or x.device != weight.device:
        raise ValueError("x and weight must share a device and have unit stride along K")
    return out_dtype


def fused_linear_argmax(x: torch.Tensor, weight: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens, x + residual): tokens = (norm(x [+ residual]) @ weight^T).argmax(-1) as int64 [M], the first
    maximum of each row of the logits rounded to the weight's dtype, mapped through token_map if given.
    The keyword arguments are fused_linear_topk's."""
    tokens, residual_out = fused_linear_topk(x, weight, 1, **kwargs)
    return tokens.view(-1), residual_out


def fused_linear_topk(
    x: torch.Tensor,  # [M, K], M <= 32
    weight: torch.Tensor,  # [N, K]
    k: int,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    token_map: torch.Tensor | None = None,  # [N] int64: the id to return for each column
    scatter: PickScatter | None = None,
    config: SmallMConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens, x + residual): the columns of the k largest logits of each row as int64 [M, k], best first, ties
    to the lower column (the logits rounded to the weight's dtype), mapped through token_map if given; with
    scatter, they go where it says and tokens is its out. The prologue and its arguments are fused_linear's."""
    check_prologue(x, weight, norm_weight, residual)
    if token_map is not None and (token_map.shape != (weight.shape[0],) or token_map.dtype != torch.int64):
        raise ValueError(f"token_map must be int64 [{weight.shape[0]}], got {token_map.dtype} {tuple(token_map.shape)}")
    cfg = config or linear_config(weight, wide=False, norm=norm_weight is not None, m=x.shape[0], top=True)
    if not 1 <= k <= min(cfg.block_n, weight.shape[0]):
        raise ValueError(f"k must be between 1 and {min(cfg.block_n, weight.shape[0])} (the columns a program owns "
                         f"and the weight's rows), got {k}")
    programs = triton.cdiv(weight.shape[0], cfg.block_n)
    maxima = torch.empty((x.shape[0], programs * k), dtype=torch.float32, device=x.device)
    firsts = torch.empty((x.shape[0], programs * k), dtype=torch.int32, device=x.device)
    residual_out = _launch(x, weight, norm_weight, eps, residual, False, cfg, weight.shape[0], maxima, firsts, k)
    if scatter is not None:
        return pick_chunks(maxima, firsts, token_map, top=k, scatter=scatter), residual_out
    return pick_chunks(maxima, firsts, token_map, top=k).view(x.shape[0], k), residual_out


def _launch(x, weight, norm_weight, eps, residual, silu_mul, config, n, out, firsts, top=0,
            scales=(None, None), amax=None) -> torch.Tensor | None:
    """Run the kernel over x into out (with firsts: the buffers of each program's top best columns; with amax,
    each program's largest products); returns x + residual. scales: fp8_linear's (weight_scale, x_scale)."""
    weight_scale, x_scale = scales
    m, k = x.shape
    norm = norm_weight is not None
    cfg = config or linear_config(weight, wide=silu_mul, norm=norm, m=m)
    if cfg.split_k > 1:
        extras = [name for name, used in [("norm_weight", norm), ("residual", residual is not None),
                                          ("silu_mul", silu_mul), ("top-k", top > 0)] if used]
        if extras:
            raise ValueError(f"split_k={cfg.split_k} applies to plain projections only, got {', '.join(extras)}")
    residual_out = torch.empty_like(x) if residual is not None else None
    if m == 0 or n == 0:
        return residual_out
    grid = triton.cdiv(n, cfg.block_n)
    parts, counters, k_per = out, out, k
    if cfg.split_k > 1:
        parts = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, grid)
        k_per = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    _fused_linear_kernel[(grid, cfg.split_k)](
        x, residual if residual is not None else x, residual_out if residual_out is not None else out,
        norm_weight if norm_weight is not None else x, weight, out, firsts if firsts is not None else out,
        parts, counters, weight_scale if weight_scale is not None else out, x_scale if x_scale is not None else out,
        amax if amax is not None else out, m, n, k, k_per, x.stride(0), residual.stride(0) if residual is not None else 0,
        residual_out.stride(0) if residual_out is not None else 0, weight.stride(0), out.stride(0), eps,
        ADD=residual is not None, NORM=norm, SILU_MUL=silu_mul, AMAX=amax is not None, TOP=top,
        DOT_FP32=dot_in_float32(x, out.dtype if weight_scale is not None else None),
        W_SCALED=weight_scale is not None, X_SCALED=x_scale is not None,
        **prologue_meta(x, norm, cfg.compact, grid), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_args(x.device), PREFETCH_LINES=PREFETCH_LINES,
    )
    return residual_out
