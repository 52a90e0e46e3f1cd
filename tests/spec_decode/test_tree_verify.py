"""The tree walk, its emitted tokens and its cache moves against plain-Python references."""
from __future__ import annotations

import random

import pytest
import torch

from specserve.spec_decode.tree import DraftTree
from specserve.spec_decode.tree_verify import TreeTables, move_kv, tree_outcome

TREE = DraftTree.build([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)])


def reference_walk(target: list[int], nodes: list[int], num_drafts: int) -> list[int]:
    """Tree indices of the root and the accepted drafts: from the root, the first child whose token is the
    target's token there."""
    path = [0]
    while True:
        kids = [i for i in range(1, num_drafts + 1) if TREE.parents[i] == path[-1] and nodes[i] == target[path[-1]]]
        if not kids:
            return path
        path.append(kids[0])


@pytest.mark.parametrize("seed", range(4))
def test_walk_tokens_and_moves_match_the_reference(seed):
    rng = random.Random(seed)
    n, width = 6, TREE.num_nodes + 1
    # Few distinct tokens, so that walks go deep and siblings share tokens.
    target = [[rng.randrange(3) for _ in range(width)] for _ in range(n)]
    nodes = [[rng.randrange(3) for _ in range(width)] for _ in range(n)]
    num = [rng.choice([TREE.num_nodes, rng.randrange(TREE.num_nodes + 1)]) for _ in range(n)]
    index = torch.arange(n * width).view(n, width)
    slot_mapping = torch.randperm(n * width) + 100
    tables = TreeTables.build(TREE, torch.device("cpu"))
    accepted, tokens, path_tokens, (source, dest) = tree_outcome(
        torch.tensor(target), torch.tensor(nodes), torch.tensor(num), index, tables, slot_mapping, spare_slot=7)
    cache = torch.randn(3, 2, 200, 1, 2, 4)  # [layers, k/v, slots (blocks of 1), kv heads, head dim]
    moved = cache.clone()
    move_kv(moved, source, dest)
    for i in range(n):
        path = reference_walk(target[i], nodes[i], num[i])
        a = len(path) - 1
        assert accepted[i] == a
        assert tokens[i].tolist() == [target[i][p] for p in path] + [-1] * (TREE.depth - a)
        assert path_tokens[i, :a + 1].tolist() == [i * width + p for p in path]
        for d, p in enumerate(path):
            # Depth d's slot now holds what the accepted node's tree slot held.
            assert torch.equal(moved[:, :, int(slot_mapping[i * width + d])], cache[:, :, int(slot_mapping[i * width + p])])


def test_tree_config_errors_say_what_to_fix():
    from specserve.errors import ConfigError
    from specserve.spec_decode.config import SpeculativeConfig

    with pytest.raises(ConfigError, match="no parent"):
        DraftTree.build("[(0,), (0, 0, 0)]")
    with pytest.raises(ConfigError, match="at most 31"):
        DraftTree.build([(i,) for i in range(32)])
    with pytest.raises(ConfigError, match="tree's depth"):
        SpeculativeConfig.parse({"method": "eagle3", "model": "smollm2-135m-eagle3", "num_speculative_tokens": 3,
                                 "speculative_token_tree": "[(0,), (0, 0)]"})
    with pytest.raises(ConfigError, match="EAGLE head"):
        SpeculativeConfig.parse({"method": "ngram", "speculative_token_tree": "[(0,)]"})
    cfg = SpeculativeConfig.parse({"method": "eagle3", "model": "smollm2-135m-eagle3",
                                   "speculative_token_tree": "[(1,), (0,), (0, 0)]"})
    assert cfg.num_speculative_tokens == 2 and cfg.num_draft_tokens == 3 and cfg.tree.paths == ((0,), (1,), (0, 0))


def test_sampled_trees_emit_the_targets_distribution():
    """Invariant 2 for trees, on a vocabulary of 4: with the target's token at each node sampled from its own
    distribution (as the runner samples them), the first two tokens a step emits are distributed as the target
    alone would produce them, whether or not the first lands on a draft (chi-square over all 16 pairs)."""
    from scipy.stats import chisquare

    from specserve.sample.sampler import sample_from_probs

    tree = DraftTree.build([(0,), (1,), (0, 0)])
    tables = TreeTables.build(tree, torch.device("cpu"))
    nodes = torch.tensor([[0, 2, 1, 3]])  # drafts: 2 and 1 after the root, 3 after 2
    root = torch.tensor([0.1, 0.2, 0.3, 0.4])
    after = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25],
                          [0.05, 0.05, 0.1, 0.8]])  # the target's next distribution after each token
    n = 40_000
    gen = torch.Generator().manual_seed(0)
    # The target's distribution at each tree index: the root's, then after each draft's token.
    probs = torch.stack([root] + [after[t] for t in nodes[0, 1:].tolist()])
    target = sample_from_probs(probs.repeat(n, 1), [None] * (4 * n), gen).view(n, 4)
    index = torch.arange(4 * n).view(n, 4)
    accepted, tokens, _, _ = tree_outcome(target, nodes.expand(n, 4), torch.full((n,), 3), index, tables,
                                          torch.arange(4 * n), spare_slot=0)
    first = tokens[:, 0]
    # A step that accepts no draft emits one token; the second comes from the next step, sampled from the target.
    second = torch.where(accepted >= 1, tokens[:, 1],
                         sample_from_probs(after[first], [None] * n, gen))
    counts = torch.bincount(first * 4 + second, minlength=16).double()
    joint = (root[:, None] * after).flatten().double()
    expected = joint / joint.sum() * counts.sum()
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3
    assert 0 < accepted.float().mean() < 2  # both kinds of step occur
