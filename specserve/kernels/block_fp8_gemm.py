"""The GEMM of a projection held as FP8 codes with block scales (quantization/gguf_blocks.py, block_fp8_linear.py).

out [M, N] = x @ w^T with w = code * scale + offset, the codes e4m3 [N, K] and the scale and offset float16 [N,
K / GROUP], each covering GROUP weights along K. A program widens its weight tile to float32, applies each
weight's block scale and offset, rounds the result to x's dtype (the weight the unquantized model holds, bit for
bit) and multiplies on the tensor cores with float32 sums, so the output differs from the unquantized model's
only by the order of the sums. The input stays in the model's dtype (W8A16); what is saved is the weight's
bytes (9 bits a weight against 16). Launches depend on shapes only (CUDA-graph capturable).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.quantization.gguf_blocks import GROUP


@triton.jit
def _block_fp8_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, out_ptr, M, N, K, stride_xm, stride_om,
    HAS_OFFSET: tl.constexpr, GROUP: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (m tile, n tile) over all of K; the scale and offset of weight (n, k) sit at (n, k // GROUP)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rg = tl.arange(0, BLOCK_K // GROUP)
    groups = K // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x_mask = (rm[:, None] < M) & (k[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
        w_mask = (rn[:, None] < N) & (k[None, :] < K)
        w = tl.load(w_ptr + rn[:, None] * K + k[None, :], mask=w_mask, other=0.0).to(tl.float32)
        # The tile's block scales once each, [BLOCK_N, BLOCK_K / GROUP], spread over their GROUP weights.
        g = k0 // GROUP + rg
        g_mask = (rn[:, None] < N) & (g[None, :] < groups)
        block = rn[:, None] * groups + g[None, :]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K // GROUP, GROUP))
        w = w * tl.load(scale_ptr + block, mask=g_mask, other=0.0).to(tl.float32)[:, :, None]
        if HAS_OFFSET:
            w = w + tl.load(offset_ptr + block, mask=g_mask, other=0.0).to(tl.float32)[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(x_ptr.dtype.element_ty)
        if DOT_FP32:
            # float32 operands must not drop to tf32; the interpreter's (numpy's) dot has no bfloat16.
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def block_tile(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) over m rows: tl.dot's narrowest rows up to 16, then as many as m needs up to
    64. Columns stay narrow so the weight's read spreads over many programs: a program rebuilds each weight
    tile in registers, and with 64 rows a tile of 16 columns keeps the most programs in flight (BENCHMARKS.md,
    'FP8 weights': the tile sweep)."""
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    return block_m, 32 if m <= 32 else 16, 128


def block_fp8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                     offset: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ (codes * scale + offset)^T as x.dtype [M, N]."""
    m, k = x.shape
    n = codes.shape[0]
    if (codes.shape[1] != k or scale.shape != (n, k // GROUP) or k % GROUP
            or (offset is not None and offset.shape != scale.shape)):
        raise ValueError(f"x [M, K], codes [N, K] and scale (and offset) [N, K / {GROUP}] expected, got "
                         f"{tuple(x.shape)}, {tuple(codes.shape)} and {tuple(scale.shape)}")
    if not all(t.is_contiguous() for t in (codes, scale, offset) if t is not None):
        raise ValueError("codes, scale and offset must be contiguous")
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k = block_tile(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _block_fp8_kernel[grid](
        x, codes, scale, offset if offset is not None else scale, out, m, n, k, x.stride(0), out.stride(0),
        HAS_OFFSET=offset is not None, GROUP=GROUP, DOT_FP32=x.dtype == torch.float32 or x.device.type == "cpu",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_stages=4,
    )
    return out
