"""Triton SiLU-and-mul against float64."""
import pytest
import torch

from specserve.kernels.activation import silu_and_mul

from .util import DEVICE, DTYPES, assert_close, poison_intact, poisoned_view


def check_silu_and_mul(num_tokens: int, inter: int, dtype) -> None:
    gate_up = poisoned_view(num_tokens, 2 * inter, dtype, seed=0)
    gate_up.mul_(3)  # reach into silu's tails
    out = silu_and_mul(gate_up)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert_close(out, torch.nn.functional.silu(gate) * up)
    assert poison_intact(gate_up)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,inter", [(1, 1536), (5, 1536), (3, 100), (2, 2500)])
def test_silu_and_mul(num_tokens, inter, dtype):
    check_silu_and_mul(num_tokens, inter, dtype)


def test_leading_dims_and_no_tokens():
    gate_up = torch.randn(2, 3, 64, device=DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up)
    assert silu_and_mul(torch.empty(0, 64, device=DEVICE)).shape == (0, 32)
