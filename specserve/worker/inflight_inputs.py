"""Inputs of requests whose previous step is still running on the device (asynchronous scheduling).

The host scheduled such a request for 1 + s tokens before learning what its
previous step produced: the host wrote placeholder ids and optimistic
positions (as if every draft of that step was accepted). On the device, from
the previous step's outputs, each such request gets:

    input_ids[first]         = the token the previous step emitted last (its bonus or recovered token)
    input_ids[first + 1 + t] = the previous step's draft t                (t < s)
    positions, seq_len       moved back by R = drafts verified - drafts accepted in the previous step
    slot_mapping[first + t]  recomputed from the block table at the moved position of token 0, plus t
                             (a token of a tree of drafts sits at its depth but keeps its own slot)

Rows and tokens of other requests are left alone, so this runs after the
ordinary upload and before the forward, all on one stream, without a host
sync. Per in-flight request the host stages one InflightRequest row as
StagedExtra.INFLIGHT, which the kernel finds through the staged array's header
(staged_inputs.py), so its launch is the same every step.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.worker.staged_inputs import StagedExtra, header_extra


@dataclass(frozen=True)
class PreviousRow:
    """Where a request's tokens are in the outputs of the step launched last."""

    batch_row: int
    drafts_verified: int


@dataclass(frozen=True)
class InflightRequest:
    """One in-flight request of the step; its fields, in order, are the columns of its staged row
    (inflight_rows), which the kernels read by position."""

    batch_row: int  # its row in this step's batch
    previous_row: int  # its row in the previous step's outputs
    first: int  # its first token in this step
    count: int  # its tokens in this step
    drafts_verified: int  # the drafts the previous step verified for it

    @classmethod
    def of(cls, batch_row: int, previous: PreviousRow, first: int, count: int) -> InflightRequest:
        return cls(batch_row, previous.batch_row, first, count, previous.drafts_verified)


META_COLUMNS = 5


def inflight_rows(requests: Sequence[InflightRequest]) -> np.ndarray:
    """The staged form of requests: int64 [len(requests), META_COLUMNS]."""
    return np.array([(r.batch_row, r.previous_row, r.first, r.count, r.drafts_verified) for r in requests],
                    dtype=np.int64).reshape(-1, META_COLUMNS)


def take_inflight_inputs_torch(staged: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                               drafts: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                               seq_lens: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                               block_size: int) -> None:
    """The update in torch ops (the CPU path and the kernel's reference)."""
    meta = header_extra(staged, StagedExtra.INFLIGHT, META_COLUMNS)
    if meta.shape[0] == 0:
        return
    row, prev, first, count, verified = meta.unbind(1)
    acc = accepted[prev]
    rejected = verified - acc
    last = tokens[prev, acc]
    # Token t of in-flight request m sits at first[m] + t.
    which = torch.repeat_interleave(torch.arange(meta.shape[0], device=meta.device), count)
    offset = torch.arange(which.shape[0], device=meta.device) - torch.repeat_interleave(
        torch.cumsum(count, 0) - count, count)
    index = first[which] + offset
    draft = drafts[prev[which], (offset - 1).clamp(min=0)] if drafts.shape[1] else last[which]
    input_ids[index] = torch.where(offset == 0, last[which], draft)
    slot_pos = (positions[first] - rejected)[which] + offset
    positions[index] = positions[index] - rejected[which]
    block = block_table[row[which], slot_pos // block_size].to(torch.int64)
    slot_mapping[index] = block * block_size + slot_pos % block_size
    seq_lens[row] -= rejected.to(seq_lens.dtype)


def take_inflight_inputs(staged: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor, drafts: torch.Tensor,
                         input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                         slot_mapping: torch.Tensor, block_table: torch.Tensor, block_size: int, max_rows: int,
                         *, use_triton: bool | None = None) -> None:
    """Fill in the inputs of in-flight requests (see the module docstring). staged: the step's staged array
    (int64), whose header locates the in-flight rows; max_rows: at least their number (the grid; a graph
    records it once). accepted [R], tokens [R, k + 1], drafts [R, k]: the previous step's outputs by its batch
    row; the rest: the runner's persistent input buffers. One Triton launch on CUDA, torch ops elsewhere
    (use_triton forces either; tests run the kernel under TRITON_INTERPRET=1)."""
    if use_triton is None:
        use_triton = input_ids.is_cuda
    if max_rows == 0:
        return
    if use_triton:
        from specserve.kernels.inflight_inputs import take_inflight_inputs_triton

        take_inflight_inputs_triton(staged, accepted, tokens, drafts, input_ids, positions, seq_lens, slot_mapping,
                                    block_table, block_size, max_rows)
    else:
        take_inflight_inputs_torch(staged, accepted, tokens, drafts, input_ids, positions, seq_lens, slot_mapping,
                                   block_table, block_size)
