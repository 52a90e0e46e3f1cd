"""One staged copy per step: the scatter kernel (Triton interpreter) and the torch path write every
persistent input buffer as a plain-Python reference says, padding included, over poisoned buffers."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specserve.attention.metadata import PAD_SLOT_ID
from specserve.worker.host_block_table import HostBlockTable
from specserve.worker.input_buffers import InputBuffers
from specserve.worker.staged_inputs import StagedExtra, pack_step_inputs, scatter_staged_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_TOKENS, MAX_REQS, MAX_BLOCKS, BLOCK_SIZE = 80, 9, 70, 4


def reference(input_ids, positions, qlens, seq_lens, block_rows):
    """The buffers as the step should leave them, in plain Python."""
    t, r = len(input_ids), len(qlens)
    ends = np.cumsum(qlens).tolist()
    slots = []
    for i, n in enumerate(qlens):
        for p in positions[ends[i] - n:ends[i]]:
            slots.append(block_rows[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
    table = [[row[c] if c < len(row) else 0 for c in range(MAX_BLOCKS)] for row in block_rows]
    return dict(
        input_ids=list(input_ids) + [0] * (MAX_TOKENS - t),
        positions=list(positions) + [0] * (MAX_TOKENS - t),
        slot_mapping=slots + [PAD_SLOT_ID] * (MAX_TOKENS - t),
        seq_lens=list(seq_lens) + [0] * (MAX_REQS - r),
        query_start_loc=[0] + ends + [t] * (MAX_REQS - r),
        block_table=table,
    )


def random_step(rng: random.Random, num_reqs: int):
    qlens = [rng.randint(1, 9) for _ in range(num_reqs)]
    starts = [rng.randint(0, 150) for _ in range(num_reqs)]
    positions = [p for s, n in zip(starts, qlens) for p in range(s, s + n)]
    seq_lens = [s + n for s, n in zip(starts, qlens)]
    # Rows as long as each request needs, some longer than the 64 columns a Triton program copies at once.
    block_rows = [[rng.randrange(1, 500) for _ in range((s + n - 1) // BLOCK_SIZE + 1 + rng.randint(0, 2))]
                  for s, n in zip(starts, qlens)]
    input_ids = [rng.randrange(0, 1000) for _ in positions]
    return input_ids, positions, qlens, seq_lens, block_rows


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("num_reqs", [1, 4, MAX_REQS])
def test_scatter_writes_every_buffer_with_padding(use_triton, num_reqs):
    rng = random.Random(num_reqs)
    for _ in range(2):  # the second step over the first one's leftovers: nothing stale survives
        input_ids, positions, qlens, seq_lens, block_rows = random_step(rng, num_reqs)
        width = max(map(len, block_rows))
        table = np.array([row + [0] * (width - len(row)) for row in block_rows], dtype=np.int64)
        slots = np.array([table[i, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                          for i, n in enumerate(qlens) for p in positions[sum(qlens[:i]):sum(qlens[:i]) + n]])
        extra = np.arange(7, dtype=np.int64).reshape(7)
        host = np.full(2000, -3, dtype=np.int64)
        layout = pack_step_inputs(host, np.array(input_ids), np.array(positions), slots, np.array(seq_lens),
                                  np.cumsum(qlens), table, {StagedExtra.SAMPLE_ROWS: extra})
        staged = torch.from_numpy(host).to(DEVICE)
        bufs = dict(input_ids=torch.full((MAX_TOKENS,), -7, dtype=torch.int64),
                    positions=torch.full((MAX_TOKENS,), -7, dtype=torch.int64),
                    slot_mapping=torch.full((MAX_TOKENS,), -7, dtype=torch.int64),
                    seq_lens=torch.full((MAX_REQS,), -7, dtype=torch.int32),
                    query_start_loc=torch.full((MAX_REQS + 1,), -7, dtype=torch.int32),
                    block_table=torch.full((MAX_REQS, MAX_BLOCKS), -7, dtype=torch.int32))
        bufs = {k: v.to(DEVICE) for k, v in bufs.items()}
        scatter_staged_inputs(staged, **bufs, use_triton=use_triton)
        want = reference(input_ids, positions, qlens, seq_lens, block_rows)
        for name, expected in want.items():
            got = bufs[name].cpu()
            if name == "block_table":
                got = got[:num_reqs]
                assert (bufs[name][num_reqs:].cpu() == -7).all(), "rows past the batch are not the step's to write"
            assert got.tolist() == expected, name
        offset, _, _ = layout.extras[StagedExtra.SAMPLE_ROWS]
        assert staged[offset:offset + 7].cpu().tolist() == extra.tolist()


def test_input_buffers_stage_extras_and_refuse_overflow():
    bufs = InputBuffers(4, 16, 5, torch.device(DEVICE), extra_capacity=8)
    meta = bufs.prepare(np.array([5, 6, 7]), np.array([3]), np.array([3]), np.array([[2]]), BLOCK_SIZE,
                        {StagedExtra.VERIFY_INDEX: np.array([[1, 2], [3, 4]])})
    bufs.spread()
    assert meta.num_tokens == 3 and bufs.slot_mapping[:3].tolist() == [8, 9, 10]
    assert bufs.staged_extra(StagedExtra.VERIFY_INDEX).tolist() == [[1, 2], [3, 4]]
    with pytest.raises(RuntimeError, match="max_num_batched_tokens"):
        bufs.prepare(np.array([5]), np.array([1]), np.array([1]), np.array([[2]]), BLOCK_SIZE,
                     {StagedExtra.SAMPLE_INDEX: np.zeros(100, dtype=np.int64)})


def test_prepare_places_each_query_after_its_cached_tokens():
    # Request 0 computes its last 3 tokens of 2 blocks' worth, request 1 one token after 4 cached ones.
    bufs = InputBuffers(4, 16, 5, torch.device(DEVICE))
    table = np.array([[6, 3], [9, 0]])
    qlens, seq_lens = np.array([3, 1]), np.array([BLOCK_SIZE + 2, 5])
    bufs.prepare(np.array([11, 12, 13, 14]), qlens, seq_lens, table, BLOCK_SIZE)
    bufs.spread()
    positions = [p for q, n in zip(qlens, seq_lens) for p in range(n - q, n)]
    owner = [r for r, q in enumerate(qlens) for _ in range(q)]
    assert bufs.positions[:4].tolist() == positions
    assert bufs.slot_mapping[:4].tolist() == [table[r, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                                              for r, p in zip(owner, positions)]


def test_host_block_table_appends_clears_and_gathers():
    t = HostBlockTable(3, 6)
    t.sync(0, [4, 5])
    t.sync(2, [7])
    t.sync(0, [4, 5, 8])  # a block added since the last step
    assert t.gather([2, 0]).tolist() == [[7, 0, 0], [4, 5, 8]]
    t.clear(0)
    t.sync(0, [1])  # the row's next request
    assert t.gather([0, 2]).tolist() == [[1], [7]]


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
def test_a_reset_stages_an_empty_step_that_spreads_into_empty_buffers(use_triton):
    """What a whole-step graph's capture spreads: after reset(), the staged header describes no tokens and no
    requests, so spreading it (from a poisoned staged array) leaves every buffer as reset() does."""
    bufs = InputBuffers(4, 16, 5, torch.device(DEVICE))
    bufs.prepare(np.array([11, 12, 13]), np.array([3]), np.array([7]), np.array([[6, 3]]), BLOCK_SIZE)
    bufs.staged[8:].fill_(987654)
    bufs.reset()
    want = {name: getattr(bufs, name).clone() for name in ("input_ids", "positions", "slot_mapping", "seq_lens",
                                                           "query_start_loc")}
    scatter_staged_inputs(bufs.staged, bufs.input_ids, bufs.positions, bufs.slot_mapping, bufs.seq_lens,
                          bufs.query_start_loc, bufs.block_table, use_triton=use_triton)
    assert all(torch.equal(getattr(bufs, name), value) for name, value in want.items())


@pytest.mark.gpu
@pytest.mark.parametrize("num_reqs", [1, MAX_REQS])
def test_scatter_kernel_on_the_gpu(num_reqs):
    assert DEVICE == "cuda"
    test_scatter_writes_every_buffer_with_padding(True, num_reqs)
