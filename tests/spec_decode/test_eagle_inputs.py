"""Draft decode step inputs: exact values in real rows, exactly the pad values of docs/invariants.md,
'Padded rows' past them, the same buffers from the Triton kernel and the torch path, and a device-side
num_reqs that can change between calls over the same buffers.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py switches it on).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from specserve.attention.metadata import PAD_SLOT_ID  # noqa: E402
from specserve.spec_decode.eagle_inputs import DraftStepBuffers, prepare_draft_step  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE, MAX_BLOCKS = 4, 8
NO_CLAMP = 10_000  # a max_position no test position reaches
BOTH_PATHS = pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
FIELDS = ("positions", "seq_lens", "query_start_loc", "slot_mapping", "last_token_indices")


def poisoned(max_num_reqs: int) -> DraftStepBuffers:
    """Buffers whose every entry holds a value no correct step writes (alternating 12345 / -7)."""
    buf = DraftStepBuffers.allocate(max_num_reqs, DEVICE)
    for name in FIELDS:
        t = getattr(buf, name)
        t.copy_(torch.where(torch.arange(t.numel(), device=DEVICE) % 2 == 0, 12345, -7))
    return buf


def batch(max_num_reqs: int, num_reqs: int, seed: int):
    """Random base positions and block tables for the first num_reqs rows, garbage past them.

    Block ids are distinct, drawn shuffled from a pool twice the table's size, so a slot computed
    from the wrong row or the wrong block index cannot come out right by accident. The garbage base
    positions of padded rows would index far outside the table if anything used them.
    """
    g = torch.Generator().manual_seed(seed)
    num_entries = max_num_reqs * MAX_BLOCKS
    table = torch.randperm(2 * num_entries, generator=g)[:num_entries].reshape(max_num_reqs, MAX_BLOCKS)
    # Low enough that base + every tested step stays inside the table.
    base = torch.randint(0, MAX_BLOCKS * BLOCK_SIZE - 8, (max_num_reqs,), generator=g)
    base[num_reqs:] = torch.tensor([10**9, -7]).repeat(max_num_reqs)[: max_num_reqs - num_reqs]
    return base.to(DEVICE), table.to(torch.int32).to(DEVICE)


def expected(step: int, num_reqs: int, max_num_reqs: int, base: list[int], table: list[list[int]],
             max_position: int) -> dict[str, list[int]]:
    """The step's buffers computed independently, one request at a time."""
    want = {name: [] for name in FIELDS}
    for i in range(max_num_reqs):
        if i < num_reqs:
            p = min(base[i] + step, max_position - 1)
            row = (p, p + 1, table[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE, i)
        else:
            row = (0, 0, PAD_SLOT_ID, 0)  # docs/invariants.md, 'Padded rows'
        for name, value in zip(("positions", "seq_lens", "slot_mapping", "last_token_indices"), row):
            want[name].append(value)
    # One query token per request; padded requests are empty at the last real end.
    want["query_start_loc"] = list(range(num_reqs + 1)) + [num_reqs] * (max_num_reqs - num_reqs)
    return want


def assert_step(buf: DraftStepBuffers, step: int, num_reqs: int, base, table, max_position: int = NO_CLAMP):
    want = expected(step, num_reqs, buf.max_num_reqs, base.tolist(), table.tolist(), max_position)
    for name in FIELDS:
        assert getattr(buf, name).tolist() == want[name], name


@BOTH_PATHS
@pytest.mark.parametrize("max_num_reqs, num_reqs", [(12, 5), (12, 0), (12, 12), (128, 127)])
def test_real_rows_exact_and_padded_rows_hold_pad_values(use_triton, max_num_reqs, num_reqs):
    # With 128 rows, query_start_loc's extra entry is the only one a second kernel program writes.
    base, table = batch(max_num_reqs, num_reqs, seed=max_num_reqs + num_reqs)
    for step in (1, 2, 3, 6):
        buf = poisoned(max_num_reqs)
        prepare_draft_step(step, num_reqs, base, table, BLOCK_SIZE, NO_CLAMP, buf, use_triton=use_triton)
        assert_step(buf, step, num_reqs, base, table)


@pytest.mark.parametrize("seed", range(4))
def test_triton_kernel_and_torch_path_write_identical_buffers(seed):
    max_num_reqs = (9, 16, 33, 128)[seed]
    num_reqs = torch.randint(1, max_num_reqs, (1,), generator=torch.Generator().manual_seed(seed)).item()
    base, table = batch(max_num_reqs, num_reqs, seed)
    max_position = int(base[:num_reqs].max()) + 2  # some rows are clamped, some not
    for step in (1, 4):
        by_torch, by_triton = poisoned(max_num_reqs), poisoned(max_num_reqs)
        prepare_draft_step(step, num_reqs, base, table, BLOCK_SIZE, max_position, by_torch, use_triton=False)
        prepare_draft_step(step, num_reqs, base, table, BLOCK_SIZE, max_position, by_triton, use_triton=True)
        for name in FIELDS:
            a, b = getattr(by_torch, name), getattr(by_triton, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name


@BOTH_PATHS
def test_positions_clamp_below_max_position(use_triton):
    max_position = MAX_BLOCKS * BLOCK_SIZE  # the rotary table ends with the last block of the table
    base, table = batch(6, 4, seed=3)
    base[:4] = torch.tensor([max_position - 1, max_position - 2, max_position - 5, 0])
    buf = poisoned(6)
    prepare_draft_step(3, 4, base, table, BLOCK_SIZE, max_position, buf, use_triton=use_triton)
    last = max_position - 1
    assert buf.positions.tolist()[:4] == [last, last, max_position - 2, 3]
    assert buf.seq_lens.tolist()[:4] == [max_position, max_position, max_position - 1, 4]
    last_slot = int(table[0, -1]) * BLOCK_SIZE + BLOCK_SIZE - 1
    assert buf.slot_mapping[0].item() == last_slot
    assert_step(buf, 3, 4, base, table, max_position)


@BOTH_PATHS
def test_device_num_reqs_changes_between_calls_without_stale_rows(use_triton):
    max_num_reqs = 12
    base, table = batch(max_num_reqs, max_num_reqs, seed=5)
    buf = poisoned(max_num_reqs)
    # One persistent tensor, rewritten between calls like a graph's num_reqs input between replays.
    num_reqs = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for step, n in ((1, 10), (2, 3), (2, 7)):
        num_reqs.fill_(n)
        prepare_draft_step(step, num_reqs, base, table, BLOCK_SIZE, NO_CLAMP, buf, use_triton=use_triton)
        assert_step(buf, step, n, base, table)
    # A tensor of another integer type is accepted too.
    prepare_draft_step(1, torch.tensor(4, device=DEVICE), base, table, BLOCK_SIZE, NO_CLAMP, buf,
                       use_triton=use_triton)
    assert_step(buf, 1, 4, base, table)
