"""SiLU-and-multiply of a fused gate/up projection in Triton, plain or writing its output quantized to FP8 per
row for the projection after it (docs/design.md, 'FP8 weights').

One pass over [tokens, 2 * inter] instead of torch's chunk, silu and multiply
(two kernels and an intermediate tensor). Rounding follows the unfused path:
silu(gate) is rounded to the input dtype before the multiply, and the product
to the input dtype too. The FP8 output is that rounded product quantized as
kernels/fp8_rows.py does (its scale rule and e4m3 rounding), so it is
bit-equal to quantize_rows of silu_and_mul's output. A decode batch has few
rows: a row is spread over programs of a chunk each (one program a row
streamed it from one SM), so the row's scale, which needs all its products,
comes from a second kernel that reads the chunks' largest magnitudes
(fp8_rows.quantize_chunked_rows). Launches depend on shapes only
(CUDA-graph capturable).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.fp8_rows import chunk_columns, quantize_chunked_rows
from specserve.kernels.pdl import pdl_args, wait_for_previous
from specserve.quantization.fp8 import Fp8Rows

_BLOCK = 1024


@triton.jit
def silu_times(gate, up, dtype: tl.constexpr):
    """silu(gate) * up as dtype, rounded as the unfused path rounds: gate and up (float32) first rounded to dtype
    (the projection's stored output), silu(gate) rounded to dtype before the multiply. Shared by the GEMM
    epilogues that apply it (fused_linear.py, fp8_gemm.py), so that every path rounds alike."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@triton.jit
def row_amax(x):
    """The largest magnitude of each row of a 2-D block x, in float32 (the chunk amax that
    fp8_rows.quantize_chunked_rows takes)."""
    return tl.max(tl.abs(x.to(tl.float32)), 1)


@triton.jit
def _silu_mul(row, cols, mask, inter, dtype: tl.constexpr):
    """silu(gate) * up at cols of a gate/up row, rounded as the unfused path rounds; 0 where mask is off."""
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    return silu_times(gate, up, dtype)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    out = _silu_mul(gate_up_ptr + tok * stride_in, cols, mask, inter, out_ptr.dtype.element_ty)
    tl.store(out_ptr + tok * inter + cols, out, mask=mask)


@triton.jit
def _silu_and_mul_amax_kernel(gate_up_ptr, out_ptr, amax_ptr, stride_in, inter, BLOCK: tl.constexpr,
                              PDL: tl.constexpr):
    """Program (row, chunk): the chunk's products, and their largest magnitude into amax [rows, chunks]."""
    wait_for_previous(PDL)
    tok = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    out = _silu_mul(gate_up_ptr + tok * stride_in, cols, mask, inter, out_ptr.dtype.element_ty)
    tl.store(out_ptr + tok * inter + cols, out, mask=mask)
    tl.store(amax_ptr + tok * tl.num_programs(1) + chunk, tl.max(tl.abs(out.to(tl.float32)), 0))


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
    """quantize_rows(silu_and_mul(gate_up)) for gate_up = [tokens, 2 * inter], each row spread over programs of
    chunk_columns(device) products: the products and each chunk's largest magnitude, then their quantization."""
    if gate_up.dim() != 2:
        raise ValueError(f"gate_up must be [tokens, 2 * inter], got {tuple(gate_up.shape)}")
    rows, inter = _rows(gate_up)
    products = torch.empty((rows.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    block = chunk_columns(gate_up.device)
    amax = torch.empty((rows.shape[0], triton.cdiv(inter, block)), dtype=torch.float32, device=gate_up.device)
    if products.numel():
        _silu_and_mul_amax_kernel[amax.shape](rows, products, amax, rows.stride(0), inter, BLOCK=block,
                                              **pdl_args(gate_up.device))
    q, scale = quantize_chunked_rows(products, amax)
    return Fp8Rows(q, scale, gate_up.dtype)
