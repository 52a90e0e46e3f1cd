"""FP8 (e4m3) quantization of weights and activations, and its exact inverse (docs/design.md, 'FP8 weights').

A quantized tensor is q (float8_e4m3fn) and a float32 scale with value = q * scale: per output channel
for weights ([N]), per token for activations quantized on the fly ([M, 1]), or one scale for a
checkpoint's static activation scale. scale = amax / 448, so each channel's or token's largest magnitude
maps to e4m3's largest finite value; values are clamped first, since a cast past it gives NaN, not 448.
Every function here is made of device operations only (no host sync), so it is capturable in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The least scale: an all-zero token or channel (or padding rows) must not divide by zero. Any scale gives
# zeros there; this one (vLLM's) keeps tiny rows representable.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# e4m3 keeps 3 mantissa bits: rounding to nearest errs by at most half a unit in the last place, 2**-4 of
# a value (relative), for values at or above the smallest normal (2**-6 before scaling).
FP8_RELATIVE_ERROR = 2.0 ** -4


@dataclass(frozen=True)
class Fp8Rows:
    """Activations quantized per token (row): q [M, K] e4m3 and scale [M, 1] float32, value = q * scale; dtype
    is the one they were computed in (the model's), which a projection of them outputs."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3 (scale broadcasts against x), clamped to e4m3's finite range."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] e4m3, scale [N] float32) of a weight [N, K]: one scale per output channel (row)."""
    amax = weight.detach().abs().amax(dim=1).float()
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return quantize_with_scale(weight.detach(), scale[:, None]), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] e4m3, scale [M, 1] float32) of activations x [M, K]: one dynamic scale per token (row), so a
    row's result never depends on the other rows of its batch."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return quantize_with_scale(x, scale), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] e4m3, scale [M, 1] float32) of x with a checkpoint's one static scale, repeated per row (the
    rowwise layout the GEMMs take)."""
    scale = scale.reshape(1, 1).float().expand(x.shape[0], 1).contiguous()
    return quantize_with_scale(x, scale), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale in float32; scale broadcasts against q ([N, 1] or [N] as a column for weights: see callers)."""
    return q.float() * scale
