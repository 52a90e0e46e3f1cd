"""The tree walk, its emitted tokens and its cache moves against plain-Python references."""
from __future__ import annotations

import random

import pytest
import torch

from specserve.spec_decode.tree import DraftTree
from specserve.spec_decode.tree_verify import TreeTables, move_kv, retrace_tree, verify_tree

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


def run_verify(target, nodes, num, index, tables, slot_mapping, spare_slot, use_triton, rows=None):
    """verify_tree with node tokens nodes[i, j] at token index index[i, j]; (outcome, accepted and tokens as
    written to the output rows)."""
    n = target.shape[0]
    input_ids = torch.full((int(index.max()) + 1,), -5, dtype=torch.int64)
    input_ids[index.flatten()] = nodes.flatten()
    rows = torch.arange(n) if rows is None else rows
    accepted_out = torch.full((n + 2,), -9, dtype=torch.int64)
    tokens_out = torch.full((n + 2, tables.tree.depth + 2), -9, dtype=torch.int64)
    outcome = verify_tree(target, input_ids, index, num, tables, slot_mapping, spare_slot, rows, accepted_out,
                          tokens_out, use_triton=use_triton)
    return outcome, accepted_out[rows], tokens_out[rows, :tables.tree.depth + 1]


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("seed", range(4))
def test_walk_tokens_and_moves_match_the_reference(seed, use_triton):
    rng = random.Random(seed)
    n, width = 6, TREE.num_nodes + 1
    # Few distinct tokens, so that walks go deep and siblings share tokens.
    target = [[rng.randrange(3) for _ in range(width)] for _ in range(n)]
    nodes = [[rng.randrange(3) for _ in range(width)] for _ in range(n)]
    num = [rng.choice([TREE.num_nodes, rng.randrange(TREE.num_nodes + 1)]) for _ in range(n)]
    index = torch.arange(n * width).view(n, width)
    slot_mapping = torch.randperm(n * width) + 100
    slot_mapping[index[-1]] = -1  # the last row is a graph's padding: its moves go to the spare slot
    tables = TreeTables.build(TREE, torch.device("cpu"))
    rows = torch.randperm(n + 2)[:n]
    outcome, accepted_out, tokens_out = run_verify(torch.tensor(target), torch.tensor(nodes), torch.tensor(num),
                                                   index, tables, slot_mapping, 7, use_triton, rows)
    accepted, tokens, path_tokens, (source, dest) = (outcome.accepted, outcome.tokens, outcome.path_tokens,
                                                     outcome.moves)
    assert torch.equal(accepted_out, accepted) and torch.equal(tokens_out, tokens)
    cache = torch.randn(3, 2, 200, 1, 2, 4)  # [layers, k/v, slots (blocks of 1), kv heads, head dim]
    moved = cache.clone()
    move_kv(moved, source, dest)
    for i in range(n):
        path = reference_walk(target[i], nodes[i], num[i])
        a = len(path) - 1
        assert accepted[i] == a
        assert tokens[i].tolist() == [target[i][p] for p in path] + [-1] * (TREE.depth - a)
        assert path_tokens[i].tolist() == [i * width + p for p in path] + [i * width] * (TREE.depth - a)
        if i == n - 1:
            assert set(source[i * TREE.depth:].tolist()) == {7} == set(dest[i * TREE.depth:].tolist())
            continue
        for d, p in enumerate(path):
            # Depth d's slot now holds what the accepted node's tree slot held.
            assert torch.equal(moved[:, :, int(slot_mapping[i * width + d])], cache[:, :, int(slot_mapping[i * width + p])])


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("seed", range(4))
def test_the_walk_retraced_from_its_emitted_tokens_is_the_walk(seed, use_triton):
    """What a rank > 0 of a sharded drafter knows of rank 0's verification (the outputs it wrote) yields the same
    accepted counts, paths and moves: random trees whose siblings share tokens, some cut short, a padded row."""
    rng = random.Random(100 + seed)
    n, width = 6, rng.choice([TREE.num_nodes + 1, 5])
    target = torch.tensor([[rng.randrange(3) for _ in range(width)] for _ in range(n)])
    nodes = torch.tensor([[rng.randrange(3) for _ in range(width)] for _ in range(n)])
    num = torch.tensor([rng.choice([width - 1, rng.randrange(width)]) for _ in range(n)])
    index = torch.arange(n * width).view(n, width)
    slot_mapping = torch.randperm(n * width) + 100
    slot_mapping[index[-1]] = -1
    tables = TreeTables.build(TREE, torch.device("cpu"))
    rows = torch.randperm(n + 2)[:n]
    want, accepted_out, tokens_out = run_verify(target, nodes, num, index, tables, slot_mapping, 7, use_triton, rows)
    input_ids = torch.full((n * width,), -5, dtype=torch.int64)
    input_ids[index.flatten()] = nodes.flatten()
    # Another rank's outputs: the emitted tokens alone (the accepted counts are not read).
    accepted_again = torch.full((n + 2,), -9, dtype=torch.int64)
    tokens_again = torch.full((n + 2, TREE.depth + 2), -9, dtype=torch.int64)
    tokens_again[rows, :TREE.depth + 1] = tokens_out
    got = retrace_tree(input_ids, index, num, tables, slot_mapping, 7, rows, accepted_again, tokens_again,
                       use_triton=use_triton)
    for field in ("accepted", "tokens", "path_tokens"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert all(torch.equal(g, w) for g, w in zip(got.moves, want.moves))
    assert torch.equal(accepted_again[rows], accepted_out) and torch.equal(tokens_again[rows, :TREE.depth + 1],
                                                                            tokens_out)
    assert want.accepted.max() >= 1  # some walk accepts drafts


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_a_tree_cut_short_reads_only_its_columns(use_triton):
    """A request verifying the first 3 drafts stages 4 columns; the walk reads none past them."""
    tables = TreeTables.build(TREE, torch.device("cpu"))
    target = torch.tensor([[5, 6, 7, 8], [5, 9, 9, 9]])
    nodes = torch.tensor([[0, 5, 4, 3], [0, 5, 4, 3]])  # drafts 5, 4, 3 after the root
    index = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    outcome, accepted, tokens = run_verify(target, nodes, torch.tensor([3, 3]), index, tables,
                                           torch.arange(30) + 100, 0, use_triton)
    # Request 0: the root's 5 is draft 1, whose token 6 has no child among the first 3 drafts.
    assert accepted.tolist() == [1, 1]
    assert tokens[:, :3].tolist() == [[5, 6, -1], [5, 9, -1]]
    assert outcome.path_tokens[:, :2].tolist() == [[10, 11], [20, 21]]


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_follow_tree_paths_points_the_drafter_at_the_accepted_path(use_triton):
    from specserve.spec_decode.draft_inputs import follow_tree_paths

    path_tokens = torch.tensor([[0, 2, 5, 0], [10, 10, 10, 10]])
    accepted = torch.tensor([2, 0])
    tokens = torch.tensor([[41, 42, 43, -1], [51, -1, -1, -1]])
    next_ids = torch.full((16,), -1)
    last, base = torch.full((4,), -1), torch.full((4,), -1)
    positions = torch.arange(16) + 100
    follow_tree_paths(path_tokens, accepted, tokens, torch.tensor([3, 1]), positions, next_ids, last, base,
                      use_triton=use_triton)
    assert next_ids[[0, 2, 5, 10]].tolist() == [41, 42, 43, 51]
    assert (next_ids[[1, 3, 4, 6, 7, 8, 9, 11]] == -1).all()
    assert last.tolist() == [-1, 10, -1, 5] and base.tolist() == [-1, 110, -1, 105]


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


@pytest.mark.parametrize("padded", [False, True], ids=["all real", "graph padding"])
def test_the_pass_metadata_kernel_builds_what_the_torch_ops_build(padded):
    """Each depth's attention inputs for the head's pass over its drafts: positions, slots, lengths, tree bits."""
    from specserve.spec_decode.tree_drafting import tree_pass_metadata

    tables = TreeTables.build(TREE, torch.device("cpu"))
    n, block_size = 3, 4
    base_positions = torch.tensor([5, 45, 13, 99])
    block_table = torch.randperm(48).to(torch.int32).view(4, 12)
    num_reqs = torch.tensor([2]) if padded else None
    for d in range(1, TREE.depth):
        want, want_in = tree_pass_metadata(tables, d, n, base_positions, block_table, block_size, 40, num_reqs,
                                           use_triton=False)
        got, got_in = tree_pass_metadata(tables, d, n, base_positions, block_table, block_size, 40, num_reqs,
                                         use_triton=True)
        assert torch.equal(got_in.positions, want_in.positions)
        assert torch.equal(got_in.parent_rows, want_in.parent_rows)
        # Each draft reads the row its parent had in the pass before: the same request's, the parent's place.
        parents = TREE.level(d - 1) if d > 1 else range(0, 1)
        for row, parent_row in enumerate(want_in.parent_rows.tolist()):
            node = TREE.level(d)[row % len(TREE.level(d))]
            assert parent_row == row // len(TREE.level(d)) * len(parents) + parents.index(TREE.parents[node])
        want_pos = want_in.positions
        for field in ("query_start_loc", "seq_lens", "slot_mapping", "tree_bits"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
        assert (got.num_tokens, got.max_query_len, got.tree_offset) == (want.num_tokens, want.max_query_len,
                                                                        want.tree_offset)
        assert got.slot_mapping.dtype == torch.int64 and got.seq_lens.dtype == torch.int32
        # Request 1 sits past max_position and its tree past the table's 48 keys: both clamp.
        assert want_pos.max() == 39
        if d == 1:  # indices 1..3 at 46, 47, 48: the last two share the table's last slot
            assert want.slot_mapping[3 + 1] == want.slot_mapping[3 + 2] != want.slot_mapping[3]
