"""Quantizing keys and values to an FP8 (e4m3) KV cache, inside the Triton kernels that write it.

A cached value is round_to_nearest_even(clamp(x / scale, -448, 448)) in e4m3 (torch.float8_e4m3fn), and
reads back as value * scale (attention/kv_quant.py is the torch reference; docs/design.md, 'FP8 KV cache').
The kernels round to e4m3's grid in float32 themselves, so the final cast only stores a value e4m3 holds
exactly: the result does not depend on the conversion's rounding (Triton's interpreter rounds ties away
and drops the carry of a mantissa that rounds up into the exponent; Hopper's cvt rounds to nearest even).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention import kv_quant
from specserve.attention.kv_quant import is_fp8

FP8_E4M3_MAX: tl.constexpr = tl.constexpr(kv_quant.FP8_E4M3_MAX)


@triton.jit
def _round_to_e4m3_grid(y):
    """y (float32, |y| <= 448) rounded to nearest even on e4m3's grid: 3 mantissa bits for |y| >= 2^-6 (biased
    float32 exponent 121), multiples of 2^-9 below (e4m3's subnormals)."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    significand = (bits & 0x7FFFFF) | 0x800000  # 24 bits, the implicit one included (0 and tiny values: see below)
    # float32 keeps 23 mantissa bits and e4m3 3; below 2^-6 each halving of y drops one bit more. Past 31 dropped
    # bits (|y| < 2^-17, float32 zeros and subnormals included) the result is 0, as it is from 25 on.
    drop = tl.minimum(20 + tl.maximum(121 - exponent, 0), 31)
    half = (1 << (drop - 1)) - 1
    odd = (significand >> drop) & 1
    kept = ((significand + half + odd) >> drop) << drop  # may carry to 2^24: still exact in float32
    # 2^(exponent - 150), kept finite where kept is 0 anyway (exponent < 24)
    unit = ((tl.maximum(exponent, 24) - 23) << 23).to(tl.float32, bitcast=True)
    rounded = kept.to(tl.float32) * unit
    return tl.where(bits < 0, -rounded, rounded)  # the sign bit's: -0.0 too, as torch's cast keeps it


@triton.jit
def quantize_e4m3(x, scale, out_ty: tl.constexpr):
    """x / scale stored as e4m3 (out_ty): divided exactly (IEEE), clamped to +-448, rounded to nearest even."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -FP8_E4M3_MAX), FP8_E4M3_MAX)
    return _round_to_e4m3_grid(y).to(out_ty)


@triton.jit
def store_to_cache(ptr, x, scale_ptr, mask, FP8: tl.constexpr):
    """Store x at ptr in the cache's element type: quantized with the scale at scale_ptr into an FP8 cache."""
    ty = ptr.dtype.element_ty
    if FP8:
        tl.store(ptr, quantize_e4m3(x, tl.load(scale_ptr), ty), mask=mask)
    else:
        tl.store(ptr, x.to(ty), mask=mask)


def cache_scales(kv_cache: torch.Tensor, scales) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(k_scale, v_scale, whether kv_cache is FP8) for a kernel's launch. An FP8 cache needs the layer's scales
    (attention/kv_quant.KVScales, float32 [1] on the cache's device); another cache reads none, and its kernel
    gets the cache in their place."""
    if not is_fp8(kv_cache):
        return kv_cache, kv_cache, False
    if scales is None:
        raise ValueError("an FP8 KV cache is written and read with its layer's k_scale and v_scale; none were given")
    for name in ("k_scale", "v_scale"):
        t = getattr(scales, name)
        if t.dtype != torch.float32 or t.numel() != 1 or t.device != kv_cache.device:
            raise ValueError(f"{name} must be one float32 value on {kv_cache.device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    return scales.k_scale, scales.v_scale, True
