"""Triton RMSNorm, plain and fused with the residual add, against float64."""
import pytest
import torch

from specserve.kernels.rmsnorm import fused_add_rms_norm, rms_norm

from .util import DEVICE, DTYPES, assert_close, poison_intact, poisoned_view

EPS = 1e-5


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


def weight_of(n: int, dtype) -> torch.Tensor:
    return (1 + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(7))).to(dtype).to(DEVICE)


def check_fused_add(num_tokens: int, n: int, dtype) -> None:
    # Both inputs are views into NaN buffers: nothing outside them may be read or written.
    x, residual = poisoned_view(num_tokens, n, dtype, seed=1), poisoned_view(num_tokens, n, dtype, seed=2)
    x_before, residual_before = x.clone(), residual.clone()
    weight = weight_of(n, dtype)
    out, returned = fused_add_rms_norm(x, residual, weight, EPS)
    assert returned is residual and out.shape == x.shape and out.dtype == dtype
    assert torch.equal(x, x_before), "x is an input only"
    total = x_before.double() + residual_before.double()
    assert_close(residual, total)
    assert_close(out, reference(total, weight))
    assert poison_intact(x) and poison_intact(residual)


def check_rms_norm(num_tokens: int, n: int, dtype) -> None:
    x = poisoned_view(num_tokens, n, dtype, seed=0)
    weight = weight_of(n, dtype)
    out = rms_norm(x, weight, EPS)
    assert out.dtype == dtype and out.is_contiguous()
    assert_close(out, reference(x, weight))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,n", [(1, 576), (7, 576), (3, 128), (2, 100)])
@pytest.mark.parametrize("check", [check_rms_norm, check_fused_add], ids=["plain", "fused_add"])
def test_rms_norm(check, num_tokens, n, dtype):
    check(num_tokens, n, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_head_norm_of_strided_heads(dtype):
    # Qwen3's q/k norm: heads of a [tokens, heads, head_dim] view of the fused qkv projection.
    num_heads, head_dim = 4, 64
    qkv = poisoned_view(5, 3 * num_heads * head_dim, dtype, seed=3)
    q = qkv[:, num_heads * head_dim : 2 * num_heads * head_dim].unflatten(1, (num_heads, head_dim))
    weight = weight_of(head_dim, dtype)
    assert_close(rms_norm(q, weight, EPS), reference(q, weight))


def test_no_tokens():
    x = torch.empty(0, 576, device=DEVICE)
    residual = torch.empty(0, 576, device=DEVICE)
    weight = weight_of(576, torch.float32)
    assert rms_norm(x, weight, EPS).shape == (0, 576)
    out, _ = fused_add_rms_norm(x, residual, weight, EPS)
    assert out.shape == (0, 576)
