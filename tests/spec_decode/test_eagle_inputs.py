"""The draft-step input preparation leaves exact values in real rows and exact pad values past them."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from specserve.attention.metadata import PAD_SLOT_ID  # noqa: E402
from specserve.spec_decode.eagle_inputs import DraftStepBuffers, prepare_draft_step  # noqa: E402

MAX_REQS, MAX_BLOCKS, BLOCK = 12, 6, 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def poisoned() -> DraftStepBuffers:
    buf = DraftStepBuffers.allocate(MAX_REQS, DEVICE)
    for t in (buf.positions, buf.seq_lens, buf.query_start_loc, buf.slot_mapping, buf.last_token_indices):
        t.fill_(12345)
    return buf


def inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    # Shuffled, non-contiguous block ids per request.
    table = torch.stack([torch.randperm(100, generator=g)[:MAX_BLOCKS] for _ in range(MAX_REQS)]).to(torch.int32)
    base = torch.randint(0, MAX_BLOCKS * BLOCK - 8, (MAX_REQS,), generator=g)
    return base.to(DEVICE), table.to(DEVICE)


def expected(step, n, base, table, max_position):
    rows = []
    for i in range(MAX_REQS):
        if i < n:
            p = min(int(base[i]) + step, max_position - 1)
            slot = int(table[i, p // BLOCK]) * BLOCK + p % BLOCK
            rows.append((p, p + 1, slot, i))
        else:
            rows.append((0, 0, PAD_SLOT_ID, 0))
    qsl = [min(i, n) for i in range(MAX_REQS + 1)]
    return rows, qsl


def check(buf, step, n, base, table, max_position=10_000):
    rows, qsl = expected(step, n, base.cpu(), table.cpu(), max_position)
    got = list(zip(buf.positions.tolist(), buf.seq_lens.tolist(), buf.slot_mapping.tolist(),
                   buf.last_token_indices.tolist()))
    assert got == rows
    assert buf.query_start_loc.tolist() == qsl


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("step", [1, 2, 4])
def test_real_rows_exact_and_padded_rows_are_pad_values(use_triton, step):
    base, table = inputs(step)
    buf = poisoned()
    prepare_draft_step(step, 5, base, table, BLOCK, 10_000, buf, use_triton=use_triton)
    check(buf, step, 5, base, table)


def test_triton_and_torch_agree_and_clamp_at_max_position():
    base, table = inputs(7)
    a, b = poisoned(), poisoned()
    max_position = int(base.max()) + 2  # some rows run past it
    prepare_draft_step(3, 9, base, table, BLOCK, max_position, a, use_triton=False)
    prepare_draft_step(3, 9, base, table, BLOCK, max_position, b, use_triton=True)
    for x, y in zip((a.positions, a.seq_lens, a.query_start_loc, a.slot_mapping, a.last_token_indices),
                    (b.positions, b.seq_lens, b.query_start_loc, b.slot_mapping, b.last_token_indices)):
        assert torch.equal(x, y)
    assert int(a.positions.max()) == max_position - 1
    check(a, 3, 9, base, table, max_position)


@pytest.mark.parametrize("use_triton", [False, True])
def test_num_reqs_as_device_tensor_leaves_nothing_stale(use_triton):
    base, table = inputs(11)
    buf = poisoned()
    prepare_draft_step(1, torch.tensor([10], device=DEVICE), base, table, BLOCK, 10_000, buf, use_triton=use_triton)
    check(buf, 1, 10, base, table)
    prepare_draft_step(2, torch.tensor([3], device=DEVICE), base, table, BLOCK, 10_000, buf, use_triton=use_triton)
    check(buf, 2, 3, base, table)
