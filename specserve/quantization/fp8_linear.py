"""A linear layer with an FP8 weight (docs/design.md, 'FP8 weights').

The weight is float8_e4m3fn [N, K] with a float32 scale per output row; the bias, if any, stays in the
model's dtype. The input is quantized as `activation` says: per token on the fly (W8A8, dynamic), with the
checkpoint's static scale (W8A8, static), or not at all (W8A16: the weight is widened inside the GEMM).

Which GEMM runs: on the fused path (any CUDA module; a CPU module under Triton's interpreter when forced),
the FP8 dot kernel (kernels/fp8_gemm.py) for an FP8 input where the measured table picks it; the small-M
Triton kernel (kernels/fused_linear.py, fp8_linear) where the measured table picks it, in the
table's tile, which was measured for a bfloat16 model's FP8 input (kernels/fp8_gemm_choice.py), or where
`torch._scaled_mm` cannot run (a float32 or float16 model, a W8A16 layer); torch._scaled_mm with rowwise
scales (bfloat16 output) otherwise; past the Triton kernel's rows, a layer _scaled_mm cannot take
dequantizes. A dynamic input is quantized per token by one kernel there (kernels/fp8_rows.py), or already by
the kernel that computed it (the norm or SiLU-and-mul ahead: forward_rows). A gate/up projection of such rows
whose GEMM is a Triton kernel applies SiLU-and-mul in its epilogue and hands down_proj the products' FP8 rows
(silu_and_mul_rows), a launch fewer. The unfused path (the CPU's) is the reference: dequantize both operands
and multiply in float32.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch
from torch import nn

from specserve.kernels.fp8_gemm_choice import (DEFAULT_DOT_TILE, FP8_DOT, MIN_DOT_TILE, SCALED_MM, TRITON,
                                               TRITON_MAX_ROWS, Fp8DotTile, choose)
from specserve.kernels.small_m_configs import SmallMConfig
from specserve.models.layers import FusableModule
from specserve.quantization.fp8 import (FP8_DTYPE, Fp8Rows, dequantize, quantize_per_channel, quantize_per_token,
                                        quantize_static)


# The route of a layer off the fused path (or one no kernel takes): both operands dequantized, in float32.
REFERENCE = "reference"


@dataclass(frozen=True)
class Fp8GemmRoute:
    """The GEMM a layer runs over some rows: SCALED_MM, TRITON (the small-M kernel, in tile: a SmallMConfig, None
    for the tile data's), FP8_DOT (in tile: an Fp8DotTile, None for its default) or REFERENCE."""

    kernel: str
    tile: SmallMConfig | Fp8DotTile | None = None


class Fp8Activation(enum.Enum):
    DYNAMIC = "dynamic"  # W8A8: per-token scales computed on the device at every call
    STATIC = "static"  # W8A8: the checkpoint's per-tensor input scale
    NONE = "none"  # W8A16: the input stays in the model's dtype


class QuantizedLinear(FusableModule):
    """A projection whose quantized tensors (kept_tensors) keep their dtypes when the model is cast."""

    def kept_tensors(self) -> tuple[torch.Tensor | None, ...]:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        """Moves apply to every tensor, but a cast of the model's dtype leaves the kept tensors as they are (an
        FP8 weight, scales: a float32 scale through bfloat16 would lose bits)."""
        kept = {id(t) for t in self.kept_tensors() if t is not None}

        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if id(t) not in kept or out.dtype == t.dtype:
                return out
            return out.to(t.dtype) if t.is_meta else t.to(out.device)

        return super()._apply(keep_dtype, recurse)


class Fp8Linear(QuantizedLinear):
    """x @ (weight * weight_scale)^T + bias, with x quantized as `activation` says.

    parts: the checkpoint projections fused into this one (3 for q/k/v, 2 for gate/up, else 1). Each part of a
    static-scale checkpoint has its own input scale; they all quantize the same input, so the largest is used
    (vLLM does the same).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, activation: Fp8Activation, parts: int = 1):
        super().__init__()
        self.in_features, self.out_features, self.activation = in_features, out_features, activation
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        self.input_scale = (nn.Parameter(torch.empty(parts, dtype=torch.float32), requires_grad=False)
                            if activation is Fp8Activation.STATIC else None)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    @classmethod
    def quantize(cls, linear: nn.Linear) -> "Fp8Linear":
        """linear's weight quantized per output channel, its input per token (W8A8 dynamic), on linear's device."""
        weight = linear.weight
        with torch.device(weight.device):
            layer = cls(linear.in_features, linear.out_features, linear.bias is not None, Fp8Activation.DYNAMIC)
        q, scale = quantize_per_channel(weight)
        layer.weight.data.copy_(q)
        layer.weight_scale.data.copy_(scale)
        if linear.bias is not None:
            layer.bias.data = linear.bias.data
        layer.fused = getattr(linear, "fused", weight.is_cuda)
        return layer

    def kept_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.weight, self.weight_scale, self.input_scale

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activation={self.activation.value}")

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the GEMM's input, its scale [M, 1]): x and None for W8A16."""
        if self.activation is Fp8Activation.DYNAMIC:
            if self.fused:
                from specserve.kernels.fp8_rows import quantize_rows

                return quantize_rows(x)
            return quantize_per_token(x)
        if self.activation is Fp8Activation.STATIC:
            return quantize_static(x, self.input_scale.amax())
        return x, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        xq, x_scale = self.quantize_input(x)
        return self._project(xq, x_scale, x.dtype).reshape(*lead, self.out_features)

    def forward_rows(self, rows: Fp8Rows) -> torch.Tensor:
        """self(x) [M, out_features] for x [M, in_features] quantized per token already, by the kernel that
        computed it (models/layers.py, takes_fp8_rows): a dynamic-input layer's alone."""
        self._check_rows(rows)
        return self._project(rows.q, rows.scale, rows.dtype)

    def silu_and_mul_rows(self, rows: Fp8Rows) -> Fp8Rows:
        """quantize_rows(silu(gate) * up) for this gate/up projection (out_features = 2I: the gate's, then the
        up's) of rows as forward_rows takes them: SiLU-and-mul in the GEMM's epilogue where silu_route names a
        kernel, after the GEMM otherwise (kernels/activation.py); both round as silu_and_mul does."""
        from specserve.kernels.fp8_rows import quantize_chunked_rows

        self._check_rows(rows)
        route = self.silu_route(rows.q.shape[0], rows.dtype)
        if route is None:
            from specserve.kernels.activation import silu_and_mul_fp8_rows

            return silu_and_mul_fp8_rows(self._project(rows.q, rows.scale, rows.dtype))
        if route.kernel == FP8_DOT:
            from specserve.kernels.fp8_gemm import fp8_dot_silu_mul

            products, amax = fp8_dot_silu_mul(rows.q, self.weight, self.weight_scale, rows.scale,
                                              out_dtype=rows.dtype, tile=route.tile)
        else:
            from specserve.kernels.fused_linear import fp8_linear_silu_mul

            products, amax = fp8_linear_silu_mul(rows.q, self.weight, self.weight_scale, rows.scale, rows.dtype,
                                                 config=route.tile)
        q, scale = quantize_chunked_rows(products, amax)
        return Fp8Rows(q, scale, rows.dtype)

    def _check_rows(self, rows: Fp8Rows) -> None:
        if self.activation is not Fp8Activation.DYNAMIC or rows.q.shape[1:] != (self.in_features,):
            raise ValueError(f"rows quantized per token [M, {self.in_features}] feed a layer with dynamic input "
                             f"scales only; this one's input is {self.activation.value}, the rows "
                             f"{tuple(rows.q.shape)}")

    def _project(self, xq: torch.Tensor, x_scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        out = self._matmul(xq, x_scale, dtype)
        return out if self.bias is None else out + self.bias

    def route(self, m: int, dtype: torch.dtype, x_scaled: bool) -> Fp8GemmRoute:
        """Which GEMM this layer runs over m rows of dtype output, its input FP8 (x_scaled) or not (the one
        place that decides; the module docstring says how)."""
        if not self.fused:
            return Fp8GemmRoute(REFERENCE)
        scaled_mm_fits = dtype == torch.bfloat16 and x_scaled
        choice = choose(self.out_features, self.in_features, m, self.weight.device)
        if choice.kernel == FP8_DOT and x_scaled:
            return Fp8GemmRoute(FP8_DOT, choice.dot_tile())
        if m <= TRITON_MAX_ROWS and (not scaled_mm_fits or choice.kernel == TRITON):
            return Fp8GemmRoute(TRITON, choice.config() if scaled_mm_fits else None)
        return Fp8GemmRoute(SCALED_MM if scaled_mm_fits else REFERENCE)

    def silu_route(self, m: int, dtype: torch.dtype) -> Fp8GemmRoute | None:
        """The GEMM whose epilogue applies SiLU-and-mul over m FP8 rows of this gate/up projection (dtype
        output): route's kernel where it is a Triton one that runs unsplit and there is no bias, each program
        reading as many weight rows as route's tile has columns (half of them from each half); None otherwise."""
        route = self.route(m, dtype, x_scaled=True)
        if route.kernel not in (FP8_DOT, TRITON) or self.bias is not None or self.out_features % 2:
            return None
        tile = route.tile or (DEFAULT_DOT_TILE if route.kernel == FP8_DOT else None)
        if tile is None:
            return route  # the small-M kernel's tile data for a gate/up projection (small_m_configs.py)
        if tile.split_k != 1:
            return None
        return Fp8GemmRoute(route.kernel, replace(tile, block_n=max(MIN_DOT_TILE, tile.block_n // 2)))

    def _matmul(self, xq: torch.Tensor, x_scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        route = self.route(xq.shape[0], dtype, x_scale is not None)
        if route.kernel == FP8_DOT:
            from specserve.kernels.fp8_gemm import fp8_dot

            return fp8_dot(xq, self.weight, self.weight_scale, x_scale, out_dtype=dtype, tile=route.tile)
        if route.kernel == TRITON:
            from specserve.kernels.fused_linear import fp8_linear

            return fp8_linear(xq, self.weight, self.weight_scale, x_scale, out_dtype=dtype, config=route.tile)
        if route.kernel == SCALED_MM:
            # Rowwise scaling: scale_a [M, 1], scale_b [1, N]; the weight transposed is the column-major [K, N]
            # operand cuBLAS takes.
            return torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale.view(1, -1),
                                    out_dtype=dtype)
        return self.reference(xq, x_scale, dtype)

    def reference(self, xq: torch.Tensor, x_scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Both operands dequantized, multiplied in float32, rounded once to dtype."""
        x = xq.float() if x_scale is None else dequantize(xq, x_scale)
        return (x @ dequantize(self.weight, self.weight_scale[:, None]).t()).to(dtype)
