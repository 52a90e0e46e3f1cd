"""SiLU-and-multiply of a fused gate/up projection in Triton.

One pass over [tokens, 2 * inter] instead of torch's chunk, silu and multiply
(two kernels and an intermediate tensor). Rounding follows the unfused path:
silu(gate) is rounded to the input dtype before the multiply.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, inter, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row = gate_up_ptr + tok * stride_in
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
    tl.store(out_ptr + tok * inter + cols, (act * up).to(out_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., 2 * inter] holding gate then up; a new [..., inter] tensor."""
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    tokens = out.numel() // inter if inter else 0
    if tokens == 0:
        return out
    rows = gate_up.reshape(tokens, 2 * inter)
    assert rows.stride(1) == 1
    _silu_and_mul_kernel[(tokens, triton.cdiv(inter, _BLOCK))](rows, out, rows.stride(0), inter, BLOCK=_BLOCK)
    return out
