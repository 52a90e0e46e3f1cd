"""The draw kernels of sampled trees (kernels/tree_draws.py) against the torch ops of TreeSampling.guesses: the q
they keep, a greedy request's top guesses, and the law of the children they draw (Gumbel-top-k: draws without
replacement from q), on the CPU under Triton's interpreter and at the default model's vocabulary on a GPU."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from distribution import P_MIN, p_value
from specserve.spec_decode.sampled_tree import NODE_PROBS_DTYPE, TreeSampling
from specserve.spec_decode.tree import DraftTree
from specserve.spec_decode.tree_verify import TreeTables

TREE = DraftTree.build([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)])


def sampling(greedy: list[bool], temperature: list[float], vocab: int, device: str, seed: int = 0) -> TreeSampling:
    """n requests in shuffled rows of a fresh node_probs, drawing from a generator seeded with `seed`."""
    n = len(greedy)
    tables = TreeTables.build(TREE, torch.device(device))
    node_probs = torch.zeros(n + 1, tables.num_prob_slots, vocab, dtype=NODE_PROBS_DTYPE, device=device)
    rows = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(device)
    return TreeSampling(torch.tensor(greedy, device=device), torch.tensor(temperature, device=device), rows,
                        node_probs, tables, torch.Generator(device).manual_seed(seed))


def q_and_greedy_tops_against_torch(vocab: int, device: str) -> None:
    """Depth 1 of TREE (three nodes a request, two of them with children, two guesses each): the kernels keep
    the q the torch ops keep (up to the last bit of its rounding) in the same slots and nowhere else, take the
    same top guesses for greedy requests, and draw distinct tokens with mass for the others; logits a grammar
    rules out (a whole block of them in one row) get no mass and are never drawn."""
    greedy, temperature = [True, False, False, True], [1.0, 0.7, 1.3, 1.0]
    n, m, k = len(greedy), len(TREE.level(1)), TREE.top_k(2)
    gen = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(n * m, vocab, generator=gen)
    logits[torch.rand(n * m, vocab, generator=gen) < 0.3] = float("-inf")
    logits[2, : vocab // 2] = float("-inf")
    logits = logits.to(device)
    want_draws, got_draws = sampling(greedy, temperature, vocab, device), sampling(greedy, temperature, vocab, device)
    want = want_draws.guesses(logits, k, TREE.level(1), use_triton=False)
    got = got_draws.guesses(logits, k, TREE.level(1), use_triton=True)
    got_q, want_q = got_draws.node_probs.float(), want_draws.node_probs.float()
    torch.testing.assert_close(got_q, want_q, rtol=2 ** -7, atol=0)
    assert (got_q == want_q)[want_q > 0].float().mean() > 0.99  # both rounded to nearest
    kept = want_draws.node_probs.float().sum(-1)
    assert kept.count_nonzero() == n * 2 and torch.equal(kept != 0, got_draws.node_probs.float().sum(-1) != 0)
    rows_greedy = torch.tensor(greedy).repeat_interleave(m).to(device)
    assert torch.equal(got[rows_greedy], want[rows_greedy])
    drawn = got[~rows_greedy]
    assert (drawn[:, 0] != drawn[:, 1]).all()
    assert torch.isfinite(logits[~rows_greedy].gather(1, drawn)).all()


def test_the_kernels_keep_q_and_take_greedy_tops_as_the_torch_ops_do():
    q_and_greedy_tops_against_torch(vocab=5000, device="cpu")  # two blocks of 4,096 tokens, the last one cut


def joint_first_two(q: torch.Tensor) -> dict[tuple[int, int], float]:
    """P(first child, second child) of draws without replacement from q, in float64."""
    q = q.double() / q.double().sum()
    support = q.nonzero().flatten().tolist()
    return {(a, b): float(q[a] * q[b] / (1 - q[a])) for a in support for b in support if a != b}


def draws_from_one_node(q: torch.Tensor, requests: int, temperature: float, device: str) -> torch.Tensor:
    """[requests, 3]: the root's children for many requests whose head gives q^(1 / temperature) there."""
    draws = sampling([False] * requests, [temperature] * requests, q.shape[0], device, seed=5)
    logits = (q.log() * temperature).expand(requests, -1).contiguous().to(device)
    return draws.guesses(logits, TREE.top_k(1), TREE.level(0), use_triton=True).cpu()


def test_the_kernels_draw_children_without_replacement_from_q():
    q = torch.tensor([0.05, 0.3, 0.15, 0.0, 0.5])
    children = draws_from_one_node(q, requests=800, temperature=0.8, device="cpu")
    assert p_value(Counter(map(tuple, children[:, :2].tolist())), joint_first_two(q)) > P_MIN
    assert (children[:, 0] != children[:, 1]).all() and (children[:, 1] != children[:, 2]).all()


def test_draws_past_the_support_repeat_the_first():
    q = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.5])
    children = draws_from_one_node(q, requests=40, temperature=1.0, device="cpu")
    assert set(children[:, 0].tolist()) == {1, 4}
    assert torch.equal(children[:, 1], 5 - children[:, 0]) and torch.equal(children[:, 2], children[:, 0])


@pytest.mark.gpu
def test_the_kernels_on_cuda_at_the_default_models_vocabulary():
    q_and_greedy_tops_against_torch(vocab=49_152, device="cuda")
    # Mass on tokens of every block (the first and last among them), none elsewhere.
    q = torch.zeros(49_152)
    q[[0, 7, 4_095, 4_096, 13_000, 20_000, 33_000, 49_151]] = torch.tensor([8, 1, 4, 2, 6, 3, 5, 0.5])
    children = draws_from_one_node(q / q.sum(), requests=200_000, temperature=1.0, device="cuda")
    want = joint_first_two(q / q.sum())
    assert p_value(Counter(map(tuple, children[:, :2].tolist())), want) > P_MIN
