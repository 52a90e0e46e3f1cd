"""A step's host inputs reach the device in one copy, then one kernel spreads them into the persistent buffers.

Each host-to-device copy and each fill of a padded tail is a launch of its own,
and a launch costs the host more time than a small model's kernel costs the
GPU, so a step that uploaded its inputs buffer by buffer would spend more host
time launching than the model spends computing. Here the host packs everything into one
int64 array (StagedLayout says where each part sits), copies it into one
device staging buffer, and `scatter_staged_inputs` writes the persistent
buffers, padding included:

    tokens t < T                 input_ids, positions, slot_mapping, tree_bits from the staged arrays
    tokens T <= t < max_tokens   0, 0, PAD_SLOT_ID, -1     (docs/invariants.md, 'Padded rows')
    requests r < R               seq_lens[r], query_start_loc[r + 1], block_table row r
                                 (its first `table_width` staged columns, zeros after)
    requests R <= r < max_reqs   seq_lens 0, query_start_loc[r + 1] = T (empty requests)

The rest of the staged array (`extras`: index lists for sampling,
verification and drafting, each named by a StagedExtra) is read in place by
later kernels of the step: the next step's copy is queued behind them on the
same stream.

A header of HEADER_SLOTS values opens the array: the step's sizes, and where
the extras that kernels read (HEADER_EXTRAS) start and how many rows they
hold. Those kernels take no per-step argument, so a CUDA graph can hold their
launches and replay them for any step (the runner's whole-step graphs).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

import numpy as np
import torch

from specserve.attention.metadata import PAD_SLOT_ID



class StagedExtra(Enum):
    """The int64 arrays a step may stage after its inputs (worker/step_plan.py), each [rows] or [rows, columns]."""

    INFLIGHT = "inflight"  # a row per in-flight request (worker/inflight_inputs.py)
    DRAFT_REQUESTS = "draft requests"  # a row per scheduled request, for the drafter (spec_decode/draft_inputs.py)
    SAMPLE_INDEX = "sample index"  # the token each request sampling without drafts samples at
    SAMPLE_ROWS = "sample rows"  # those requests' batch rows
    VERIFY_INDEX = "verify index"  # [rows, max drafts + 1]: the tokens each verifying request is verified at
    VERIFY_DRAFTS = "verify drafts"  # the drafts each verifies
    VERIFY_ROWS = "verify rows"  # their batch rows
    VERIFY_DRAFT_ROWS = "verify draft rows"  # their rows of the drafter's draft probabilities
    DRAFT_ROWS = "draft rows"  # each drafting request's row of the drafter's per-request state
    SAMPLING_ROWS = "sampling rows"  # each drafting request's batch row
    VERIFY_SLOTS = "verify slots"  # each verifying request's drafting index (trees of drafts)


# The header's slots. Its size keeps the arrays after it 16-byte aligned (see pack_step_inputs). MASKED: 1 where
# the step's grammar masks are in the runner's bitmask buffer (InputBuffers.token_bitmask), the switch of the
# mask that the greedy graphs apply (sample/token_bitmask.py); 0 leaves their logits unmasked.
(NUM_TOKENS, NUM_REQS, TABLE_WIDTH, INFLIGHT_AT, INFLIGHT_ROWS, DRAFT_REQUESTS_AT, DRAFT_REQUESTS_ROWS,
 MASKED) = range(8)
HEADER_SLOTS = 8
# Extras that kernels find through the header: extra -> (slot of its offset, slot of its row count).
HEADER_EXTRAS = {StagedExtra.INFLIGHT: (INFLIGHT_AT, INFLIGHT_ROWS),
                 StagedExtra.DRAFT_REQUESTS: (DRAFT_REQUESTS_AT, DRAFT_REQUESTS_ROWS)}


@dataclass(frozen=True)
class StagedLayout:
    """Where the parts of one step's staged array start (in int64 elements)."""

    num_tokens: int
    num_reqs: int
    table_width: int  # staged block-table columns per request (the longest row this step)
    extras: dict[StagedExtra, tuple[int, tuple[int, ...], int]]  # extra -> (offset, shape, number of values)
    size: int  # values staged in all

    @property
    def ids(self) -> int:
        return HEADER_SLOTS

    @property
    def positions(self) -> int:
        return HEADER_SLOTS + self.num_tokens

    @property
    def slots(self) -> int:
        return HEADER_SLOTS + 2 * self.num_tokens

    @property
    def tree_bits(self) -> int:
        return HEADER_SLOTS + 3 * self.num_tokens

    @property
    def seq_lens(self) -> int:
        return HEADER_SLOTS + 4 * self.num_tokens

    @property
    def query_ends(self) -> int:  # query_start_loc[1:]
        return self.seq_lens + self.num_reqs

    @property
    def table(self) -> int:
        return self.query_ends + self.num_reqs

    @property
    def end(self) -> int:  # where the extras may start
        return self.table + self.num_reqs * self.table_width


def pack_step_inputs(host: np.ndarray, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                     seq_lens: np.ndarray, query_ends: np.ndarray, table: np.ndarray,
                     extras: dict[StagedExtra, np.ndarray], tree_bits: np.ndarray | None = None,
                     masked: bool = False) -> StagedLayout:
    """Write the step's arrays into host (an int64 staging array) and return where they are. tree_bits: each
    token's (AttentionMetadata.tree_bits); None: -1 for all. masked: the header's MASKED."""
    num_tokens, num_reqs, width = len(input_ids), len(seq_lens), table.shape[1]
    offset = StagedLayout(num_tokens, num_reqs, width, {}, 0).end
    placed = {}
    for extra, values in extras.items():
        # 16-byte aligned, as Triton specializes a kernel on its pointers' alignment: a view at an odd
        # offset would compile another variant of the kernel reading it, in the middle of a run.
        offset += offset % 2
        placed[extra] = (offset, values.shape, values.size)
        offset += values.size
    layout = StagedLayout(num_tokens, num_reqs, width, placed, offset)
    if layout.size > host.shape[0]:
        raise RuntimeError(f"a step's inputs need {layout.size} staged values but the buffer holds {host.shape[0]}; "
                           "raise max_num_batched_tokens or lower max_num_seqs")
    header = [0] * HEADER_SLOTS
    header[NUM_TOKENS], header[NUM_REQS], header[TABLE_WIDTH] = num_tokens, num_reqs, width
    header[MASKED] = int(masked)
    for extra, (at_slot, rows_slot) in HEADER_EXTRAS.items():
        if extra in placed:
            header[at_slot], header[rows_slot] = placed[extra][0], placed[extra][1][0]
    host[:HEADER_SLOTS] = header
    if tree_bits is None:
        host[layout.tree_bits:layout.tree_bits + num_tokens] = -1
    else:
        host[layout.tree_bits:layout.tree_bits + num_tokens] = tree_bits
    for start, values in ((layout.ids, input_ids), (layout.positions, positions), (layout.slots, slots),
                          (layout.seq_lens, seq_lens), (layout.query_ends, query_ends), (layout.table, table)):
        host[start:start + values.size] = values.reshape(-1)
    for extra, values in extras.items():
        start = placed[extra][0]
        host[start:start + values.size] = values.reshape(-1)
    return layout


def header_extra(staged: torch.Tensor, extra: StagedExtra, columns: int) -> torch.Tensor:
    """`extra` ([rows, columns]) where the header of a staged array says it is, read on the host (the torch
    paths of the kernels that read it)."""
    at_slot, rows_slot = HEADER_EXTRAS[extra]
    header = staged[:HEADER_SLOTS].tolist()
    at, rows = header[at_slot], header[rows_slot]
    return staged[at:at + rows * columns].view(rows, columns)


def staged_layout(staged: torch.Tensor) -> StagedLayout:
    """The layout of the staged array's own parts, from its header (read on the host: the torch path)."""
    header = staged[:HEADER_SLOTS].tolist()
    own = StagedLayout(header[NUM_TOKENS], header[NUM_REQS], header[TABLE_WIDTH], {}, 0)
    return replace(own, size=own.end)


def scatter_staged_inputs_torch(staged: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                                slot_mapping: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                                block_table: torch.Tensor, tree_bits: torch.Tensor | None = None) -> None:
    """The scatter in torch ops (the CPU path and the kernel's reference)."""
    layout = staged_layout(staged)
    t, r, w = layout.num_tokens, layout.num_reqs, layout.table_width
    for buf, start, pad in ((input_ids, layout.ids, 0), (positions, layout.positions, 0),
                            (slot_mapping, layout.slots, PAD_SLOT_ID), (tree_bits, layout.tree_bits, -1)):
        if buf is None:
            continue
        buf[:t].copy_(staged[start:start + t])
        buf[t:].fill_(pad)
    seq_lens[:r].copy_(staged[layout.seq_lens:layout.seq_lens + r])
    seq_lens[r:].zero_()
    query_start_loc[0] = 0
    query_start_loc[1:r + 1].copy_(staged[layout.query_ends:layout.query_ends + r])
    query_start_loc[r + 1:].fill_(t)
    block_table[:r, :w].copy_(staged[layout.table:layout.table + r * w].view(r, w))
    block_table[:r, w:].zero_()


def scatter_staged_inputs(staged: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                          slot_mapping: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                          block_table: torch.Tensor, *, tree_bits: torch.Tensor | None = None,
                          use_triton: bool | None = None) -> None:
    """Write the persistent input buffers from the staged array (see the module docstring), its sizes read
    from its header on the device: one Triton launch on CUDA, the same for every step; torch ops elsewhere
    (use_triton forces either; tests run the kernel under TRITON_INTERPRET=1). tree_bits: written when given
    (engines that draft trees)."""
    if use_triton is None:
        use_triton = staged.is_cuda
    if use_triton:
        from specserve.kernels.staged_inputs import scatter_staged_inputs_triton

        scatter_staged_inputs_triton(staged, input_ids, positions, slot_mapping, seq_lens, query_start_loc,
                                     block_table, tree_bits)
    else:
        scatter_staged_inputs_torch(staged, input_ids, positions, slot_mapping, seq_lens, query_start_loc, block_table,
                                    tree_bits)
