"""The token bitmask kernel (and its torch path) against xgrammar's own apply_token_bitmask_inplace: every
refused token's logit is -inf, every allowed one untouched, for each dtype, a vocabulary that is not a multiple
of 32, a bitmask with more rows than the logits, and the device switch off (nothing changes) and on."""
import pytest
import torch
import xgrammar as xgr

from specserve.sample.token_bitmask import apply_token_bitmask

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31, (rows, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1  # a row that allows everything
    bitmask[1] = 0  # one that refuses everything
    bitmask[2, :] = 0
    bit = (vocab - 1) % 32
    bitmask[2, -1] = -2**31 if bit == 31 else 1 << bit  # only the last token
    return bitmask


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vocab", [37, 4096, 9001])
def test_matches_xgrammar(use_triton, dtype, vocab):
    rows = 5
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    bitmask = random_bitmask(rows + 3, vocab, vocab)  # rows past the logits' are never read
    want = logits.float().clone()
    xgr.apply_token_bitmask_inplace(want, bitmask[:rows].clone())
    got = logits.to(DEVICE)
    apply_token_bitmask(got, bitmask.to(DEVICE), use_triton=use_triton)
    assert torch.equal(got.cpu().float(), want)
    assert torch.isinf(want[1]).all() and torch.isfinite(want[0]).all() and torch.isfinite(want[2, -1])


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
def test_the_switch_leaves_logits_alone_when_off(use_triton):
    vocab = 1000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    bitmask = random_bitmask(4, vocab, 1).to(DEVICE)
    switch = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    got = logits.clone()
    apply_token_bitmask(got, bitmask, switch, use_triton=use_triton)
    assert torch.equal(got, logits)
    switch.fill_(1)
    apply_token_bitmask(got, bitmask, switch, use_triton=use_triton)
    want = logits.cpu().clone()
    xgr.apply_token_bitmask_inplace(want, bitmask.cpu())
    assert torch.equal(got.cpu(), want)


def test_a_bitmask_too_narrow_is_refused():
    with pytest.raises(ValueError, match="does not cover"):
        apply_token_bitmask(torch.zeros(2, 65), torch.zeros(2, 2, dtype=torch.int32))
