"""Inputs of requests scheduled before their previous step's results were back: the Triton kernel and
the torch path against a plain-Python reference, with other tokens and rows left untouched."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specserve.spec_decode.tree import DraftTree
from specserve.worker.inflight_inputs import take_inflight_inputs
from specserve.worker.staged_inputs import StagedExtra
from staging import staged_extras

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 4


def scenario(k: int, seed: int, tree: DraftTree | None = None):
    """A batch of 6 requests, 3 of them in flight, over poisoned buffers; returns (meta, previous step's
    outputs, buffers, expected buffers). With a tree of k drafts, an in-flight request's token t sits at the
    depth of tree index t, and keeps slot start + t."""
    rng = random.Random(seed)
    prev_rows, rows, max_blocks = 7, 6, 16
    accepted = torch.tensor([rng.randint(0, k) for _ in range(prev_rows)])
    tokens = torch.tensor([[rng.randrange(100, 200) for _ in range(k + 1)] for _ in range(prev_rows)])
    drafts = torch.tensor([[rng.randrange(200, 300) for _ in range(k)] for _ in range(prev_rows)],
                          dtype=torch.int64).reshape(prev_rows, k)
    block_table = torch.tensor([[rng.randrange(0, 50) for _ in range(max_blocks)] for _ in range(rows)], dtype=torch.int32)
    counts = [rng.randint(1, 5) for _ in range(rows)]
    in_flight = sorted(rng.sample(range(rows), 3))
    meta, first = [], 0
    input_ids, positions, seq_lens = [], [], []
    for i, n in enumerate(counts):
        if i in in_flight:
            n = counts[i] = 1 + rng.randint(0, k)
            prev = rng.randrange(prev_rows)
            meta.append([i, prev, first, n, rng.randint(int(accepted[prev]), k)])
        start = rng.randint(8, 40)
        input_ids += [rng.randrange(1, 99) for _ in range(n)]
        depths = tree.depths if tree is not None and i in in_flight else range(n)
        positions += [start + depths[t] for t in range(n)]
        seq_lens.append(start + n)
        first += n
    first_positions = [positions[sum(counts[:r])] for r in range(rows)]
    slots = [int(block_table[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
             for r, n in enumerate(counts) for p in range(first_positions[r], first_positions[r] + n)]
    buffers = dict(input_ids=torch.tensor(input_ids + [-5] * 3), positions=torch.tensor(positions + [-5] * 3),
                   seq_lens=torch.tensor(seq_lens + [-5], dtype=torch.int32), slot_mapping=torch.tensor(slots + [-5] * 3))
    expected = {name: t.clone() for name, t in buffers.items()}
    for row, prev, start, n, verified in meta:
        rejected = verified - int(accepted[prev])
        expected["seq_lens"][row] -= rejected
        for t in range(n):
            expected["input_ids"][start + t] = tokens[prev, accepted[prev]] if t == 0 else drafts[prev, t - 1]
            expected["positions"][start + t] -= rejected
            pos = first_positions[row] - rejected + t
            expected["slot_mapping"][start + t] = int(block_table[row, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE
    # The previous step's outputs as the runner keeps them: columns of one packed buffer.
    packed = torch.cat([accepted[:, None], tokens, drafts], dim=1)
    outputs = (packed[:, 0], packed[:, 1:k + 2], packed[:, k + 2:])
    to = lambda t: t.to(DEVICE)  # noqa: E731
    staged = staged_extras({StagedExtra.INFLIGHT: np.array(meta, dtype=np.int64)}, device=DEVICE)
    return staged, tuple(map(to, outputs)), {n: to(t) for n, t in buffers.items()}, expected, to(block_table)


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("seed", range(3))
def test_inflight_inputs_match_the_reference(use_triton, k, seed):
    staged, (accepted, tokens, drafts), buf, expected, block_table = scenario(k, seed)
    # A bound past the 3 in-flight rows, as a graph recorded for a larger batch launches: the header's count
    # is what the kernel follows.
    take_inflight_inputs(staged, accepted, tokens, drafts, buf["input_ids"], buf["positions"], buf["seq_lens"],
                         buf["slot_mapping"], block_table, BLOCK_SIZE, max_rows=3 + seed, use_triton=use_triton)
    for name, want in expected.items():
        assert torch.equal(buf[name].cpu(), want), name


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("seed", range(3))
def test_inflight_tree_tokens_keep_their_depths_and_slots(use_triton, seed):
    tree = DraftTree.build([(0,), (1,), (0, 0)])
    staged, (accepted, tokens, drafts), buf, expected, block_table = scenario(3, seed, tree)
    take_inflight_inputs(staged, accepted, tokens, drafts, buf["input_ids"], buf["positions"], buf["seq_lens"],
                         buf["slot_mapping"], block_table, BLOCK_SIZE, max_rows=3, use_triton=use_triton)
    for name, want in expected.items():
        assert torch.equal(buf[name].cpu(), want), name


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_no_inflight_request_changes_nothing(use_triton):
    _, (accepted, tokens, drafts), buf, _, block_table = scenario(2, 0)
    before = {n: t.clone() for n, t in buf.items()}
    take_inflight_inputs(staged_extras({}, device=DEVICE), accepted, tokens, drafts, buf["input_ids"],
                         buf["positions"], buf["seq_lens"], buf["slot_mapping"], block_table, BLOCK_SIZE, max_rows=4,
                         use_triton=use_triton)
    assert all(torch.equal(before[n], buf[n]) for n in buf)
