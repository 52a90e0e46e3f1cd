"""A linear layer whose weight is a GGUF's block-quantized weight held exactly as FP8 codes with block scales
(quantization/gguf_blocks.py; docs/design.md, 'FP8 weights').

The weight is float8_e4m3fn codes [N, K] with a float16 scale (and offset) per GROUP weights along K; the input
stays in the model's dtype (W8A16). On the fused path (any CUDA module; a CPU module under Triton's interpreter
when forced) the block GEMM (kernels/block_fp8_gemm.py) rebuilds each weight tile in registers; off it (the
CPU's) the weight is rebuilt whole and multiplied as nn.Linear would, so a CPU model of these layers computes
what the unquantized model computes, bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.errors import ModelLoadError
from specserve.quantization.fp8 import FP8_DTYPE
from specserve.quantization.fp8_linear import QuantizedLinear
from specserve.quantization.gguf_blocks import GROUP, dequantize_blocks


class BlockFp8Linear(QuantizedLinear):
    """x @ (weight * block_scale + block_offset)^T + bias, each block's scale and offset repeated over its GROUP
    weights along K; has_offset False: no offset (Q4_0, Q5_0)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, has_offset: bool):
        super().__init__()
        if in_features % GROUP:
            raise ModelLoadError(f"a projection of {in_features} inputs is not a whole number of {GROUP}-weight "
                                 "blocks (with tensor parallelism: per rank); use a tensor-parallel size that "
                                 f"divides {in_features} / {GROUP}, or load without quantization='fp8'")
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        blocks = (out_features, in_features // GROUP)
        self.block_scale = nn.Parameter(torch.empty(blocks, dtype=torch.float16), requires_grad=False)
        self.block_offset = (nn.Parameter(torch.empty(blocks, dtype=torch.float16), requires_grad=False)
                             if has_offset else None)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def kept_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.weight, self.block_scale, self.block_offset

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group={GROUP}, offset={self.block_offset is not None}")

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] the unquantized model holds in dtype."""
        return dequantize_blocks(self.weight, self.block_scale, self.block_offset).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return F.linear(x, self.dequantized_weight(x.dtype), self.bias)
        from specserve.kernels.block_fp8_gemm import block_fp8_linear

        lead = x.shape[:-1]
        out = block_fp8_linear(x.reshape(-1, self.in_features), self.weight, self.block_scale, self.block_offset)
        out = out if self.bias is None else out + self.bias
        return out.reshape(*lead, self.out_features)
