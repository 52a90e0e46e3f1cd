"""Per-token (row) FP8 quantization of activations in one Triton launch: quantization/fp8.py's
quantize_per_token, which as torch operations is five kernels and a temporary the size of x.

One program a row: the row's largest magnitude, then each value divided by the row's scale (amax / 448, at
least MIN_SCALE) and rounded to e4m3 as the FP8 KV cache's writers do (kernels/fp8_kv.py: divided exactly,
clamped, rounded to nearest even): each value and scale equals the torch reference's on the CPU; on CUDA torch
divides a scale by 448 as a multiply by its reciprocal, a last-bit difference. A row of up to ONE_PASS_MAX
elements is read once and held in registers for both (a decode batch's rows: one program a row, so a loop of
chunks is a chain of dependent loads on one SM); a longer one takes two passes over chunks, the second
rereading the row from L2. Launches depend on shapes only (CUDA-graph capturable).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.fp8_kv import quantize_e4m3
from specserve.kernels.pdl import pdl_args, wait_for_previous
from specserve.quantization.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE

# Elements of a row per loop iteration on a GPU for a row longer than ONE_PASS_MAX; the interpreter takes short
# ones, so that test rows span several chunks and the masks, and a row of at most 64 takes the one pass.
BLOCK_K = 2048
ONE_PASS_MAX = 16384
INTERPRETER_BLOCK_K = 64


@triton.jit
def row_scale(amax, fp8_max, min_scale):
    """A row's scale from its largest magnitude (float32): amax / 448 divided exactly, at least MIN_SCALE."""
    return tl.maximum(tl.math.div_rn(amax, fp8_max), min_scale)


@triton.jit
def store_quantized_row(x, q_ptrs, mask, scale_ptr, fp8_max, min_scale):
    """Quantize a row held whole in registers (x, 0 where mask is off) with its own scale: the scale to
    scale_ptr, the e4m3 values to q_ptrs."""
    scale = row_scale(tl.max(tl.abs(x.to(tl.float32)), 0), fp8_max, min_scale)
    tl.store(scale_ptr, scale)
    tl.store(q_ptrs, quantize_e4m3(x, scale, q_ptrs.dtype.element_ty), mask=mask)


def row_block(k: int, device: torch.device) -> int:
    """Elements of a row per loop iteration of a kernel over rows of k elements on device: the whole row (one
    pass, k <= the block) up to ONE_PASS_MAX on a GPU."""
    if device.type == "cpu":
        return INTERPRETER_BLOCK_K
    whole = triton.next_power_of_2(k)
    return whole if whole <= ONE_PASS_MAX else BLOCK_K


def row_warps(block: int) -> int:
    """Warps for a program holding block elements of a row: 16 to 32 elements a thread, 4 to 16 warps."""
    return min(max(block // 512, 4), 16)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, fp8_max, min_scale,
                          BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    if ONE_PASS:
        offs = tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0)
        store_quantized_row(x, q_ptr + row * stride_qm + offs, offs < K, scale_ptr + row, fp8_max, min_scale)
        return
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)))
    scale = row_scale(tl.max(amax, 0), fp8_max, min_scale)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0)
        tl.store(q_ptr + row * stride_qm + offs, quantize_e4m3(x, scale, q_ptr.dtype.element_ty), mask=offs < K)


# Columns of a row a program of the chunked quantization takes on a GPU; the interpreter takes fewer, so that
# test rows span several chunks.
CHUNK_COLUMNS = 1024
INTERPRETER_CHUNK_COLUMNS = 32


def chunk_columns(device: torch.device) -> int:
    return INTERPRETER_CHUNK_COLUMNS if device.type == "cpu" else CHUNK_COLUMNS


@triton.jit
def _quantize_chunked_rows_kernel(x_ptr, amax_ptr, q_ptr, scale_ptr, K, num_chunks, fp8_max, min_scale,
                                  BLOCK: tl.constexpr, CHUNKS: tl.constexpr, PDL: tl.constexpr):
    """Program (row, block of BLOCK columns): the row's scale from the largest magnitudes of its num_chunks
    chunks (of any width), then the block's values."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    parts = tl.arange(0, CHUNKS)
    amax = tl.load(amax_ptr + row * num_chunks + parts, mask=parts < num_chunks, other=0.0)
    scale = row_scale(tl.max(amax, 0), fp8_max, min_scale)
    if block == 0:
        tl.store(scale_ptr + row, scale)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * K + offs, mask=offs < K, other=0.0)
    tl.store(q_ptr + row * K + offs, quantize_e4m3(x, scale, q_ptr.dtype.element_ty), mask=offs < K)


def quantize_chunked_rows(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(x) for a contiguous x [M, K] whose largest magnitudes per chunk of columns are known:
    amax [M, chunks] float32, as the kernel that wrote x found them (chunks of any width that cover the row).
    One program per chunk_columns(device) columns of a row."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and k:
        block = chunk_columns(x.device)
        _quantize_chunked_rows_kernel[(m, triton.cdiv(k, block))](
            x, amax, q, scale, k, amax.shape[1], FP8_MAX, MIN_SCALE, BLOCK=block,
            CHUNKS=triton.next_power_of_2(amax.shape[1]), **pdl_args(x.device))
    return q, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] e4m3, scale [M, 1] float32) of x [M, K] (float32, bfloat16 or float16, unit stride along K):
    one dynamic scale per row, as quantize_per_token."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be a float32/bfloat16/float16 [M, K] with unit stride along K, got {x.dtype} "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and k:
        block = row_block(k, x.device)
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX, MIN_SCALE,
                                    BLOCK_K=block, ONE_PASS=k <= block, num_warps=row_warps(block),
                                    **pdl_args(x.device))
    return q, scale
