"""SiLU-and-multiply of a fused gate/up projection in Triton, plain or writing its output quantized to FP8 per
row for the projection after it (docs/design.md, 'FP8 weights').

One pass over [tokens, 2 * inter] instead of torch's chunk, silu and multiply
(two kernels and an intermediate tensor). Rounding follows the unfused path:
silu(gate) is rounded to the input dtype before the multiply, and the product
to the input dtype too. The FP8 output is that rounded product quantized as
kernels/fp8_rows.py does (its scale rule and e4m3 rounding), so it is
bit-equal to quantize_rows of silu_and_mul's output: one program a row, its
products held in registers for the row's largest magnitude and their rounding
where the row fits one block (fp8_rows.row_block), else a pass for the largest
magnitude and a pass that recomputes the products (their inputs reread from
L2) and quantizes them. Launches depend on shapes only
(CUDA-graph capturable).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.fp8_kv import quantize_e4m3
from specserve.kernels.fp8_rows import row_block, row_scale, row_warps, store_quantized_row
from specserve.kernels.pdl import pdl_args, wait_for_previous
from specserve.quantization.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, Fp8Rows

_BLOCK = 1024


@triton.jit
def _silu_mul(row, cols, mask, inter, dtype: tl.constexpr):
    """silu(gate) * up at cols of a gate/up row, rounded as the unfused path rounds; 0 where mask is off."""
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    out = _silu_mul(gate_up_ptr + tok * stride_in, cols, mask, inter, out_ptr.dtype.element_ty)
    tl.store(out_ptr + tok * inter + cols, out, mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(gate_up_ptr, q_ptr, scale_ptr, stride_in, inter, fp8_max, min_scale,
                             BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    tok = tl.program_id(0).to(tl.int64)
    row = gate_up_ptr + tok * stride_in
    dtype = gate_up_ptr.dtype.element_ty
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        out = _silu_mul(row, cols, cols < inter, inter, dtype)
        store_quantized_row(out, q_ptr + tok * inter + cols, cols < inter, scale_ptr + tok, fp8_max, min_scale)
        return
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(_silu_mul(row, cols, cols < inter, inter, dtype).to(tl.float32)))
    scale = row_scale(tl.max(amax, 0), fp8_max, min_scale)
    tl.store(scale_ptr + tok, scale)
    for k0 in range(0, inter, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        out = _silu_mul(row, cols, cols < inter, inter, dtype)
        tl.store(q_ptr + tok * inter + cols, quantize_e4m3(out, scale, q_ptr.dtype.element_ty), mask=cols < inter)


def _rows(gate_up: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(gate_up as [tokens, 2 * inter] rows, inter)."""
    inter = gate_up.shape[-1] // 2
    tokens = gate_up.numel() // (2 * inter) if inter else 0
    rows = gate_up.reshape(tokens, 2 * inter)
    assert rows.stride(1) == 1 or tokens == 0
    return rows, inter


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., 2 * inter] holding gate then up; a new [..., inter] tensor."""
    rows, inter = _rows(gate_up)
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, _BLOCK))](rows, out, rows.stride(0), inter,
                                                                          BLOCK=_BLOCK, **pdl_args(gate_up.device))
    return out


def silu_and_mul_fp8_rows(gate_up: torch.Tensor) -> Fp8Rows:
    """quantize_rows(silu_and_mul(gate_up)) in one kernel, for gate_up = [tokens, 2 * inter]."""
    if gate_up.dim() != 2:
        raise ValueError(f"gate_up must be [tokens, 2 * inter], got {tuple(gate_up.shape)}")
    rows, inter = _rows(gate_up)
    q = torch.empty((rows.shape[0], inter), dtype=FP8_DTYPE, device=gate_up.device)
    scale = torch.empty((rows.shape[0], 1), dtype=torch.float32, device=gate_up.device)
    if q.numel():
        block = row_block(inter, gate_up.device)
        _silu_and_mul_fp8_kernel[(rows.shape[0],)](rows, q, scale, rows.stride(0), inter, FP8_MAX, MIN_SCALE,
                                                   BLOCK=block, ONE_PASS=inter <= block, num_warps=row_warps(block),
                                                   **pdl_args(gate_up.device))
    return Fp8Rows(q, scale, gate_up.dtype)
