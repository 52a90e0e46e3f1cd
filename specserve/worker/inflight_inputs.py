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
sync. Per in-flight request the host stages one row of extra "inflight", which
the kernel finds through the staged array's header (staged_inputs.py), so its
launch is the same every step:
(row in this batch, row in the previous step's outputs, index of its first token, number of
tokens, drafts the previous step verified for it).
"""
from __future__ import annotations

import torch

from specserve.worker.staged_inputs import header_extra

META_COLUMNS = 5


def take_inflight_inputs_torch(staged: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                               drafts: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                               seq_lens: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                               block_size: int) -> None:
    """The update in torch ops (the CPU path and the kernel's reference)."""
    meta = header_extra(staged, "inflight", META_COLUMNS)
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
