"""Per-token FP8 quantization folded into the RMSNorm and SiLU-and-mul kernels: bit for bit the norm or activation
kernel followed by the row-quantization kernel (a compiled norm of float32 rows: within its last bits), and an
FP8 model whose folding is on gives what it gives with the folding off (docs/design.md, 'FP8 weights')."""
import pytest
import torch

from specserve.attention.backend import get_attention_backend
from specserve.kernels import activation, fp8_rows, fused_linear, rmsnorm
from specserve.kernels.activation import silu_and_mul, silu_and_mul_fp8_rows
from specserve.kernels.fp8_rows import quantize_rows
from specserve.kernels.rmsnorm import fused_add_rms_norm, rms_norm, rms_norm_fp8_rows
from specserve.models import layers
from specserve.models.layers import set_fused_kernels
from specserve.models.llama import LlamaForCausalLM
from specserve.quantization.fp8 import MIN_SCALE
from specserve.quantization.fp8_linear import Fp8Activation, Fp8Linear
from specserve.quantization.fp8_model import quantize_projections

from .test_fused_model import STEPS, count_calls, randomize, run_target, tiny_arch
from .util import DEVICE, DTYPES, poison_intact, poisoned_view

EPS = 1e-5
# Rows of very different ranges and an all-zero one (the least scale).
ROW_RANGES = [1e-3, 1.0, 40.0, 0.0, 3.0]


def _rows(cols: int, dtype, seed: int) -> torch.Tensor:
    x = poisoned_view(len(ROW_RANGES), cols, dtype, seed)
    x.mul_(torch.tensor(ROW_RANGES, device=DEVICE, dtype=dtype)[:, None])
    return x


def assert_same_rows(rows, want_q: torch.Tensor, want_scale: torch.Tensor, dtype, exact: bool = True) -> None:
    """exact=False: each scale within two float32 ulps of the reference's, and any e4m3 value that differs (at
    most one in a thousand) only the next e4m3 value of the same sign."""
    assert rows.dtype == dtype and rows.q.shape == want_q.shape and rows.scale.shape == want_scale.shape
    if exact:
        assert torch.equal(rows.scale, want_scale)
        assert torch.equal(rows.q.view(torch.uint8), want_q.view(torch.uint8))
        return
    torch.testing.assert_close(rows.scale, want_scale, rtol=2 ** -22, atol=0)
    codes, want_codes = rows.q.view(torch.uint8).int(), want_q.view(torch.uint8).int()
    differ = codes != want_codes
    assert differ.float().mean().item() <= 1e-3
    assert ((codes - want_codes).abs()[differ] == 1).all(), "a differing value must be the next e4m3 value"


def check_norm_fp8_rows(n: int, dtype, add: bool) -> None:
    x = _rows(n, dtype, seed=1)
    residual = poisoned_view(x.shape[0], n, dtype, seed=2) if add else None
    weight = (1 + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(7))).to(dtype).to(DEVICE)
    x_before = x.clone()
    if add:
        residual_want = residual.clone()
        normed, _ = fused_add_rms_norm(x, residual_want, weight, EPS)
    else:
        normed = rms_norm(x, weight, EPS)
    want_q, want_scale = quantize_rows(normed)
    rows = rms_norm_fp8_rows(x, residual, weight, EPS)
    # Compiled, each variant of the norm kernel sums the squares in the order of the layout Triton gives it: an
    # rstd a last bit apart, which a float32 row (unlike a narrower one) keeps up to its scale.
    assert_same_rows(rows, want_q, want_scale, dtype, exact=dtype != torch.float32 or DEVICE == "cpu")
    assert torch.equal(x, x_before), "x is an input only"
    if add:
        assert torch.equal(residual, residual_want), "the residual stream is written as fused_add_rms_norm writes it"
        assert poison_intact(residual)
    else:
        assert rows.scale[ROW_RANGES.index(0.0)].item() == pytest.approx(MIN_SCALE, rel=1e-7)
    assert poison_intact(x)


def check_silu_and_mul_fp8_rows(inter: int, dtype) -> None:
    gate_up = _rows(2 * inter, dtype, seed=3)
    before = gate_up.clone()
    want_q, want_scale = quantize_rows(silu_and_mul(gate_up))
    rows = silu_and_mul_fp8_rows(gate_up)
    assert_same_rows(rows, want_q, want_scale, dtype)
    assert torch.equal(gate_up, before) and poison_intact(gate_up)
    assert rows.scale[ROW_RANGES.index(0.0)].item() == pytest.approx(MIN_SCALE, rel=1e-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("add", [False, True], ids=["norm", "add_and_norm"])
@pytest.mark.parametrize("n", [100, 64])
def test_norm_fp8_rows_equal_norm_then_quantize_rows(n, add, dtype):
    check_norm_fp8_rows(n, dtype, add)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [150, 64, 5])
def test_silu_and_mul_fp8_rows_equal_silu_and_mul_then_quantize_rows(inter, dtype):
    check_silu_and_mul_fp8_rows(inter, dtype)


def test_no_tokens_and_bad_shapes():
    assert silu_and_mul_fp8_rows(torch.empty(0, 64, device=DEVICE)).q.shape == (0, 32)
    assert rms_norm_fp8_rows(torch.empty(0, 64, device=DEVICE), None, torch.ones(64, device=DEVICE), EPS).q.shape \
        == (0, 64)
    with pytest.raises(ValueError, match=r"gate_up must be \[tokens, 2 \* inter\]"):
        silu_and_mul_fp8_rows(torch.randn(2, 3, 64, device=DEVICE))
    with pytest.raises(ValueError, match=r"x must be \[tokens, n\]"):
        rms_norm_fp8_rows(torch.randn(2, 64, device=DEVICE), torch.randn(3, 64, device=DEVICE),
                          torch.ones(64, device=DEVICE), EPS)


def test_only_a_dynamic_input_layer_takes_rows():
    layer = Fp8Linear.quantize(torch.nn.Linear(64, 8).to(DEVICE))
    rows = rms_norm_fp8_rows(torch.randn(2, 64, device=DEVICE), None, torch.ones(64, device=DEVICE), EPS)
    layer.activation = Fp8Activation.NONE
    with pytest.raises(ValueError, match="dynamic input scales only"):
        layer.forward_rows(rows)


def _fp8_model(dtype) -> tuple[LlamaForCausalLM, object]:
    """A tiny random Llama of two layers, its projections quantized (W8A8 dynamic), on the fused path."""
    arch = tiny_arch(num_layers=2)
    model = LlamaForCausalLM(arch, get_attention_backend("triton"))
    randomize(model)
    model = model.to(device=DEVICE, dtype=dtype)
    quantize_projections(model)
    set_fused_kernels(model, True)
    return model, arch


def _run(model, arch, dtype) -> list[torch.Tensor]:
    """The logits of each step of STEPS (a prefill, then a decode beside a verification, padded)."""
    with torch.no_grad():
        return [model.compute_logits(hidden) for hidden, _ in run_target(model, arch, dtype)[0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_model_is_the_same_with_the_quantization_folded(monkeypatch, dtype):
    """A W8A8 (dynamic) model on the fused path: its norms and SiLU-and-mul write the FP8 rows of qkv, gate/up
    and down_proj (o_proj alone quantizes its input), SiLU-and-mul in the small-M gate/up projection's epilogue
    where that kernel runs it (float32 here; bfloat16 runs torch._scaled_mm), and its logits, so its greedy
    tokens, are bit for bit those of the path that quantizes in launches of their own."""
    model, arch = _fp8_model(dtype)
    calls = count_calls(monkeypatch, {"norm": (rmsnorm, "rms_norm_fp8_rows"),
                                      "silu": (activation, "silu_and_mul_fp8_rows"),
                                      "silu_epilogue": (fused_linear, "fp8_linear_silu_mul"),
                                      "rows": (fp8_rows, "quantize_rows")})
    folded = _run(model, arch, dtype)
    mlps = arch.num_layers * len(STEPS)
    in_epilogue = dtype == torch.float32
    assert calls == {"norm": 2 * mlps, "silu": 0 if in_epilogue else mlps, "silu_epilogue": mlps if in_epilogue else 0,
                     "rows": mlps}
    monkeypatch.setattr(layers, "takes_fp8_rows", lambda linear: False)
    unfolded = _run(model, arch, dtype)
    assert calls["rows"] == 5 * arch.num_layers * len(STEPS)
    for got, want in zip(folded, unfolded):
        assert torch.equal(got, want)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
