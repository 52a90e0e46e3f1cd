"""Why is add + RMSNorm + projection slow in the small-M kernel? Kernel variants timed side by side.

    python benchmarks/bench_prologue_variants.py                 # H100 sweep: 2 minutes (113 s measured)
    python benchmarks/bench_prologue_variants.py --full --variants prepass+compact --shapes llama3-8b  # 72 configs each
    TRITON_INTERPRET=1 python benchmarks/bench_prologue_variants.py --check   # CPU: correctness, tiny shapes

specserve/kernels/fused_linear.py runs a plain 576x576 projection at M=1 in
3.3 us on an H100 (as fast as cuBLAS), but with the residual add and RMSNorm
in its prologue (qkv, gate_up) it takes ~12 us, and 2-5x cuBLAS on Llama-3-8B
(benchmarks/results/h100_2026-11-23_fused_linear.txt). Suspects: the per-chunk
cross-thread reduction tl.sum(x * x, axis=1) inside the K loop, the loads of
x, residual and norm weight in the loop, program 0's extra loop storing
x + residual after everyone else is done, and the two tl.dot per K step of
gate_up. Each variant below changes one of these (see RECIPES for one line
each), for every (shape, M, op):

  op  add+norm+qkv        out = rmsnorm(x + res) @ Wqkv^T           (no rotary: the projection alone)
      add+norm+gate_up    out = silu(g) * u, [g, u] = rmsnorm(x + res) @ Wgu^T
      add+norm+o_proj     the same on the o_proj shape (its plain form ran at cuBLAS speed)
  and x + res is written out as the next residual stream (except by "inline/no-store", an isolation run).

References in every group: cuBLAS alone (F.linear: the floor the fused op should reach), cuBLAS plus
the separate kernels the engine runs above 16 tokens (fused_add_rms_norm, F.linear, silu_and_mul: what a
fused kernel must beat), and the current fused_linear.

Every variant and config is first checked against a float64 torch reference (max |out - ref| / max |ref|,
the x + res output too where it is produced); a wrong one is reported and not timed. Times are GPU us per
call from CUDA-graph replays with the weights rotated over >= 200 MB of copies, so DRAM is measured, not
L2 (rotating_time_us of bench_fused_linear.py). Progress goes to stderr, tables to stdout.

Measured on the H100 (benchmarks/results/h100_2026-11-23_prologue_variants.txt): whatever accumulates the
sum of squares inside the main K loop is slow, reduced per chunk (inline) or not (rowvec) alike: ~9-11 us
on SmolLM2, 4-6x cuBLAS on Llama-3-8B. Program 0's store loop costs about 1 us. The weight-free prepass
removes the slowdown: at M=1, 3.8-5.3 us on SmolLM2 and 1.06-1.09x cuBLAS plus kernels on Llama-3-8B.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from bench_fused_linear import PEAK_BYTES_PER_US, ROTATION_BYTES, copies_for, rotating_time_us
from bench_kernels import SHAPES

from specserve.kernels.activation import silu_and_mul
from specserve.kernels.fused_linear import fused_linear
from specserve.kernels.rmsnorm import fused_add_rms_norm
from specserve.kernels.small_m_configs import CANDIDATES, SmallMConfig
from specserve.kernels.small_m_prologue import BLOCK_M, dot_in_float32, row_sum

EPS = 1e-5
# max |out - ref| / max |ref| above which a variant is wrong. The unfused path itself rounds to 16 bits
# up to five times on the way (x + res, the normed row, the projection, silu(gate), the product): ~1% in
# bfloat16 on the GPU, ~2.5% under the CPU interpreter, which truncates to bfloat16 instead of rounding.
# A real bug (a missed rstd or norm weight, a wrong row or column) gives O(1): see make_inputs.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}
INTERPRETER_BF16_TOLERANCE = 5e-2


def tolerance(dtype: torch.dtype, device: str) -> float:
    return INTERPRETER_BF16_TOLERANCE if device == "cpu" and dtype == torch.bfloat16 else TOLERANCE[dtype]


# Kernel switches. Prologue (how RMSNorm's sum of squares is obtained):
PRO_PLAIN = tl.constexpr(0)    # no residual, no norm: a plain projection (the floor of the fused op)
PRO_INLINE = tl.constexpr(1)   # per K chunk tl.sum(x * x, axis=1), as fused_linear did before the prepass
PRO_ROWVEC = tl.constexpr(2)   # elementwise [rows, BLOCK_K] accumulator, reduced once after the loop
PRO_PREPASS = tl.constexpr(3)  # a weight-free loop over K first; the main loop normalises on load
# Who writes x + residual:
RES_NONE = tl.constexpr(0)     # nobody (isolates the cost of the store; the op is incomplete)
RES_PID0 = tl.constexpr(1)     # program 0, in a loop over K after its projection (fused_linear)
RES_SLICE = tl.constexpr(2)    # every program one K slice: loaded before the main loop, stored after
# Gate/up epilogue:
GU_NONE = tl.constexpr(0)      # plain projection
GU_TWO = tl.constexpr(1)       # gate rows and up rows as two tiles, two accumulators (fused_linear)
GU_INTERLEAVED = tl.constexpr(2)  # weight rows interleaved [g0, u0, g1, u1, ...]: one tile, split at the end
# Multiply:
MUL_MMA = tl.constexpr(0)      # tl.dot on a 16-row tile (rows past M masked)
MUL_GEMV_ACC = tl.constexpr(1)  # broadcast multiply into [rows, cols, BLOCK_K] registers, tl.sum after the loop
MUL_GEMV_SUM = tl.constexpr(2)  # broadcast multiply, tl.sum over the chunk every K step


# fused_linear's prologue before the prepass (commit 8f5c1ed's small_m_prologue.py), kept here for the
# inline variants: the sum of squares accumulates beside the dot in the main K loop.
@triton.jit
def input_chunk(
    x_ptr, res_ptr, norm_w_ptr, offs_k, M, K, stride_xm, stride_rm,
    ADD: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """(chunk [BLOCK_M, BLOCK_K] float32 ready for the dot, its rows' sums of squares before the norm weight)."""
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
    """res_out = x + residual, rounded as input_chunk rounds it; one program's job."""
    offs_m = tl.arange(0, BLOCK_M)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
        r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :], mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + offs_m[:, None] * stride_rom + offs_k[None, :], s, mask=mask)


# Triton would compile M=1 apart (it specialises ints equal to 1): variants whose ROWS is 16 share one kernel.
@triton.jit(do_not_specialize=["M"])
def _variant_kernel(
    x_ptr, res_ptr, res_out_ptr, norm_w_ptr, w_ptr, out_ptr,
    M, N, K, stride_xm, stride_rm, stride_rom, stride_wn, stride_om, eps,
    PROLOGUE: tl.constexpr, RES_STORE: tl.constexpr, GATE_UP: tl.constexpr, MUL: tl.constexpr,
    COMPACT: tl.constexpr,  # MMA only: prologue on ROWS rows, broadcast to the 16 rows of the tile
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows of the accumulator: 16 for the MMA, ROWS for the GEMV
    ROWS: tl.constexpr,  # next_power_of_2(M): the rows that hold tokens
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRE_K: tl.constexpr,  # K chunk of the prepass (long: it has no weight tile beside it)
    SLICE_K: tl.constexpr,  # K columns of x + residual each program stores with RES_SLICE
):
    pid = tl.program_id(0)
    ADD: tl.constexpr = PROLOGUE != PRO_PLAIN
    in_ty = x_ptr.dtype.element_ty
    w_ty = w_ptr.dtype.element_ty
    dot_ty = tl.float32 if DOT_FP32 else w_ty
    # Rows the prologue computes: the accumulator's, or only the token rows when COMPACT.
    P_ROWS: tl.constexpr = ROWS if COMPACT else BLOCK_M
    offs_p = tl.arange(0, P_ROWS)

    # Weight rows of this program's tile. Interleaved: 2 * BLOCK_N consecutive rows give BLOCK_N outputs.
    if GATE_UP == GU_INTERLEAVED:
        W_COLS: tl.constexpr = 2 * BLOCK_N
        offs_w = pid * W_COLS + tl.arange(0, W_COLS)
        w_valid = offs_w < 2 * N
    else:
        W_COLS: tl.constexpr = BLOCK_N
        offs_w = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        w_valid = offs_w < N
    # int64 rows: a vocabulary-sized weight passes 2**31 elements.
    w_rows = w_ptr + offs_w.to(tl.int64) * stride_wn
    up_rows = w_rows + N * stride_wn  # GU_TWO: the up half starts N rows further

    # RES_SLICE: this program's slice of x + residual, loaded now so it arrives while the weights stream
    # and is stored after the loop without waiting (a store inside the loop stops the weight prefetch).
    if RES_STORE == RES_SLICE:
        offs_r = tl.arange(0, ROWS)
        offs_s = pid * SLICE_K + tl.arange(0, SLICE_K)
        res_slice = row_sum(x_ptr, res_ptr, offs_r, offs_s, M, K, stride_xm, stride_rm, True)

    # PRO_PREPASS: rstd of the token rows from a loop over x and residual alone, so the main loop has no
    # reduction; then moved onto the prologue's rows (a compare-and-sum, as Triton cannot pad a tensor).
    if PROLOGUE == PRO_PREPASS:
        offs_q = tl.arange(0, ROWS)
        sq = tl.zeros([ROWS, PRE_K], dtype=tl.float32)
        for k0 in range(0, K, PRE_K):
            s = row_sum(x_ptr, res_ptr, offs_q, k0 + tl.arange(0, PRE_K), M, K, stride_xm, stride_rm, True)
            sq += s * s
        rstd_q = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / K + eps)
        rstd = tl.sum(tl.where(offs_p[:, None] == offs_q[None, :], rstd_q[None, :], 0.0), axis=1)

    acc = tl.zeros([BLOCK_M, W_COLS], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MUL == MUL_GEMV_ACC:
        acc3 = tl.zeros([BLOCK_M, W_COLS, BLOCK_K], dtype=tl.float32)
        acc3_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PROLOGUE == PRO_INLINE:
        sum_sq = tl.zeros([P_ROWS], dtype=tl.float32)
    if PROLOGUE == PRO_ROWVEC:
        sq_vec = tl.zeros([P_ROWS, BLOCK_K], dtype=tl.float32)

    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        # The input chunk [P_ROWS, BLOCK_K] in float32, with the norm weight applied where there is one.
        if PROLOGUE == PRO_INLINE:
            # fused_linear's own prologue, reduction in the loop and all.
            a, chunk_sq = input_chunk(x_ptr, res_ptr, norm_w_ptr, offs_k, M, K, stride_xm, stride_rm,
                                      True, True, P_ROWS)
            sum_sq += chunk_sq
        else:
            a = row_sum(x_ptr, res_ptr, offs_p, offs_k, M, K, stride_xm, stride_rm, ADD)
            if PROLOGUE == PRO_ROWVEC:
                sq_vec += a * a
            if PROLOGUE == PRO_PREPASS:
                # Rounded where the unfused RMSNorm rounds: the normed row, then the product with the weight.
                a = (a * rstd[:, None]).to(in_ty).to(tl.float32)
            if ADD:
                a = a * tl.load(norm_w_ptr + offs_k, mask=k_valid, other=0.0).to(tl.float32)[None, :]
        a = a.to(w_ty)

        if MUL == MUL_MMA:
            if COMPACT:
                # Row i of the tile is token row i % ROWS: rows past M repeat tokens and are never stored.
                a = tl.reshape(tl.broadcast_to(a[None, :, :], [BLOCK_M // ROWS, ROWS, BLOCK_K]), [BLOCK_M, BLOCK_K])
            w_mask = k_valid[:, None] & w_valid[None, :]
            w = tl.load(w_rows[None, :] + offs_k[:, None], mask=w_mask, other=0.0)
            # IEEE: float32 operands must not silently drop to tf32.
            acc = tl.dot(a.to(dot_ty), w.to(dot_ty), acc, input_precision="ieee")
            if GATE_UP == GU_TWO:
                w_up = tl.load(up_rows[None, :] + offs_k[:, None], mask=w_mask, other=0.0)
                acc_up = tl.dot(a.to(dot_ty), w_up.to(dot_ty), acc_up, input_precision="ieee")
        else:
            # GEMV: weight tile [cols, BLOCK_K] read along K (coalesced), multiplied by every token row.
            w_mask = w_valid[:, None] & k_valid[None, :]
            a3 = a.to(tl.float32)[:, None, :]
            prod = a3 * tl.load(w_rows[:, None] + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32)[None, :, :]
            if GATE_UP == GU_TWO:
                w_up = tl.load(up_rows[:, None] + offs_k[None, :], mask=w_mask, other=0.0)
                prod_up = a3 * w_up.to(tl.float32)[None, :, :]
            if MUL == MUL_GEMV_ACC:
                acc3 += prod
                if GATE_UP == GU_TWO:
                    acc3_up += prod_up
            else:
                acc += tl.sum(prod, axis=2)
                if GATE_UP == GU_TWO:
                    acc_up += tl.sum(prod_up, axis=2)

    if MUL == MUL_GEMV_ACC:
        acc = tl.sum(acc3, axis=2)
        if GATE_UP == GU_TWO:
            acc_up = tl.sum(acc3_up, axis=2)
    # rstd of the accumulator rows where the loop did not apply it (P_ROWS == BLOCK_M for these prologues).
    scale = tl.full([BLOCK_M], 1.0, tl.float32)
    if PROLOGUE == PRO_INLINE:
        scale = 1.0 / tl.sqrt(sum_sq / K + eps)
    if PROLOGUE == PRO_ROWVEC:
        scale = 1.0 / tl.sqrt(tl.sum(sq_vec, axis=1) / K + eps)

    out_ty = out_ptr.dtype.element_ty
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if GATE_UP == GU_NONE:
        out = (acc * scale[:, None]).to(out_ty)
    else:
        if GATE_UP == GU_INTERLEAVED:
            # Columns 2j and 2j + 1 are gate and up of output j.
            gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        else:
            gate, up = acc, acc_up
        # Rounded where the unfused path stores tensors: the projection, then silu(gate).
        gate = (gate * scale[:, None]).to(out_ty).to(tl.float32)
        up = (up * scale[:, None]).to(out_ty).to(tl.float32)
        out = ((gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32) * up).to(out_ty)
    offs_m = tl.arange(0, BLOCK_M)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask)

    if RES_STORE == RES_SLICE:
        s_mask = (offs_r[:, None] < M) & (offs_s[None, :] < K)
        tl.store(res_out_ptr + offs_r[:, None] * stride_rom + offs_s[None, :], res_slice.to(in_ty), mask=s_mask)
    # Nested, not joined with `and`: the outer test is resolved at compile time, the inner one runs.
    if RES_STORE == RES_PID0:  # noqa: SIM102
        if pid == 0:
            store_residual_sum(x_ptr, res_ptr, res_out_ptr, M, K, stride_xm, stride_rm, stride_rom,
                               P_ROWS, BLOCK_K)


@dataclass(frozen=True)
class Recipe:
    """One kernel variant: its switches and what it tests."""
    name: str
    about: str
    prologue: int = PRO_PREPASS
    res_store: int = RES_SLICE
    gate_up: int = GU_TWO  # for the gate_up op; the others take GU_NONE
    mul: int = MUL_MMA
    compact: bool = False
    full_only: bool = False  # left out of the default sweep (its question is answered by a sibling)

    @property
    def gemv(self) -> bool:
        return self.mul != MUL_MMA


RECIPES = [
    Recipe("ours plain", "no residual, no norm: the bare projection (+ silu epilogue), the floor",
           prologue=PRO_PLAIN, res_store=RES_NONE),
    Recipe("inline/pid0", "fused_linear's former scheme (input_chunk + program 0's store loop)",
           prologue=PRO_INLINE, res_store=RES_PID0),
    Recipe("inline/no-store", "as inline/pid0 without any x+res store: isolates program 0's loop",
           prologue=PRO_INLINE, res_store=RES_NONE),
    Recipe("inline/slice", "as inline/pid0, every program storing one K slice of x+res instead",
           prologue=PRO_INLINE, res_store=RES_SLICE),
    Recipe("rowvec/slice", "elementwise sum-of-squares accumulator in the loop, one tl.sum after it",
           prologue=PRO_ROWVEC),
    Recipe("prepass/slice", "weight-free prepass for rstd, main loop normalises on load: no reduction in it"),
    Recipe("prepass+compact/slice", "prepass, prologue on next_pow2(M) rows only, broadcast to the 16-row tile",
           compact=True),
    Recipe("prepass+compact/1dot", "gate_up: one tl.dot per K step over gate/up-interleaved weight rows",
           compact=True, gate_up=GU_INTERLEAVED),
    Recipe("prepass/1dot", "gate_up: one tl.dot per K step (interleaved rows), 16-row prologue",
           gate_up=GU_INTERLEAVED, full_only=True),
    Recipe("gemv-acc/prepass", "no tl.dot: broadcast multiply into a [rows, cols, K chunk] register "
           "accumulator, reduced after the loop", mul=MUL_GEMV_ACC),
    Recipe("gemv-sum/prepass", "no tl.dot: broadcast multiply, tl.sum over the K chunk every step",
           mul=MUL_GEMV_SUM),
    Recipe("gemv-acc/prepass/il", "gemv-acc with the interleaved gate/up weight (one contiguous tile)",
           mul=MUL_GEMV_ACC, gate_up=GU_INTERLEAVED),
]


RECIPE_NAMES = {r.name for r in RECIPES}


def launch(recipe: Recipe, cfg: SmallMConfig, x: torch.Tensor, weight: torch.Tensor, *,
           residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, silu: bool = False,
           eps: float = EPS, pre_k_max: int = 4096) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [M, N], x + residual or None) of one variant. weight: [N, K], or gate/up [2I, K] with silu
    (rows interleaved for GU_INTERLEAVED). pre_k_max caps the prepass chunk (the CPU check shortens it so
    the tiny K spans several chunks)."""
    m, k = x.shape
    assert m <= BLOCK_M
    plain = recipe.prologue == PRO_PLAIN
    assert plain == (residual is None) == (norm_weight is None)
    assert not recipe.compact or (not recipe.gemv and recipe.prologue in (PRO_PLAIN, PRO_PREPASS))
    gate_up = recipe.gate_up if silu else GU_NONE
    n = weight.shape[0] // 2 if silu else weight.shape[0]
    # Token rows of the prepass, the compact prologue and the GEMV; other variants take 16, so one
    # compiled kernel serves every M (ROWS is a compile-time constant).
    uses_rows = recipe.prologue == PRO_PREPASS or recipe.compact or recipe.gemv
    rows = triton.next_power_of_2(m) if uses_rows else BLOCK_M
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if not plain and recipe.res_store != RES_NONE else None
    grid = triton.cdiv(n, cfg.block_n)
    # The prepass chunk: ~4096 float32 elements of [ROWS, PRE_K] (32 registers a thread at 4 warps).
    pre_k = max(16, min(triton.next_power_of_2(k), 4096 // rows, pre_k_max))
    _variant_kernel[(grid,)](
        x, residual if residual is not None else x, res_out if res_out is not None else out,
        norm_weight if norm_weight is not None else x, weight, out,
        m, n, k, x.stride(0), residual.stride(0) if residual is not None else 0,
        res_out.stride(0) if res_out is not None else 0, weight.stride(0), out.stride(0), eps,
        PROLOGUE=recipe.prologue, RES_STORE=recipe.res_store if not plain else RES_NONE, GATE_UP=gate_up,
        MUL=recipe.mul, COMPACT=recipe.compact, DOT_FP32=dot_in_float32(x),
        BLOCK_M=rows if recipe.gemv else BLOCK_M, ROWS=rows, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRE_K=pre_k, SLICE_K=max(16, triton.next_power_of_2(triton.cdiv(k, grid))),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, res_out


def interleave_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """[g0..g(I-1), u0..u(I-1)] rows -> [g0, u0, g1, u1, ...] (done once, offline, as a loader would)."""
    two_i, k = weight.shape
    return weight.view(2, two_i // 2, k).transpose(0, 1).reshape(two_i, k).contiguous()


# ---------------------------------------------------------------------------------------------------------
# Configs. (block_n, block_k, num_warps, num_stages); for the GEMV, block_n may go below tl.dot's 16.

DOT_DEFAULT = [(16, 64, 4, 4), (16, 128, 4, 4), (32, 256, 4, 4)]
GEMV_DEFAULT = [(16, 256, 4, 3), (8, 512, 4, 3), (16, 128, 8, 3), (32, 128, 4, 3), (16, 64, 4, 3)]
FULL_GRID = [(bn, bk, w, s) for bn in (16, 32, 64) for bk in (64, 128, 256, 512) for w in (4, 8) for s in (2, 3, 4)]
GEMV_FULL = [(8, bk, w, s) for bk in (128, 256, 512) for w in (4, 8) for s in (2, 3)] + FULL_GRID
# The CPU check: blocks small enough that K=96 and N=64/48/96 span several blocks and hit every mask.
CHECK_DOT = [(16, 64, 1, 1), (32, 32, 1, 1)]
CHECK_GEMV = [(16, 64, 1, 1), (8, 32, 1, 1)]
SMEM_BYTES = 220 << 10  # H100: 227 KB a block, less Triton's own use


def fits(recipe: Recipe, c: tuple, m: int, silu: bool, elt: int) -> bool:
    """Whether config c can compile sensibly: the MMA's pipelined weight (and input) tiles fit shared
    memory; the GEMV's register tile stays within 64 (accumulating) or 128 (transient) float32 a thread."""
    bn, bk, warps, stages = c
    cols = 2 * bn if silu else bn
    if recipe.gemv:
        per_thread = triton.next_power_of_2(m) * cols * bk // (32 * warps)
        return per_thread <= (64 if recipe.mul == MUL_GEMV_ACC else 128)
    return bn >= 16 and stages * (bk * cols + BLOCK_M * bk) * elt <= SMEM_BYTES


def configs_for(recipe: Recipe, m: int, silu: bool, elt: int, mode: str) -> list[SmallMConfig]:
    """mode: 'default' (the tight GPU sweep), 'full' or 'check'. Default GEMV: the first two that fit."""
    if mode == "check":
        pool = CHECK_GEMV if recipe.gemv else CHECK_DOT
    elif mode == "full":
        pool = GEMV_FULL if recipe.gemv else FULL_GRID
    else:
        pool = GEMV_DEFAULT if recipe.gemv else DOT_DEFAULT
    chosen = [SmallMConfig(*c) for c in pool if mode == "check" or fits(recipe, c, m, silu, elt)]
    return chosen[:2] if recipe.gemv and mode == "default" else chosen


def applies(recipe: Recipe, m: int, silu: bool, mode: str) -> bool:
    """Gate/up-only recipes run on gate_up; the GEMV runs at M=1 (to M=4 with --full and --check)."""
    if (recipe.gate_up == GU_INTERLEAVED and not silu) or (recipe.full_only and mode == "default"):
        return False
    if recipe.gemv:
        return m <= (1 if mode == "default" else 4)
    return True


# ---------------------------------------------------------------------------------------------------------
# Ops, references and the variants of one group.

@dataclass
class Op:
    name: str
    n: int  # output columns (gate_up: I)
    silu: bool


def ops_of(shape: str) -> list[Op]:
    hidden, inter, heads, kv_heads, head_dim = SHAPES[shape]
    return [Op("add+norm+qkv", (heads + 2 * kv_heads) * head_dim, False),
            Op("add+norm+gate_up+silu", inter, True),
            Op("add+norm+o_proj", hidden, False)]


# The CPU check's stand-in for a model: K=96, qkv N=64, gate_up 2x48, o_proj 96x96.
TINY = ("tiny", 96, [Op("add+norm+qkv", 64, False), Op("add+norm+gate_up+silu", 48, True),
                     Op("add+norm+o_proj", 96, False)])
DEFAULT_OPS = {"smollm2-135m": ["add+norm+qkv", "add+norm+gate_up+silu", "add+norm+o_proj"],
               "llama3-8b": ["add+norm+qkv", "add+norm+gate_up+silu"]}


def reference(kind: str, x, weight, residual, norm_weight, silu) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float64 (out, x + residual) from the definitions. kind: 'op' (the whole fused op), 'proj' (x @ W^T
    alone, as cuBLAS alone computes it) or 'proj+act' (the bare projection with the SiLU-and-mul)."""
    h = x.double()
    total = None
    if kind == "op":
        h = h + residual.double()
        total = h
        h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight.double()
    out = h @ weight.double().T
    if silu and kind != "proj":
        gate, up = out.chunk(2, dim=-1)
        out = gate * torch.sigmoid(gate) * up
    return out, total


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    err = ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    return err if got.isfinite().all() else float("inf")


@dataclass
class Variant:
    label: str
    config: str
    ref: str  # reference kind (see reference)
    floor: bool  # computes less than the op (a lower bound), never "best"
    build: Callable  # build(inputs) -> fn(i) -> (out, x + residual or None)
    note: str = ""


@dataclass
class Inputs:
    x: torch.Tensor
    residual: torch.Tensor
    norm_weight: torch.Tensor
    weights: list  # gate/up in its natural row order
    interleaved: list | None  # the same weights with gate/up rows interleaved (gate_up only)
    refs: dict = field(default_factory=dict)  # reference kind -> float64 (out, x + residual) for weights[0]


def cfg_str(cfg: SmallMConfig | None) -> str:
    return "default" if cfg is None else f"{cfg.block_n}/{cfg.block_k}/{cfg.num_warps}/{cfg.num_stages}"


def variants_of(op: Op, m: int, elt: int, mode: str, only: list[str] | None) -> list[Variant]:
    silu = op.silu
    out: list[Variant] = []

    def cublas(inp):
        return lambda i: (F.linear(inp.x, inp.weights[i]), None)

    # fused_add_rms_norm adds x into the residual in place and returns it as the sum: these two work on a
    # copy of the residual, so the inputs of the variants timed after them stay as they were.
    def cublas_kernels(inp):
        res = inp.residual.clone()

        def fn(i):
            normed, total = fused_add_rms_norm(inp.x, res, inp.norm_weight, EPS)
            y = F.linear(normed, inp.weights[i])
            return (silu_and_mul(y) if silu else y), total
        return fn

    def norm_then_small_m(inp):
        res = inp.residual.clone()

        def fn(i):
            normed, total = fused_add_rms_norm(inp.x, res, inp.norm_weight, EPS)
            return fused_linear(normed, inp.weights[i], silu_mul=silu)[0], total
        return fn

    def baseline(cfg):
        return lambda inp: lambda i: fused_linear(inp.x, inp.weights[i], norm_weight=inp.norm_weight, eps=EPS,
                                                  residual=inp.residual, silu_mul=silu, config=cfg)

    out.append(Variant("cublas alone", "", "proj", True, cublas, "F.linear only: no add/norm/act"))
    out.append(Variant("cublas+kernels", "", "op", False, cublas_kernels))
    out.append(Variant("norm kernel+small-M", "default", "op", False, norm_then_small_m,
                       "fused_add_rms_norm, then fused_linear without prologue"))
    # The baseline runs the add + norm prologue, which split-K configurations do not take.
    unsplit = [c for c in CANDIDATES if c.split_k == 1]
    base_cfgs = [None] + ([SmallMConfig(16, 64, 4, 4)] if mode == "default" else
                          unsplit if mode == "full" else [SmallMConfig(*CHECK_DOT[1])])
    for cfg in base_cfgs:
        out.append(Variant("baseline fused_linear", cfg_str(cfg), "op", False, baseline(cfg)))

    pre_k_max = 32 if mode == "check" else 4096
    for recipe in RECIPES:
        if not applies(recipe, m, silu, mode) or (only and not any(s in recipe.name for s in only)):
            continue
        plain = recipe.prologue == PRO_PLAIN
        for cfg in configs_for(recipe, m, silu, elt, mode):
            def build(inp, recipe=recipe, cfg=cfg, plain=plain):
                ws = inp.interleaved if silu and recipe.gate_up == GU_INTERLEAVED else inp.weights
                return lambda i: launch(recipe, cfg, inp.x, ws[i], residual=None if plain else inp.residual,
                                        norm_weight=None if plain else inp.norm_weight, silu=silu,
                                        pre_k_max=pre_k_max)
            note = "no x+res output (isolation)" if recipe.res_store == RES_NONE and not plain else ""
            out.append(Variant(recipe.name, cfg_str(cfg), "proj+act" if plain else "op", plain, build, note))
    return out


def make_inputs(m: int, k: int, rows: int, dtype, device, copies: int, silu: bool, seed: int) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*size):
        return torch.randn(*size, device=device, dtype=torch.float32, generator=gen).to(dtype)

    # Weights scaled by K^-1/2 so outputs are of order one. The norm weight spreads widely about one, so
    # that a variant leaving it out is off by tens of percent, far beyond the tolerance.
    weights = [(rand(rows, k) * k**-0.5).to(dtype) for _ in range(copies)]
    norm_weight = (1 + 0.5 * rand(k).float()).to(dtype)
    return Inputs(rand(m, k), rand(m, k), norm_weight, weights,
                  [interleave_gate_up(w) for w in weights] if silu else None)


def check(v: Variant, inp: Inputs, silu: bool) -> float:
    """max relative error of v (on weights[0]); inf where the op leaves out the x + residual output."""
    if v.ref not in inp.refs:
        inp.refs[v.ref] = reference(v.ref, inp.x, inp.weights[0], inp.residual, inp.norm_weight, silu)
    want, want_total = inp.refs[v.ref]
    got, total = v.build(inp)(0)
    err = rel_err(got, want)
    if total is not None and want_total is not None:
        err = max(err, rel_err(total, want_total))
    if v.ref == "op" and not v.note.startswith("no x+res") and total is None:
        return float("inf")  # the op must produce the next residual stream
    return err


# ---------------------------------------------------------------------------------------------------------

def log(t0: float, msg: str) -> None:
    print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def run_check(args, t0: float) -> bool:
    """Correctness of every variant on tiny shapes (the CPU path, under TRITON_INTERPRET=1)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    _, k, ops = TINY
    ok = True
    print(f"check on {device}, {args.dtype}, K={k}; max |out - ref| / max |ref| against float64, "
          f"tolerance {tolerance(dtype, device):.0e}\n")
    print("| op | M | variant | config | max rel err | |")
    print("|---|---:|---|---|---:|---|")
    for op in ops:
        for m in args.check_tokens:
            rows = 2 * op.n if op.silu else op.n
            inp = make_inputs(m, k, rows, dtype, device, 1, op.silu, seed=m)
            for v in variants_of(op, m, 2, "check", args.variants):
                log(t0, f"check {op.name} M={m} {v.label} {v.config}")
                try:
                    err = check(v, inp, op.silu)
                    verdict = "ok" if err <= tolerance(dtype, device) else "WRONG"
                    shown = f"{err:.2e}"
                except Exception as e:  # noqa: BLE001 -- report and go on to the next variant
                    verdict, shown = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:100]}", "-"
                ok &= verdict == "ok"
                print(f"| {op.name} | {m} | {v.label} | {v.config} | {shown} | {verdict} |", flush=True)
    print(f"\n{'all variants correct' if ok else 'SOME VARIANTS WRONG OR FAILED'}")
    return ok


def run_bench(args, t0: float) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("timing needs a CUDA device; on a CPU run --check under TRITON_INTERPRET=1")
    dtype = getattr(torch, args.dtype)
    elt = torch.empty((), dtype=dtype).element_size()
    mode = "full" if args.full else "default"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {args.dtype}, "
          f"sweep {mode}; GPU us per call under a CUDA graph, "
          f"weights rotated over >= {ROTATION_BYTES >> 20} MB. err: max |out - ref| / max |ref| vs float64. "
          f"floor us: weight bytes at {PEAK_BYTES_PER_US / 1e6:.1f} TB/s. speedup: cublas+kernels / this. "
          f"config: block_n/block_k/num_warps/num_stages\n")
    print("| shape | M | op | variant | config | us | weight GB/s | floor us | speedup | err | note |")
    print("|---|---:|---|---|---|---:|---:|---:|---:|---:|---|")
    summary = []
    with torch.no_grad():
        for shape in args.shapes:
            k = SHAPES[shape][0]
            for op in ops_of(shape):
                if op.name not in (args.ops or DEFAULT_OPS[shape]):
                    continue
                rows = 2 * op.n if op.silu else op.n
                nbytes = rows * k * elt
                copies = copies_for(nbytes)
                for m in args.tokens:
                    group = f"{shape} M={m} {op.name}"
                    log(t0, f"{group}: {copies} weight copies of {nbytes / 1e6:.1f} MB")
                    inp = make_inputs(m, k, rows, dtype, "cuda", copies, op.silu, seed=m)
                    rows_out, times = [], {}
                    for v in variants_of(op, m, elt, mode, args.variants):
                        name = f"{v.label} {v.config}".strip()
                        log(t0, f"{group}: {name}")
                        try:
                            err = check(v, inp, op.silu)
                            if not err <= tolerance(dtype, "cuda"):
                                rows_out.append((v, None, err, "WRONG: not timed"))
                                continue
                            t = rotating_time_us(v.build(inp), copies)
                        except Exception as e:  # noqa: BLE001 -- a config can exceed shared memory or registers
                            rows_out.append((v, None, float("nan"), f"failed: {type(e).__name__}"))
                            continue
                        times[name] = t
                        rows_out.append((v, t, err, v.note))
                    ref_t = times.get("cublas+kernels")
                    full = [(t, v) for v, t, _, note in rows_out
                            if t is not None and not v.floor and not note.startswith("no x+res")
                            and v.label not in ("cublas+kernels",)]
                    best = min(full, key=lambda p: p[0]) if full else None
                    ours = [p for p in full if p[1].label in RECIPE_NAMES]
                    best_new = min(ours, key=lambda p: p[0]) if ours else None
                    for v, t, err, note in rows_out:
                        mark = " **best**" if best is not None and v is best[1] else ""
                        if t is None:
                            print(f"| {shape} | {m} | {op.name} | {v.label} | {v.config} | - | | | | {err:.1e} | "
                                  f"{note} |")
                            continue
                        speed = f"{ref_t / t:.2f}x" if ref_t else ""
                        print(f"| {shape} | {m} | {op.name} | {v.label}{mark} | {v.config} | {t:.2f} | "
                              f"{nbytes / t / 1e3:.0f} | {nbytes / PEAK_BYTES_PER_US:.2f} | {speed} | {err:.1e} | "
                              f"{note} |", flush=True)
                    floor_t = min((t for v, t, _, _ in rows_out if t is not None and v.label == "ours plain"),
                                  default=None)
                    summary.append((shape, m, op.name, best, best_new, ref_t, times.get("cublas alone"), floor_t,
                                    min((t for n, t in times.items() if n.startswith("baseline")), default=None)))
                    del inp
                    torch.cuda.empty_cache()

    def us(t):
        return f"{t:.2f}" if t is not None else "-"

    def named(p):
        return f"{p[1].label} {p[1].config}".strip() if p else "none timed"

    def speedup(ref_t, p):
        return f"{ref_t / p[0]:.2f}x" if ref_t and p else "-"

    print("\nBest complete variant per group (x + res written, every output checked), over all variants and over "
          "this script's kernels alone; speedup over cuBLAS plus the separate kernels.\n")
    print("| shape | M | op | best variant | us | speedup | best new kernel | us | speedup | cublas+kernels us | "
          "best baseline us | cublas alone us | ours plain (floor) us |")
    print("|---|---:|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for shape, m, op, best, best_new, ref_t, cublas_t, floor_t, base_t in summary:
        print(f"| {shape} | {m} | {op} | {named(best)} | {us(best and best[0])} | {speedup(ref_t, best)} | "
              f"{named(best_new)} | {us(best_new and best_new[0])} | {speedup(ref_t, best_new)} | {us(ref_t)} | "
              f"{us(base_t)} | {us(cublas_t)} | {us(floor_t)} |")
    log(t0, "done")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="correctness only, tiny shapes (K=96); runs on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--full", action="store_true", help="sweep every config (BLOCK_N x BLOCK_K x warps x "
                        "stages) of every variant, and the GEMV up to M=4: long, narrow it with --variants")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--check-tokens", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--ops", nargs="+", choices=[o.name for o in TINY[2]],
                        help="ops to run (default: qkv, gate_up, o_proj on SmolLM2; qkv, gate_up on Llama-3-8B)")
    parser.add_argument("--variants", nargs="+", help="run only our recipes whose name contains one of these "
                        "(references and baseline always run)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    if args.check:
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("without a GPU, run --check under TRITON_INTERPRET=1")
        sys.exit(0 if run_check(args, t0) else 1)
    run_bench(args, t0)


if __name__ == "__main__":
    main()
