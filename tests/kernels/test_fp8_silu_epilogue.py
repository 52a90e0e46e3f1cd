"""SiLU-and-mul in the epilogue of an FP8 gate/up projection: the FP8 dot kernel's (kernels/fp8_gemm.py,
fp8_dot_silu_mul) and the small-M kernel's (kernels/fused_linear.py, fp8_linear_silu_mul). Their products equal
silu_and_mul of the same kernel's plain projection (bit for bit under the interpreter, whose sums are the plain
tile's; within a bfloat16 ulp on a GPU), whose own tests hold it to float64; each program's amax is its
products' largest magnitude,
and the chunked quantization of the products equals quantize_rows of them. The FP8 layer's silu_and_mul_rows
gives what SiLU-and-mul after the projection gives, and its route falls back where no epilogue runs."""
from __future__ import annotations

import pytest
import torch

from specserve.kernels.activation import silu_and_mul, silu_and_mul_fp8_rows
from specserve.kernels.fp8_gemm import Fp8DotTile, fp8_dot, fp8_dot_silu_mul
from specserve.kernels.fp8_gemm_choice import FP8_DOT, SCALED_MM, TRITON, Fp8GemmChoice
from specserve.kernels.fp8_rows import quantize_chunked_rows, quantize_rows
from specserve.kernels.fused_linear import fp8_linear, fp8_linear_silu_mul
from specserve.kernels.small_m_configs import SmallMConfig
from specserve.models.layers import set_fused_kernels
from specserve.quantization import fp8_linear as fp8_linear_module
from specserve.quantization.fp8 import Fp8Rows, quantize_per_channel, quantize_per_token
from specserve.quantization.fp8_linear import Fp8GemmRoute, Fp8Linear

from .test_fp8_folded import assert_same_rows
from .util import DEVICE, poisoned_view

# I = 45: no multiple of any tile's columns; K = 200: none of the K blocks'.
K, INTER = 200, 45


def _gate_up(seed: int):
    """An e4m3 gate/up weight [2I, K] (a view into a NaN buffer) and its per-row scales."""
    q, scale = quantize_per_channel(poisoned_view(2 * INTER, K, torch.float32, seed))
    buf = torch.full((2 * INTER + 2, K + 8), float("nan"), device=DEVICE).to(q.dtype)
    buf[:2 * INTER, :K] = q
    return buf[:2 * INTER, :K], scale


def _dot(tile):
    return (lambda xq, wq, ws, xs, dtype: fp8_dot_silu_mul(xq, wq, ws, xs, out_dtype=dtype, tile=tile),
            lambda xq, wq, ws, xs, dtype: fp8_dot(xq, wq, ws, xs, out_dtype=dtype, tile=tile))


def _small_m(config):
    # The plain projection's tile over 2I columns, as the layer's route halves it for the epilogue's two halves.
    plain = SmallMConfig(config.block_n, config.block_k, config.num_warps, config.num_stages)
    return (lambda xq, wq, ws, xs, dtype: fp8_linear_silu_mul(xq, wq, ws, xs, dtype, config=config),
            lambda xq, wq, ws, xs, dtype: fp8_linear(xq, wq, ws, xs, out_dtype=dtype, config=plain))


CASES = {"fp8_dot 16x16": (_dot(Fp8DotTile(16, 16, 32, 4, 2)), 16, [1, 33]),
         "fp8_dot 64x32 promoted per 64": (_dot(Fp8DotTile(64, 32, 64, 4, 3, promote_k=64)), 32, [64, 80]),
         "small-M 16": (_small_m(SmallMConfig(16, 32, 4, 2)), 16, [1, 7]),
         "small-M 32": (_small_m(SmallMConfig(32, 64, 4, 2)), 32, [32])}
PARAMS = [(name, m) for name, (_, _, ms) in CASES.items() for m in ms]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case, m", PARAMS, ids=[f"{name}, {m} rows" for name, m in PARAMS])
def test_the_epilogue_equals_silu_and_mul_after_the_projection(case, m, dtype):
    (fused, plain), block_n, _ = CASES[case]
    wq, ws = _gate_up(seed=m)
    xq, xs = quantize_per_token(poisoned_view(m, K, dtype, seed=m + 1))
    products, amax = fused(xq, wq, ws, xs, dtype)
    gate_up = plain(xq, wq, ws, xs, dtype)
    want = silu_and_mul(gate_up)
    assert products.shape == (m, INTER) and products.dtype == dtype and not products.isnan().any()
    if DEVICE == "cpu":
        assert torch.equal(products, want)
    else:
        # The halves' sums are a dot of half the columns: a bfloat16 ulp of a product where they round apart.
        torch.testing.assert_close(products.float(), want.float(), rtol=2 ** -6, atol=0)
    # A program's largest product magnitude per row, its block_n columns.
    chunks = products.float().abs().split(block_n, dim=1)
    assert amax.shape == (m, len(chunks))
    assert torch.equal(amax, torch.stack([c.amax(dim=1) for c in chunks], dim=1))
    q, scale = quantize_chunked_rows(products, amax)
    want_q, want_scale = quantize_rows(products)
    assert_same_rows(Fp8Rows(q, scale, dtype), want_q, want_scale, dtype)


def test_bad_gate_up_operands_are_refused():
    wq, ws = _gate_up(seed=0)
    xq, xs = quantize_per_token(torch.randn(4, K, device=DEVICE))
    with pytest.raises(ValueError, match="even number of rows and an unsplit tile"):
        fp8_dot_silu_mul(xq, wq, ws, xs, tile=Fp8DotTile(16, 16, 32, 4, 2, split_k=2))
    with pytest.raises(ValueError, match="even number of rows and an unsplit tile"):
        fp8_dot_silu_mul(xq, wq[:-1], ws[:-1], xs)
    with pytest.raises(ValueError, match="even number of rows and an unsplit tile"):
        fp8_linear_silu_mul(xq, wq, ws, xs, torch.bfloat16, config=SmallMConfig(16, 32, 4, 2, split_k=2))
    with pytest.raises(ValueError, match="takes an FP8 x with its x_scale"):
        fp8_linear_silu_mul(xq.float(), wq, ws, None, torch.float32)


def _gate_up_layer(bias: bool = False) -> Fp8Linear:
    layer = Fp8Linear.quantize(torch.nn.Linear(K, 2 * INTER, bias=bias).to(DEVICE))
    set_fused_kernels(layer, True)
    return layer


@pytest.mark.parametrize("m", [1, 9])
def test_the_layer_gives_what_silu_and_mul_after_it_gives(m):
    """A float32 layer's route is the small-M kernel (torch._scaled_mm outputs bfloat16 only), whose epilogue
    applies SiLU-and-mul: the FP8 rows for down_proj are those of SiLU-and-mul's own kernel after the
    projection."""
    layer = _gate_up_layer()
    x = poisoned_view(m, K, torch.float32, seed=m + 5)
    rows = Fp8Rows(*quantize_rows(x), torch.float32)
    assert layer.silu_route(m, torch.float32) is not None
    got = layer.silu_and_mul_rows(rows)
    want = silu_and_mul_fp8_rows(layer.forward_rows(rows))
    assert_same_rows(got, want.q, want.scale, torch.float32, exact=DEVICE == "cpu")


def test_the_route_halves_the_tile_and_falls_back_where_no_epilogue_runs(monkeypatch):
    layer = _gate_up_layer()

    def table_says(kernel, **tile):
        monkeypatch.setattr(fp8_linear_module, "choose", lambda n, k, m, device: Fp8GemmChoice(n, k, m, kernel, **tile))

    table_says(FP8_DOT, block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4)
    assert layer.silu_route(64, torch.bfloat16) == Fp8GemmRoute(FP8_DOT, Fp8DotTile(64, 64, 128, 4, 4))
    table_says(FP8_DOT, block_m=64, block_n=16, block_k=128, num_warps=4, num_stages=4)
    assert layer.silu_route(64, torch.bfloat16).tile.block_n == 16, "no narrower than a dot's 16 columns"
    table_says(FP8_DOT, block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=2)
    assert layer.silu_route(64, torch.bfloat16) is None, "the epilogue's kernels run unsplit"
    table_says(TRITON, block_n=128, block_k=256, num_warps=8, num_stages=3)
    assert layer.silu_route(1, torch.bfloat16) == Fp8GemmRoute(TRITON, SmallMConfig(64, 256, 8, 3))
    table_says(SCALED_MM)
    assert layer.silu_route(1, torch.bfloat16) is None, "cuBLAS has no SiLU-and-mul epilogue"
    table_says(TRITON, block_n=128, block_k=256, num_warps=8, num_stages=3)
    assert _gate_up_layer(bias=True).silu_route(1, torch.bfloat16) is None, "the epilogue adds no bias"
