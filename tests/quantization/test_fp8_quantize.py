"""FP8 quantization and the FP8 linear layer against float64 references; the GEMM choice table; the options."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from specserve.errors import ConfigError
from specserve.kernels import fp8_gemm_choice
from specserve.kernels.fp8_gemm_choice import Fp8DotTile, Fp8GemmChoice, choose, write_choices
from specserve.kernels.small_m_configs import FALLBACK_DEVICE
from specserve.kernels.small_m_configs import SmallMConfig
from specserve.quantization.fp8 import FP8_DTYPE, FP8_MAX, FP8_RELATIVE_ERROR, quantize_per_channel, quantize_per_token
from specserve.quantization.fp8_linear import Fp8Activation, Fp8Linear

# e4m3's subnormals are multiples of 2**-9: below the smallest normal (2**-6) rounding errs by up to 2**-10.
SUBNORMAL_HALF_STEP = 2.0 ** -10


def rounding_bound(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The most e4m3 rounding may move each value (float64), given the scale it was quantized with."""
    return torch.maximum(FP8_RELATIVE_ERROR * values.abs(), SUBNORMAL_HALF_STEP * scale) * (1 + 1e-6)


def test_per_channel_weights_against_float64():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-3, 2, 64)[:, None]  # channels of very different ranges
    w[5] = 0.0  # an all-zero channel
    q, scale = quantize_per_channel(w)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (64,)
    w64, s64 = w.double(), scale.double()[:, None]
    assert torch.allclose(s64[:, 0], (w64.abs().amax(1) / FP8_MAX).clamp(min=scale[5].item()), rtol=1e-6)
    back = q.double() * s64
    assert torch.all((back - w64).abs() <= rounding_bound(w64, s64))
    # Each channel's largest magnitude maps onto e4m3's largest value; nothing overflows to NaN.
    rows = [i for i in range(64) if i != 5]
    assert torch.equal(q.float().abs().amax(1)[rows], torch.full((63,), FP8_MAX))
    assert torch.equal(q[5].float(), torch.zeros(96)) and not torch.isnan(q.float()).any()


def test_per_token_activations_against_float64():
    torch.manual_seed(1)
    x = torch.randn(7, 48) * torch.tensor([1e-4, 1e-2, 1, 10, 1e3, 1, 0])[:, None]
    q, scale = quantize_per_token(x)
    assert scale.shape == (7, 1)
    x64, s64 = x.double(), scale.double()
    assert torch.all((q.double() * s64 - x64).abs() <= rounding_bound(x64, s64))
    # A row's quantization depends on that row alone.
    q1, s1 = quantize_per_token(x[2:3])
    assert torch.equal(q1.float(), q[2:3].float()) and torch.equal(s1, scale[2:3])


def _layer(w: torch.Tensor, activation: Fp8Activation, bias: torch.Tensor | None = None) -> Fp8Linear:
    layer = Fp8Linear.quantize(nn.Linear(w.shape[1], w.shape[0], bias=bias is not None))
    q, scale = quantize_per_channel(w)
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(scale)
    layer.activation = activation
    if bias is not None:
        layer.bias.data = bias.clone()
    return layer


@pytest.mark.parametrize("activation", [Fp8Activation.DYNAMIC, Fp8Activation.NONE])
def test_fp8_linear_against_its_float64_reference(activation):
    torch.manual_seed(2)
    w, x, b = torch.randn(40, 64), torch.randn(9, 64), torch.randn(40)
    layer = _layer(w, activation, b)
    xq, xs = layer.quantize_input(x)
    x64 = xq.double() if xs is None else xq.double() * xs.double()
    want = x64 @ (layer.weight.double() * layer.weight_scale.double()[:, None]).T + b.double()
    assert torch.allclose(layer(x).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", [Fp8Activation.DYNAMIC, Fp8Activation.NONE])
def test_fp8_linear_against_the_unquantized_linear_within_e4m3_precision(activation):
    """Each product x_k w_k errs by at most its two operands' rounding: (2 * 2**-4 + 2**-8) of |x_k w_k|, plus
    the subnormal steps; summed over k, that bounds the output's error against the float64 linear."""
    torch.manual_seed(3)
    w, x = torch.randn(40, 64), torch.randn(9, 64)
    layer = _layer(w, activation)
    out = layer(x).double()
    want = x.double() @ w.double().T
    eps_x = FP8_RELATIVE_ERROR if activation is Fp8Activation.DYNAMIC else 0.0
    rel = FP8_RELATIVE_ERROR + eps_x + FP8_RELATIVE_ERROR * eps_x
    w_scale = w.abs().amax(1).double() / FP8_MAX
    x_scale = x.abs().amax(1, keepdim=True).double() / FP8_MAX if eps_x else torch.zeros(9, 1, dtype=torch.float64)
    bound = (rel * x.double().abs() @ w.double().abs().T
             + SUBNORMAL_HALF_STEP * (x.double().abs().sum(1, keepdim=True) * w_scale[None, :] * 1.1
                                       + x_scale * w.double().abs().sum(1)[None, :] * 1.1) + 1e-5)
    assert torch.all((out - want).abs() <= bound)
    # Not vacuous: the quantized layer is not the float one. Rounding errors of random sign mostly cancel: the
    # typical error is far inside the worst case.
    assert not torch.allclose(out, want, atol=1e-6)
    assert (out - want).abs().mean() < 0.1 * bound.mean()


def test_static_input_scale_uses_the_largest_part():
    torch.manual_seed(4)
    w, x = torch.randn(24, 32), torch.randn(5, 32)
    layer = Fp8Linear(32, 24, False, Fp8Activation.STATIC, parts=3)
    q, scale = quantize_per_channel(w)
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(scale)
    layer.input_scale.data.copy_(torch.tensor([0.004, 0.02, 0.01]))
    xq, xs = layer.quantize_input(x)
    assert torch.equal(xs, torch.full((5, 1), 0.02))
    want = (xq.double() * 0.02) @ (q.double() * scale.double()[:, None]).T
    assert torch.allclose(layer(x).double(), want, rtol=1e-5, atol=1e-5)


def test_casting_the_model_keeps_fp8_weights_and_float32_scales():
    layer = _layer(torch.randn(16, 32), Fp8Activation.DYNAMIC, torch.randn(16))
    scale = layer.weight_scale.clone()
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == FP8_DTYPE and layer.bias.dtype == torch.bfloat16
    assert torch.equal(layer.weight_scale, scale)


def test_scaled_mm_on_the_cpu_matches_the_reference():
    """torch._scaled_mm (rowwise scales, bfloat16 output), the CUDA path's GEMM, runs on the CPU too."""
    torch.manual_seed(5)
    layer = _layer(torch.randn(48, 64), Fp8Activation.DYNAMIC)
    x = torch.randn(40, 64).to(torch.bfloat16)
    xq, xs = layer.quantize_input(x)
    got = torch._scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=layer.weight_scale.view(1, -1),
                           out_dtype=torch.bfloat16)
    want = layer.reference(xq, xs, torch.float32)
    assert torch.allclose(got.float(), want, rtol=2 ** -7, atol=1e-3)


def test_the_choice_table(tmp_path, monkeypatch):
    from specserve.kernels.small_m_prologue import MAX_ROWS

    assert fp8_gemm_choice.TRITON_MAX_ROWS == MAX_ROWS
    monkeypatch.setattr(fp8_gemm_choice, "CHOICE_DIR", tmp_path)
    fp8_gemm_choice.load_choices.cache_clear()
    cpu = torch.device("cpu")
    assert choose(64, 32, 1, cpu).kernel == "scaled_mm"  # no table: the default
    write_choices(tmp_path / "cpu.json", "cpu", [Fp8GemmChoice(64, 32, 4, "triton", 64, 512, 8, 3),
                                                  Fp8GemmChoice(64, 32, 16, "scaled_mm"),
                                                  Fp8GemmChoice(64, 32, 32, "triton")])
    fp8_gemm_choice.load_choices.cache_clear()
    assert json.loads((tmp_path / "cpu.json").read_text())["device"] == "cpu"
    assert [choose(64, 32, m, cpu).kernel for m in (1, 4, 5, 16, 17, 32, 33)] == \
        ["triton", "triton", "scaled_mm", "scaled_mm", "triton", "triton", "scaled_mm"]
    # A bucket's tile, or the tile data's where it names none.
    assert choose(64, 32, 3, cpu).config() == SmallMConfig(64, 512, 8, 3)
    assert choose(64, 32, 20, cpu).config() is None
    assert choose(32, 64, 1, cpu).kernel == "scaled_mm"  # a shape it does not name
    # A GPU without a table takes the fallback device's; the CPU does not.
    write_choices(fp8_gemm_choice.choice_path(FALLBACK_DEVICE), FALLBACK_DEVICE, [Fp8GemmChoice(8, 8, 1, "triton")])
    fp8_gemm_choice.load_choices.cache_clear()
    assert fp8_gemm_choice.load_choices("NVIDIA H200") == {(8, 8): (Fp8GemmChoice(8, 8, 1, "triton"),)}
    (tmp_path / "cpu.json").unlink()
    assert fp8_gemm_choice.load_choices.__wrapped__("cpu") == {}
    fp8_gemm_choice.load_choices.cache_clear()
    with pytest.raises(ValueError, match="at most 32 rows"):
        Fp8GemmChoice(64, 32, 64, "triton")
    with pytest.raises(ValueError, match="a tile goes with a Triton kernel"):
        Fp8GemmChoice(64, 32, 4, "scaled_mm", 64, 512, 8, 3)
    with pytest.raises(ValueError, match="names all of"):
        Fp8GemmChoice(64, 32, 4, "triton", 64, 512)
    with pytest.raises(ValueError, match="block_m and promote_k go with an fp8_dot tile only"):
        Fp8GemmChoice(64, 32, 4, "triton", 64, 512, 8, 3, block_m=64)
    with pytest.raises(ValueError, match="block_m and promote_k go with an fp8_dot tile only"):
        Fp8GemmChoice(64, 32, 64, "fp8_dot", 64, 128, 4, 4)
    with pytest.raises(ValueError, match="block_m and promote_k go with an fp8_dot tile only"):
        Fp8GemmChoice(64, 32, 64, "fp8_dot", promote_k=128)


def test_the_table_names_fp8_dot_buckets_past_the_small_m_rows(tmp_path, monkeypatch):
    """Buckets past 32 rows: the FP8 dot kernel in its tile (or its default), cuBLAS past the largest bucket; a
    written table leaves out the fields at their defaults and reads back the same."""
    monkeypatch.setattr(fp8_gemm_choice, "CHOICE_DIR", tmp_path)
    cpu = torch.device("cpu")
    rows = [Fp8GemmChoice(64, 32, 32, "triton", 16, 512, 4, 4, split_k=2),
            Fp8GemmChoice(64, 32, 64, "fp8_dot", 64, 128, 4, 4, split_k=2, block_m=64),
            Fp8GemmChoice(64, 32, 128, "fp8_dot"),
            Fp8GemmChoice(64, 32, 256, "fp8_dot", 64, 128, 4, 4, block_m=64, promote_k=128)]
    write_choices(tmp_path / "cpu.json", "cpu", rows)
    assert '"block_m"' not in (tmp_path / "cpu.json").read_text().splitlines()[-4]
    assert '"promote_k": 128' in (tmp_path / "cpu.json").read_text().splitlines()[-3]
    fp8_gemm_choice.load_choices.cache_clear()
    try:
        assert fp8_gemm_choice.load_choices("cpu")[(64, 32)] == tuple(rows)
        assert [choose(64, 32, m, cpu).kernel for m in (32, 33, 64, 65, 128, 256, 257)] == \
            ["triton", "fp8_dot", "fp8_dot", "fp8_dot", "fp8_dot", "fp8_dot", "scaled_mm"]
        assert choose(64, 32, 200, cpu).dot_tile() == Fp8DotTile(64, 64, 128, 4, 4, promote_k=128)
        assert choose(64, 32, 40, cpu).dot_tile() == Fp8DotTile(64, 64, 128, 4, 4, split_k=2)
        assert choose(64, 32, 100, cpu).dot_tile() is None
        assert choose(64, 32, 40, cpu).config() is None
        assert choose(64, 32, 8, cpu).config() == SmallMConfig(16, 512, 4, 4, split_k=2)
    finally:
        fp8_gemm_choice.load_choices.cache_clear()


def test_the_layer_runs_the_fp8_dot_kernel_where_the_table_says(tmp_path, monkeypatch):
    """A bfloat16 layer over 40 rows, which the table gives the FP8 dot kernel, equals its reference path."""
    monkeypatch.setattr(fp8_gemm_choice, "CHOICE_DIR", tmp_path)
    fp8_gemm_choice.load_choices.cache_clear()
    write_choices(tmp_path / "cpu.json", "cpu", [Fp8GemmChoice(24, 64, 64, "fp8_dot", 16, 32, 4, 2, block_m=32)])
    import specserve.kernels.fp8_gemm as fp8_gemm_module

    calls = []
    real = fp8_gemm_module.fp8_dot
    monkeypatch.setattr(fp8_gemm_module, "fp8_dot", lambda *a, **kw: calls.append(kw["tile"]) or real(*a, **kw))
    torch.manual_seed(3)
    layer = _layer(torch.randn(24, 64), Fp8Activation.DYNAMIC)
    x = torch.randn(40, 64).to(torch.bfloat16)
    try:
        want = layer(x)
        layer.fused = True
        got = layer(x)
    finally:
        fp8_gemm_choice.load_choices.cache_clear()
    assert calls == [Fp8DotTile(32, 16, 32, 4, 2)]
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)


def test_the_layer_runs_the_tables_tile(tmp_path, monkeypatch):
    """A bfloat16 layer whose shape the table gives the Triton kernel runs it in the table's tile."""
    import specserve.kernels.fused_linear as fused_linear_module

    monkeypatch.setattr(fp8_gemm_choice, "CHOICE_DIR", tmp_path)
    fp8_gemm_choice.load_choices.cache_clear()
    write_choices(tmp_path / "cpu.json", "cpu", [Fp8GemmChoice(24, 32, 8, "triton", 16, 64, 4, 2)])
    seen = []
    monkeypatch.setattr(fused_linear_module, "fp8_linear",
                        lambda *a, config=None, **kw: seen.append(config) or torch.zeros(3, 24, dtype=torch.bfloat16))
    layer = _layer(torch.randn(24, 32), Fp8Activation.DYNAMIC)
    layer.fused = True
    layer(torch.randn(3, 32).to(torch.bfloat16))
    fp8_gemm_choice.load_choices.cache_clear()
    assert seen == [SmallMConfig(16, 64, 4, 2)]


def test_options_refuse_unsupported_values():
    from specserve.config import EngineConfig
    from specserve.spec_decode.config import SpeculativeConfig

    with pytest.raises(ConfigError, match="quantization: must be one of fp8"):
        EngineConfig(quantization="int4")
    with pytest.raises(ConfigError, match="speculative_config.quantization"):
        SpeculativeConfig(method="eagle3", num_speculative_tokens=2, model="smollm2-135m", quantization="fp4")
    with pytest.raises(ConfigError, match="no weights to quantize"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, quantization="fp8")
