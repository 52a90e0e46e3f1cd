"""The block-scaled FP8 GEMM (kernels/block_fp8_gemm.py) against float64 with the weights the codes rebuild; the
layer's fused path against its reference; inputs are views into NaN buffers, K and N no multiples of the tiles."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from specserve.kernels.block_fp8_gemm import block_fp8_linear
from specserve.models.layers import set_fused_kernels
from specserve.quantization.block_fp8_linear import BlockFp8Linear
from specserve.quantization.gguf_blocks import decode_blocks, dequantize_blocks

from .util import DEVICE, assert_close, poisoned_view

K, N = 320, 100  # 2.5 K tiles of 128, N past the column tiles


def _blocks(ggml_type: str, seed: int):
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.1
    b = decode_blocks(quantize(w, GGMLQuantizationType[ggml_type]), ggml_type, w.shape)
    return [None if t is None else t.to(DEVICE) for t in (b.codes, b.scale, b.offset)]


@pytest.mark.parametrize("ggml_type", ["Q4_1", "Q4_0"])
@pytest.mark.parametrize("m", [1, 7, 33, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_against_float64_with_the_rebuilt_weight(ggml_type, m, dtype):
    codes, scale, offset = _blocks(ggml_type, m)
    x = poisoned_view(m, K, dtype, m + 1)
    out = block_fp8_linear(x, codes, scale, offset)
    assert out.dtype == dtype and out.shape == (m, N) and not out.isnan().any()
    weight = dequantize_blocks(codes, scale, offset).to(dtype)  # what the unquantized model holds
    assert_close(out, x.double() @ weight.double().T, terms=K)


def test_bad_operands_are_refused():
    codes, scale, offset = _blocks("Q4_1", 0)
    x = torch.randn(2, K, device=DEVICE)
    with pytest.raises(ValueError, match="scale \\(and offset\\)"):
        block_fp8_linear(x, codes, scale[:, :-1], offset)
    with pytest.raises(ValueError, match="scale \\(and offset\\)"):
        block_fp8_linear(x[:, :-32], codes, scale, offset)
    with pytest.raises(ValueError, match="contiguous"):
        block_fp8_linear(x, codes, scale.t().contiguous().t(), offset)


def test_the_layer_kernel_path_equals_its_reference():
    codes, scale, offset = _blocks("Q4_1", 3)
    layer = BlockFp8Linear(K, N, bias=True, has_offset=True).to(DEVICE)
    for param, value in ((layer.weight, codes), (layer.block_scale, scale), (layer.block_offset, offset)):
        param.data.copy_(value)
    layer.bias.data.normal_()
    x = torch.randn(2, 9, K, device=DEVICE)
    set_fused_kernels(layer, False)
    reference = layer(x)
    set_fused_kernels(layer, True)
    assert_close(layer(x), reference, terms=K)
