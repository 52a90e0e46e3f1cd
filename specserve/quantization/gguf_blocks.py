"""A GGUF's block-quantized projection weights as FP8 codes with block scales (docs/design.md, 'FP8 weights').

Q4_0, Q4_1 and Q5_0 store each run of 32 weights along K as small integer codes with a float16 scale d (and for
Q4_1 a float16 offset m): w = d * c with c = q - 8 in -8..7 (Q4_0) or q - 16 in -16..15 (Q5_0), w = d * c + m with
c = q in 0..15 (Q4_1). e4m3 holds every integer of magnitude up to 16 exactly, so the codes become e4m3 without
loss, and code * scale + offset in float32 (d * c is exact there: 11 bits by 5) is bit for bit the float32
weight the GGUF library's dequantization gives, which the unquantized model rounds to its dtype. The layout
reads 9 bits a weight (16 in bfloat16). Other GGML types (Q5_1, the K-quants, Q8_0) have codes e4m3 does not
hold, or scales of another shape: their models take per-channel FP8 scales.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specserve.quantization.fp8 import FP8_DTYPE

# Weights a block's scale (and offset) covers, along K: every format here.
GROUP = 32
# GGML type -> (the value subtracted from the stored code, whether a block has an offset).
_FORMATS = {"Q4_0": (8, False), "Q4_1": (0, True), "Q5_0": (16, False)}
HELD_TYPES = tuple(_FORMATS)


@dataclass(frozen=True)
class BlockCodes:
    """One weight [N, K] as codes [N, K] (float8_e4m3fn), scale [N, K // GROUP] (float16) and offset (the same,
    or None for a format without one): weight = code * scale + offset, each block's scale and offset repeated over
    its GROUP weights."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None


def has_offset(ggml_type: str) -> bool:
    return _FORMATS[ggml_type][1]


def decode_blocks(data: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> BlockCodes:
    """The BlockCodes of a GGUF tensor's raw bytes `data` ([N, bytes a row], uint8) of type ggml_type (one of
    HELD_TYPES), whose weight is shape [N, K]."""
    rows, k = shape
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows * (k // GROUP), -1)
    d, rest = blocks[:, :2], blocks[:, 2:]
    m = None
    if ggml_type == "Q4_1":
        m, rest = rest[:, :2], rest[:, 2:]
    high = None
    if ggml_type == "Q5_0":
        high, rest = rest[:, :4], rest[:, 4:]
    # The low nibbles hold a block's first 16 weights, the high nibbles its last 16.
    q = np.concatenate([rest & np.uint8(0x0F), rest >> np.uint8(4)], axis=1)
    if high is not None:
        bits = np.ascontiguousarray(high).view(np.uint32).reshape(-1, 1) >> np.arange(GROUP, dtype=np.uint32)
        q = q | ((bits & np.uint32(1)).astype(np.uint8) << np.uint8(4))
    codes = q.astype(np.float32) - np.float32(_FORMATS[ggml_type][0])

    def per_block(b: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(b).view(np.float16).reshape(rows, k // GROUP).copy())

    return BlockCodes(torch.from_numpy(codes.reshape(rows, k)).to(FP8_DTYPE), per_block(d),
                      None if m is None else per_block(m))


def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """code * scale + offset [N, K] in float32, the weight the unquantized model holds before its dtype."""
    rows, k = codes.shape
    w = codes.float().view(rows, -1, GROUP) * scale.float()[:, :, None]
    if offset is not None:
        w = w + offset.float()[:, :, None]
    return w.view(rows, k)


def block_codes_of(weight: torch.Tensor, ggml_type: str) -> BlockCodes:
    """weight [N, K] rounded to ggml_type's codes, on its device: each block's range over the 16 levels and its
    minimum as the offset (Q4_1), or its largest magnitude over the signed levels (Q4_0, Q5_0). For weights that no
    file holds (random ones, whose speed is the layout's)."""
    rows, k = weight.shape
    w = weight.detach().float().view(rows, k // GROUP, GROUP)
    shift, offset = _FORMATS[ggml_type]
    tiny = torch.finfo(torch.float16).tiny
    if offset:
        low = w.amin(-1, keepdim=True)
        scale = ((w.amax(-1, keepdim=True) - low) / 15).clamp_min(tiny).half()
        codes = ((w - low) / scale.float()).round().clamp(0, 15)
    else:
        low = None
        scale = (w.abs().amax(-1, keepdim=True) / shift).clamp_min(tiny).half()
        codes = (w / scale.float()).round().clamp(-shift, shift - 1)
    return BlockCodes(codes.view(rows, k).to(FP8_DTYPE), scale.view(rows, -1),
                      None if low is None else low.half().view(rows, -1))
