"""Greedy verification in one kernel gives exactly what the general rejection sampler gives for greedy
rows (also under forced acceptance), written into the StepOutputs rows named, other rows untouched."""
from __future__ import annotations

import pytest
import torch

from specserve.spec_decode.greedy_verify import greedy_verify
from specserve.spec_decode.rejection_sampler import rejection_sample

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 11


def case(seed: int, n: int, k: int):
    g = torch.Generator().manual_seed(seed)
    num = torch.randint(1, k + 1, (n,), generator=g)
    # Each request's tokens sit at its own stretch of the step; draft j at index[i, j + 1].
    starts = torch.arange(n) * (k + 3) + 2
    j = torch.arange(k + 1)
    index = starts[:, None] + torch.minimum(j[None, :], num[:, None])
    target = torch.randint(0, VOCAB, (n, k + 1), generator=g)
    input_ids = torch.randint(0, VOCAB, (int(starts[-1]) + k + 3,), generator=g)
    # Make most drafts match the target's argmax so that acceptance runs vary.
    for i in range(n):
        for d in range(int(num[i])):
            if torch.rand(1, generator=g) < 0.7:
                input_ids[index[i, d + 1]] = target[i, d]
    uniform = torch.rand(n, k, generator=g)
    return target, input_ids, index, num, uniform


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("forced", [None, 0.6], ids=["greedy", "forced"])
@pytest.mark.parametrize("n,k", [(1, 1), (5, 3), (9, 6)])
def test_matches_the_rejection_sampler(use_triton, forced, n, k):
    target, input_ids, index, num, uniform = case(n * 10 + k, n, k)
    slots = torch.arange(k)
    drafts = torch.where(slots < num[:, None], input_ids[index[:, 1:]], -1)
    probs, noise = torch.ones(n, k + 1, VOCAB), torch.ones(n, VOCAB)  # greedy rows read neither
    want_tokens, want_accepted = rejection_sample(drafts, num, None, probs, torch.ones(n, dtype=torch.bool), target,
                                                  uniform, noise, forced)
    rows = torch.randperm(n + 3)[:n]  # scattered StepOutputs rows
    packed = torch.full((n + 3, 2 + 2 * 6), -9, dtype=torch.int64)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    packed = to(packed)
    greedy_verify(to(target), to(input_ids), to(index), to(num), to(rows), packed[:, 0], packed[:, 1:],
                  to(uniform) if forced is not None else None, forced, use_triton=use_triton)
    packed = packed.cpu()
    assert packed[rows, 0].tolist() == want_accepted.tolist()
    assert packed[rows, 1:k + 2].tolist() == want_tokens.tolist()
    others = torch.ones(n + 3, dtype=torch.bool)
    others[rows] = False
    assert (packed[others] == -9).all() and (packed[rows, k + 2:] == -9).all()


@pytest.mark.gpu
@pytest.mark.parametrize("forced", [None, 0.6], ids=["greedy", "forced"])
def test_kernel_on_the_gpu(forced):
    assert DEVICE == "cuda"
    test_matches_the_rejection_sampler(True, forced, 9, 6)
