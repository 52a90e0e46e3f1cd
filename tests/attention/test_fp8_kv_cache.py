"""The FP8 KV cache's writes and reads, kernel by kernel, against an independent float64 e4m3 reference.

The reference (tests/e4m3.py) rounds in float64 to the nearest of e4m3's 253 finite values, built from the
format's definition (sign, 4 exponent bits of bias 7, 3 mantissa bits; subnormals below 2^-6; 448 the largest),
ties to the even mantissa: no torch or Triton cast is involved. Every writer (the torch reference backend,
reshape_and_cache, rotary_cache, qkv_rotary_cache) must store exactly the reference's values; attention over
the cache must equal float64 attention over the dequantized keys and values to float32 rounding, and the
unquantized keys and values to a tolerance that follows from e4m3's precision.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from specserve.attention.kv_quant import FP8_KV_DTYPE, KVScales, quantize_fp8  # noqa: E402
from specserve.attention.metadata import PAD_SLOT_ID  # noqa: E402
from specserve.attention.torch_backend import TorchAttentionBackend, write_kv_cache  # noqa: E402
from specserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from specserve.kernels.qkv_rotary_cache import qkv_rotary_cache  # noqa: E402
from specserve.kernels.reshape_and_cache import write_kv_cache_triton  # noqa: E402
from specserve.kernels.rotary_cache import rotary_and_cache  # noqa: E402
from specserve.models.layers import RotaryEmbedding  # noqa: E402

from e4m3 import GRID, e4m3_reference  # noqa: E402
from test_triton_attention import DEVICE, MIXED_Q_LENS, MIXED_SEQ_LENS, dense_attention, make_batch  # noqa: E402

# e4m3's relative spacing: 3 mantissa bits, so rounding to nearest errs by at most 2^-4 of a normal value.
E4M3_UNIT_ROUNDOFF = 2.0**-4


def test_reference_matches_the_format():
    assert len(GRID) == 253 and GRID.max() == 448 and GRID[GRID > 0].min() == 2.0**-9
    # Ties go to the even mantissa: 1 + 1/16 lies between 1 and 1.125.
    assert e4m3_reference(torch.tensor([1.0625, 1.1875, 500.0, -1e9, 2.0**-10]), 1.0).tolist() == [
        1.0, 1.25, 448.0, -448.0, 0.0]
    # torch's own cast agrees wherever it does not overflow to NaN.
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 30
    assert torch.equal(quantize_fp8(x, torch.tensor([0.37])).double(), e4m3_reference(x, 0.37))


def scales(k_scale: float, v_scale: float) -> KVScales:
    return KVScales(k_scale, v_scale).to(DEVICE)


# Scales: none (1.0), powers of two, and ones that make division inexact; values past 448 x scale saturate.
SCALES = [(1.0, 1.0), (0.5, 4.0), (0.37, 0.021)]


def kv_inputs(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, spread: float, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * spread).to(DEVICE, dtype)
    v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * spread).to(DEVICE, dtype)
    return k, v


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("writer", ["torch", "triton"])
def test_cache_writes_store_the_reference_quantization(writer, dtype, k_scale, v_scale):
    num_kv_heads, head_dim, block_size, num_blocks = 3, 64, 4, 6
    # Magnitudes from 1e-4 to beyond the saturation point: subnormals, normals and clamped values.
    k, v = kv_inputs(12, num_kv_heads, head_dim, dtype, spread=1.0)
    k, v = k * 10 ** torch.linspace(-4, 2.5, head_dim).to(DEVICE, dtype), v * 50
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:10]
    slots[[2, 5, 9]] = PAD_SLOT_ID
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), math.nan, dtype=FP8_KV_DTYPE,
                       device=DEVICE)
    write = write_kv_cache if writer == "torch" else write_kv_cache_triton
    write(k, v, cache, slots.to(DEVICE), scales(k_scale, v_scale))

    flat = cache.view(2, -1, num_kv_heads, head_dim).cpu()
    owners = (slots != PAD_SLOT_ID).nonzero()[:, 0]
    assert torch.equal(flat[0, slots[owners]].double() * k_scale, e4m3_reference(k[owners].cpu(), k_scale) * k_scale)
    assert torch.equal(flat[1, slots[owners]].double() * v_scale, e4m3_reference(v[owners].cpu(), v_scale) * v_scale)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots[owners]] = False
    assert flat[:, untouched].float().isnan().all(), "wrote a slot it should not have"


@pytest.mark.parametrize("k_scale,v_scale", SCALES[1:])
def test_rotary_cache_stores_the_rotated_keys_quantized(k_scale, v_scale):
    num_heads, num_kv_heads, head_dim, block_size, num_tokens = 4, 2, 64, 16, 5
    gen = torch.Generator().manual_seed(2)
    rotary = RotaryEmbedding(head_dim, 256, 10000.0, {}).to(DEVICE)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    k, v = kv_inputs(num_tokens, num_kv_heads, head_dim, torch.bfloat16, spread=3.0, seed=3)
    positions = torch.randint(0, 256, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(3 * block_size, generator=gen)[:num_tokens]
    cache = torch.zeros(2, 3, block_size, num_kv_heads, head_dim, dtype=FP8_KV_DTYPE, device=DEVICE)
    rotary_and_cache(positions, q, k, v, rotary.cos, rotary.sin, cache, slots.to(DEVICE), scales(k_scale, v_scale))
    flat = cache.view(2, -1, num_kv_heads, head_dim).cpu()
    # k now holds the rotated keys in bfloat16, which the cache holds quantized.
    assert torch.equal(flat[0, slots].double(), e4m3_reference(k.cpu(), k_scale))
    assert torch.equal(flat[1, slots].double(), e4m3_reference(v.cpu(), v_scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qkv_kernel_stores_its_keys_and_values_quantized(dtype):
    """The fused qkv kernel into an FP8 cache holds the reference quantization of what it stores into a cache of
    the input's dtype (the same projection, rotary and rounding), and returns the same q."""
    num_heads, num_kv_heads, head_dim, block_size, m, k_in = 4, 2, 16, 4, 5, 48
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(m, k_in, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn((num_heads + 2 * num_kv_heads) * head_dim, k_in, generator=gen) * 2).to(DEVICE, dtype)
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, {}).to(DEVICE)
    positions = torch.randint(0, 64, (m,), generator=gen).to(DEVICE)
    slots = torch.randperm(4 * block_size, generator=gen)[:m]
    slots[1] = PAD_SLOT_ID
    plain = torch.full((2, 4, block_size, num_kv_heads, head_dim), math.nan, dtype=dtype, device=DEVICE)
    fp8 = torch.full_like(plain, math.nan, dtype=FP8_KV_DTYPE)
    args = (positions, rotary.cos, rotary.sin)
    q_plain, _ = qkv_rotary_cache(x, weight, *args, plain, slots.to(DEVICE), num_heads)
    q_fp8, _ = qkv_rotary_cache(x, weight, *args, fp8, slots.to(DEVICE), num_heads, scales=scales(0.37, 2.0))
    assert torch.equal(q_plain, q_fp8)
    flat_plain = plain.view(2, -1, num_kv_heads, head_dim).cpu()
    flat_fp8 = fp8.view(2, -1, num_kv_heads, head_dim).cpu()
    written = slots[slots != PAD_SLOT_ID]
    assert torch.equal(flat_fp8[0, written].double(), e4m3_reference(flat_plain[0, written], 0.37))
    assert torch.equal(flat_fp8[1, written].double(), e4m3_reference(flat_plain[1, written], 2.0))
    assert torch.equal(flat_fp8.float().isnan(), flat_plain.float().isnan()), "wrote other slots than the plain cache"


def quantized_batch(dtype: torch.dtype, k_scale: float, v_scale: float, pad_tokens: int = 0):
    """make_batch's mixed batch with an FP8 cache: its cached prefix stored quantized, and the history the dense
    references read: as given, and as the cache holds it (dequantized, float64)."""
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, 9, 3, 64, dtype, pad_tokens=pad_tokens)
    # The prefix entries are written as the model would; everything else stays NaN, as in make_batch.
    cache = torch.full_like(batch.kv_cache, math.nan, dtype=FP8_KV_DTYPE)
    layer = scales(k_scale, v_scale)
    valid = ~batch.kv_cache[0].isnan().all(-1).all(-1)
    for part, scale in ((0, layer.k_scale), (1, layer.v_scale)):
        cache[part][valid] = quantize_fp8(batch.kv_cache[part][valid], scale)
    dequantized = [(e4m3_reference(k.cpu(), k_scale) * k_scale, e4m3_reference(v.cpu(), v_scale) * v_scale)
                   for k, v in batch.history]
    return batch, cache, layer, dequantized


def dense_over(batch, history, scale: float) -> torch.Tensor:
    original = batch.history
    batch.history = [(k.to(DEVICE), v.to(DEVICE)) for k, v in history]
    try:
        return dense_attention(batch, scale)
    finally:
        batch.history = original


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend, TritonAttentionBackend], ids=["torch", "triton"])
def test_attention_reads_the_fp8_cache_dequantized(backend_cls, k_scale, v_scale):
    """float32 inputs: the only difference from float64 attention over the dequantized cache is float32
    rounding; from attention over the unquantized keys and values, e4m3's."""
    batch, cache, layer, dequantized = quantized_batch(torch.float32, k_scale, v_scale, pad_tokens=2)
    out = backend_cls().forward(batch.q, batch.k, batch.v, cache, batch.metadata, 0.125, layer)
    n = batch.num_real_tokens
    torch.testing.assert_close(out[:n].double(), dense_over(batch, dequantized, 0.125), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    # Each value errs by at most E4M3_UNIT_ROUNDOFF of its size; so does a weighted mean of them. Key errors move
    # the weights: a logit errs by at most the roundoff times the sum of |q_i k_i| x scale (here about 0.2 of a
    # logit's spread), which moves the mean by as much again.
    exact = dense_attention(batch, 0.125)
    bound = 2 * E4M3_UNIT_ROUNDOFF * max(v.abs().max().item() for _, v in batch.history)
    assert (out[:n].double() - exact).abs().max().item() <= bound
    # Not the unquantized result: the cache did round.
    assert not torch.allclose(out[:n].double(), exact, atol=1e-4)


def test_attention_of_bfloat16_queries_over_an_fp8_cache():
    batch, cache, layer, dequantized = quantized_batch(torch.bfloat16, 0.5, 0.25)
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        out = backend.forward(batch.q, batch.k, batch.v, cache.clone(), batch.metadata, 0.125, layer)
        torch.testing.assert_close(out.double(), dense_over(batch, dequantized, 0.125), atol=1e-2, rtol=1e-2)


def test_an_fp8_cache_without_scales_is_refused():
    k, v = kv_inputs(2, 1, 16, torch.float32, 1.0)
    cache = torch.zeros(2, 2, 4, 1, 16, dtype=FP8_KV_DTYPE, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    for write in (write_kv_cache, write_kv_cache_triton):
        with pytest.raises(ValueError, match="FP8 KV cache"):
            write(k, v, cache, slots)
    wrong = KVScales()  # on the CPU in float32: right; a float64 scale is not
    wrong.k_scale = wrong.k_scale.double()
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="k_scale must be one float32 value"):
            write_kv_cache_triton(k, v, cache, slots, wrong)


def test_scales_stay_float32_through_casts_and_moves():
    layer = KVScales(0.5, 2.0)
    layer.to(torch.bfloat16)
    assert layer.k_scale.dtype == torch.float32 and layer.k_scale.item() == 0.5 and layer.v_scale.item() == 2.0
    with torch.device("meta"):
        built = KVScales(0.25, 1.0)
    built.to_empty(device="cpu")
    assert built.k_scale.item() == 0.25, "materialising a model built on meta keeps the scales"
    with pytest.raises(ValueError, match="positive"):
        KVScales(0.0, 1.0)
