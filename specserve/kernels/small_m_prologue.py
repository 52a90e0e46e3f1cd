"""The input side shared by the small-M projection kernels: x, optionally plus the residual, RMS-normed.

A projection over few tokens is bound by reading its weight, so its input
rows (at most 32 x K) are cheap to reread: every program of the projection
recomputes the prologue for the K chunk it multiplies, instead of a separate
norm kernel writing the normed rows for the projection to read back.

RMSNorm runs in two passes over K: a weight-free prepass (row_rstd) reads x
(and the residual) alone for each row's rstd, then the main loop normalises
every chunk as it loads it (input_chunk), so the loop that streams the weight
holds no reduction. A sum of squares accumulated inside that loop, whether
reduced per chunk or once after it, holds back the weight loads behind it and
made add + norm + projection slower than cuBLAS plus separate kernels
(BENCHMARKS.md, 'Kernel choices').

Rounding follows the unfused path where it is cheap to: the residual sum is
rounded to x's dtype before it is normed, as the torch path stores it; the
normed and weighted row is rounded once, to the weight's dtype for the dot.

With COMPACT the prologue computes only the ROWS = next_power_of_2(M) token
rows and repeats them over the BLOCK_M rows of the tile (rows past M are never
stored); which shape classes take it is the tile data's choice
(small_m_configs.py).

x + residual, the next residual stream, is written once: every program
stores one K slice of it (residual_slice before its main loop, so the load
is in flight beside the weights, store_residual_slice after: a store inside
the loop keeps Triton from prefetching the weight tiles).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows of a tile up to 16 tokens: tl.dot needs 16. A projection over fewer tokens masks the rest;
# it is memory-bound, so the idle rows of the MMA cost nothing.
BLOCK_M = 16
# The most token rows a launch takes, in a tile of this many rows: verifying a tree of drafts runs up
# to 32 rows a request, and a tile twice as tall still reads the weight once.
MAX_ROWS = 32
# Elements of the prepass's [ROWS, PRE_K] float32 chunk on a GPU: 32 registers a thread at 4 warps.
PREPASS_ELEMENTS = 4096
# Under the interpreter a short prepass chunk, so that test shapes span several chunks and their masks.
INTERPRETER_PREPASS_K = 64


@triton.jit
def row_sum(x_ptr, res_ptr, offs_m, offs_k, M, K, stride_xm, stride_rm, ADD: tl.constexpr):
    """x (+ residual, rounded to x's dtype as the unfused path stores the sum) as float32 [rows, chunk], 0 outside."""
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    if ADD:
        r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def row_rstd(x_ptr, res_ptr, M, K, stride_xm, stride_rm, eps,
             ADD: tl.constexpr, ROWS: tl.constexpr, PRE_K: tl.constexpr, OUT_ROWS: tl.constexpr):
    """The prepass: 1 / rms of the ROWS token rows (x + residual with ADD), as a vector of OUT_ROWS rows.

    Reads no weight, so its loop has no tile to wait for and takes long chunks (PRE_K).
    """
    offs_q = tl.arange(0, ROWS)
    sq = tl.zeros([ROWS, PRE_K], dtype=tl.float32)
    for k0 in range(0, K, PRE_K):
        s = row_sum(x_ptr, res_ptr, offs_q, k0 + tl.arange(0, PRE_K), M, K, stride_xm, stride_rm, ADD)
        sq += s * s
    rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / K + eps)
    if OUT_ROWS != ROWS:
        # Onto the prologue's rows, as a compare-and-sum: Triton cannot pad a tensor. Rows past ROWS get 0.
        offs_p = tl.arange(0, OUT_ROWS)
        rstd = tl.sum(tl.where(offs_p[:, None] == offs_q[None, :], rstd[None, :], 0.0), axis=1)
    return rstd


@triton.jit
def input_chunk(
    x_ptr, res_ptr, norm_w_ptr, rstd, offs_k, M, K, stride_xm, stride_rm,
    ADD: tl.constexpr, NORM: tl.constexpr, COMPACT: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
    LATE_RSTD: tl.constexpr,
):
    """The chunk [BLOCK_M, BLOCK_K] of the projection's input, in x's dtype (the weight's).

    rstd: row_rstd's vector, of ROWS rows with COMPACT, else BLOCK_M (unused without NORM, and with
    LATE_RSTD, where the caller scales its accumulator by row_rstd after the loop instead).
    """
    P_ROWS: tl.constexpr = ROWS if COMPACT else BLOCK_M
    a = row_sum(x_ptr, res_ptr, tl.arange(0, P_ROWS), offs_k, M, K, stride_xm, stride_rm, ADD)
    if NORM:
        # Rounded once, below, as the previous in-loop prologue did (the unfused RMSNorm also rounds the
        # normed row before the norm weight: a second 16-bit rounding the kernel tests' bounds leave out).
        if not LATE_RSTD:
            a = a * rstd[:, None]
        a = a * tl.load(norm_w_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)[None, :]
    a = a.to(x_ptr.dtype.element_ty)
    if COMPACT:
        # Row i of the tile is token row i % ROWS: rows past M repeat tokens and are never stored.
        a = tl.reshape(tl.broadcast_to(a[None, :, :], [BLOCK_M // ROWS, ROWS, offs_k.shape[0]]),
                       [BLOCK_M, offs_k.shape[0]])
    return a


@triton.jit
def residual_slice(x_ptr, res_ptr, program, M, K, stride_xm, stride_rm, ROWS: tl.constexpr, SLICE_K: tl.constexpr):
    """This program's slice of x + residual [ROWS, SLICE_K], rounded as input_chunk rounds it."""
    offs_s = program * SLICE_K + tl.arange(0, SLICE_K)
    return row_sum(x_ptr, res_ptr, tl.arange(0, ROWS), offs_s, M, K, stride_xm, stride_rm, True)


@triton.jit
def prologue_rows(x_ptr, res_ptr, program, M, K, stride_xm, stride_rm, eps,
                  ADD: tl.constexpr, NORM: tl.constexpr, COMPACT: tl.constexpr, ROWS: tl.constexpr,
                  PRE_K: tl.constexpr, SLICE_K: tl.constexpr, BLOCK_M: tl.constexpr, LATE_RSTD: tl.constexpr):
    """What a program reads before its weight loop: (its slice of x + residual for store_residual_slice,
    zeros without ADD; the rows' rstd for input_chunk, zeros without NORM or with LATE_RSTD)."""
    res_sum = tl.zeros([ROWS, SLICE_K], dtype=tl.float32)
    if ADD:
        res_sum = residual_slice(x_ptr, res_ptr, program, M, K, stride_xm, stride_rm, ROWS, SLICE_K)
    rstd = tl.zeros([ROWS if COMPACT else BLOCK_M], dtype=tl.float32)
    if NORM and not LATE_RSTD:
        rstd = row_rstd(x_ptr, res_ptr, M, K, stride_xm, stride_rm, eps, ADD, ROWS, PRE_K,
                        ROWS if COMPACT else BLOCK_M)
    return res_sum, rstd


@triton.jit
def store_residual_slice(res_out_ptr, s, program, M, K, stride_rom, ROWS: tl.constexpr, SLICE_K: tl.constexpr):
    """Store residual_slice's s: together the programs write x + residual once (slices past K store nothing)."""
    offs_r = tl.arange(0, ROWS)
    offs_s = program * SLICE_K + tl.arange(0, SLICE_K)
    mask = (offs_r[:, None] < M) & (offs_s[None, :] < K)
    tl.store(res_out_ptr + offs_r[:, None] * stride_rom + offs_s[None, :], s.to(res_out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def split_k_range(K, k_per, part, SPLIT_K: tl.constexpr):
    """The K range [start, end) part `part` of SPLIT_K sums (all of K unsplit). A part past K (when K is short
    for the split) gets an empty range and still counts in with the others."""
    k_start = 0
    k_end = K
    if SPLIT_K > 1:
        k_start = part * k_per
        k_end = tl.minimum(k_start + k_per, K)
    return k_start, k_end


def block_m(m: int) -> int:
    """The tile's rows for m token rows: BLOCK_M up to 16 (decode's tile), MAX_ROWS above, where
    small_m_configs.py's tall classes apply."""
    return BLOCK_M if m <= BLOCK_M else MAX_ROWS


def prologue_meta(x: torch.Tensor, norm: bool, compact: bool, num_programs: int) -> dict:
    """The tile's rows and the prologue's compile-time sizes for a launch of num_programs programs over x [M, K].

    BLOCK_M: block_m(M). ROWS: the token rows the prepass (and a COMPACT prologue, which repeats them
    BLOCK_M // ROWS times: both powers of two) computes; without a norm BLOCK_M, so the plain projection
    compiles once for every M of a tile size. SLICE_K: each program's share of x + residual. LATE_RSTD: see
    late_rstd_ok.
    """
    m, k = x.shape
    tile_rows = block_m(m)
    rows = triton.next_power_of_2(max(m, 1)) if norm else tile_rows
    pre_k_max = INTERPRETER_PREPASS_K if x.device.type == "cpu" else PREPASS_ELEMENTS // rows
    return dict(
        BLOCK_M=tile_rows, COMPACT=norm and compact, ROWS=rows,
        PRE_K=max(16, min(triton.next_power_of_2(k), pre_k_max)),
        SLICE_K=max(16, triton.next_power_of_2(triton.cdiv(k, num_programs))),
        LATE_RSTD=norm and late_rstd_ok(x),
    )


def late_rstd_ok(x: torch.Tensor) -> bool:
    """Whether the norm's rstd may scale the accumulator after the weight loop rather than each input
    chunk before the dot. The prepass's reduction waits for x, and the weight loads of the loop, issued
    after it, wait with it: after the loop it costs the weights' stream nothing. The dot's input is
    then x * norm_weight un-normed, which a bfloat16 (or float32) row holds; a float16 one may overflow
    where the residual stream is large, so float16 keeps the prepass first."""
    return x.dtype != torch.float16


def check_prologue(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None,
                   residual: torch.Tensor | None) -> None:
    """Validate the operands of a small-M projection; raises ValueError naming what is wrong."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(what)

    need(x.dim() == 2 and weight.dim() == 2, f"x [M, K] and weight [N, K] expected, got {tuple(x.shape)} and "
         f"{tuple(weight.shape)}")
    need(x.shape[0] <= MAX_ROWS, f"a small-M projection takes at most {MAX_ROWS} rows, got {x.shape[0]}")
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


def dot_in_float32(x: torch.Tensor, fp8_out: torch.dtype | None = None) -> bool:
    """Whether to multiply in float32: Triton's interpreter multiplies bfloat16 dot operands as raw integer bits.
    fp8_out, for a projection with an FP8 weight, is its output dtype: its operands widen to the output's dtype
    or float16 on a GPU, but to float32 under the interpreter (which has no e4m3 dot) and for a float32 output."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16) or \
        (fp8_out is not None and (x.device.type == "cpu" or fp8_out == torch.float32))
