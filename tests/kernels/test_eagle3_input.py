"""The EAGLE-3 attention input kernel (embedding gather, two RMSNorms, concat) against float64."""
import pytest
import torch

from specserve.kernels.eagle3_input import eagle3_layer_input

from .util import DEVICE, assert_close, poison_intact, poisoned_view

EPS = 1e-5
VOCAB, HIDDEN = 50, 100  # no power of two: the row mask matters


def rms_norm64(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


def check_eagle3_input(m: int, vocab: int, hidden_size: int, dtype, gather: bool = False) -> None:
    gen = torch.Generator().manual_seed(m)
    embed = poisoned_view(vocab, hidden_size, dtype, seed=1)
    # With gather, each row reads one of 3 states (a tree's drafts, their parents' states).
    hidden = poisoned_view(3 if gather else m, hidden_size, dtype, seed=2).mul_(3.0)  # another scale
    embed_norm = (1 + 0.1 * torch.randn(hidden_size, generator=gen)).to(DEVICE, dtype)
    hidden_norm = (1 + 0.1 * torch.randn(hidden_size, generator=gen)).to(DEVICE, dtype)
    ids = torch.randint(0, vocab, (m,), generator=gen)
    ids[0] = vocab - 1
    ids = ids.to(DEVICE)
    rows = torch.randint(0, 3, (m,), generator=gen).to(DEVICE) if gather else None
    hidden_before = hidden.clone()

    out, h = eagle3_layer_input(ids, embed, hidden, embed_norm, hidden_norm, EPS, hidden_rows=rows)

    read = hidden[rows] if gather else hidden
    expected = torch.cat((rms_norm64(embed[ids], embed_norm), rms_norm64(read, hidden_norm)), dim=-1)
    assert out.shape == (m, 2 * hidden_size) and out.dtype == dtype
    assert_close(out, expected)
    assert torch.equal(h, read) and (h is hidden) == (not gather)
    assert torch.equal(hidden, hidden_before) and poison_intact(hidden) and poison_intact(embed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 5, 16])
def test_matches_float64(m, dtype):
    check_eagle3_input(m, VOCAB, HIDDEN, dtype)


@pytest.mark.parametrize("m", [1, 7])
def test_rows_gathered_from_parents(m):
    check_eagle3_input(m, VOCAB, HIDDEN, torch.bfloat16, gather=True)


def test_no_rows():
    out, _ = eagle3_layer_input(torch.empty(0, dtype=torch.int64, device=DEVICE), torch.randn(4, 8, device=DEVICE),
                                torch.empty(0, 8, device=DEVICE), torch.ones(8, device=DEVICE),
                                torch.ones(8, device=DEVICE), EPS)
    assert out.shape == (0, 16)


@pytest.mark.parametrize("bad,message", [
    (dict(ids=torch.zeros(3, dtype=torch.int64)), "input_ids"),
    (dict(embed=torch.randn(4, 9)), "embed_weight"),
    (dict(embed=torch.randn(4, 8, dtype=torch.float64)), "share a dtype"),
    (dict(norm=torch.ones(7)), "norm weights"),
])
def test_bad_operands_are_named(bad, message):
    args = dict(ids=torch.zeros(2, dtype=torch.int64), embed=torch.randn(4, 8), hidden=torch.randn(2, 8),
                norm=torch.ones(8)) | bad
    with pytest.raises(ValueError, match=message):
        eagle3_layer_input(args["ids"], args["embed"], args["hidden"], args["norm"], torch.ones(8), EPS)
