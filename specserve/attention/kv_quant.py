"""The KV cache's element type, and FP8 (e4m3) quantization of keys and values in plain PyTorch.

With kv_cache_dtype "fp8" (docs/design.md, 'FP8 KV cache') every layer's cache holds
torch.float8_e4m3fn: a key k is stored as round(clamp(k / k_scale, -448, 448)) and read back as
stored * k_scale, values with v_scale. The scales are per layer and per tensor (KVScales), float32, 1.0
unless set. This module is the reference the Triton kernels (kernels/fp8_kv.py) match exactly.
"""
from __future__ import annotations

import torch
from torch import nn

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448
# kv_cache_dtype -> the cache's element type (None: the model's dtype).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": FP8_KV_DTYPE}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


class KVScales(nn.Module):
    """One attention layer's k_scale and v_scale: float32 [1] tensors on the layer's device, read by the kernels
    on the device (no host sync, so CUDA graphs capture them). They stay float32 when the model is cast, and are
    rebuilt from their values when it moves (models are built on the meta device, then materialised)."""

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0):
        super().__init__()
        self.set(k_scale, v_scale, torch.device("cpu"))

    def set(self, k_scale: float, v_scale: float, device: torch.device | None = None) -> None:
        if not (k_scale > 0 and v_scale > 0):
            raise ValueError(f"KV cache scales must be positive, got k_scale={k_scale}, v_scale={v_scale}")
        self.values = (float(k_scale), float(v_scale))
        device = device or self.k_scale.device
        self.register_buffer("k_scale", torch.tensor([k_scale], dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("v_scale", torch.tensor([v_scale], dtype=torch.float32, device=device), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.set(*self.values, self.k_scale.device)
        return self


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in e4m3, saturated at +-448 (torch's cast alone would make NaN of what lies past it)."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_fp8(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What an FP8 cache entry stands for, in float32."""
    return stored.float() * scale


def store_kv(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x as cache's element type holds it: quantized with scale for FP8, else cast."""
    if is_fp8(cache):
        if scale is None:
            raise ValueError("an FP8 KV cache is written with its layer's scale; none was given")
        return quantize_fp8(x, scale)
    return x.to(cache.dtype)


def load_kv(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache entries as dtype: dequantized with scale for FP8, else cast."""
    if is_fp8(stored):
        if scale is None:
            raise ValueError("an FP8 KV cache is read with its layer's scale; none was given")
        return dequantize_fp8(stored, scale).to(dtype)
    return stored.to(dtype)
