"""Inputs of one EAGLE draft decode step, prepared on the device (docs/design.md, 'Draft inputs').

After the draft prefill produced draft 1 at each request's last accepted
position, draft step j (1 <= j < k) runs one query token per request at
position base + j. Its attention metadata is rebuilt for every step (stale
metadata from the step before silently lowers acceptance), from persistent
buffers, on the device, without a host sync, and rows past num_reqs hold values
that are always safe for a padded FULL graph to read (docs/invariants.md,
'Draft step metadata', 'Metadata on the device', 'Padded rows'):

    real row i < num_reqs        padded row i >= num_reqs
    positions[i]  = p            0
    seq_lens[i]   = p + 1        0
    slot_mapping[i] = slot of p  PAD_SLOT_ID (writes nothing)
    last_token_indices[i] = i    0
    query_start_loc[i + 1] = i + 1 for real rows, num_reqs (the last real end) for padded ones

where p = min(base + j, max_position - 1): the clamp keeps the rotary table
in range; drafts at the clamped position are never accepted anyway.

num_reqs may be a 1-element device tensor, so a graph captured once can be
replayed for another batch size: both paths read it on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.attention.metadata import PAD_SLOT_ID


@dataclass
class DraftStepBuffers:
    """Persistent outputs of prepare_draft_step: allocated once, rewritten in place every step,
    so a captured graph keeps reading the same tensors."""

    positions: torch.Tensor  # [max_num_reqs] int64
    seq_lens: torch.Tensor  # [max_num_reqs] int32
    query_start_loc: torch.Tensor  # [max_num_reqs + 1] int32
    slot_mapping: torch.Tensor  # [max_num_reqs] int64
    last_token_indices: torch.Tensor  # [max_num_reqs] int64
    # [1] int32: where a host int num_reqs is staged (by a fill kernel, not an upload) for the device to read.
    num_reqs: torch.Tensor

    @classmethod
    def allocate(cls, max_num_reqs: int, device: torch.device | str) -> DraftStepBuffers:
        def zeros(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=device)

        return cls(
            positions=zeros(max_num_reqs, torch.int64),
            seq_lens=zeros(max_num_reqs, torch.int32),
            query_start_loc=zeros(max_num_reqs + 1, torch.int32),
            slot_mapping=zeros(max_num_reqs, torch.int64),
            last_token_indices=zeros(max_num_reqs, torch.int64),
            num_reqs=zeros(1, torch.int32),
        )

    @property
    def max_num_reqs(self) -> int:
        return self.positions.shape[0]


def num_reqs_on_device(num_reqs: int | torch.Tensor, out: DraftStepBuffers) -> torch.Tensor:
    """num_reqs as a [1] int32 tensor on out's device, without reading it back to the host."""
    if isinstance(num_reqs, torch.Tensor):
        assert num_reqs.numel() == 1, f"num_reqs must hold one value, got shape {tuple(num_reqs.shape)}"
        return num_reqs.reshape(1).to(device=out.num_reqs.device, dtype=torch.int32)
    assert 0 <= num_reqs <= out.max_num_reqs, f"num_reqs={num_reqs} outside [0, {out.max_num_reqs}]"
    return out.num_reqs.fill_(num_reqs)


def prepare_draft_step_torch(step: int, num_reqs: int | torch.Tensor, base_positions: torch.Tensor,
                             block_table: torch.Tensor, block_size: int, max_position: int,
                             out: DraftStepBuffers) -> None:
    """prepare_draft_step in plain torch ops (the CPU path and the kernel's reference)."""
    assert step >= 1, "draft step 0 is the prefill, which reuses the target's metadata"
    n = num_reqs_on_device(num_reqs, out)
    m = out.max_num_reqs
    rows = torch.arange(m, device=out.positions.device)
    real = rows < n
    # Padded rows may hold stale or garbage base positions; zeroing theirs before the gather
    # keeps every table read in bounds.
    pos = torch.where(real, torch.clamp(base_positions[:m] + step, max=max_position - 1), 0)
    block = block_table[:m].gather(1, (pos // block_size).unsqueeze(1)).squeeze(1).to(torch.int64)
    out.positions.copy_(pos)
    out.seq_lens.copy_(torch.where(real, pos + 1, 0))
    out.slot_mapping.copy_(torch.where(real, block * block_size + pos % block_size, PAD_SLOT_ID))
    out.last_token_indices.copy_(torch.where(real, rows, 0))
    # Request i owns query token i alone, so entry i is i up to the last real end and stays there.
    out.query_start_loc.copy_(torch.minimum(torch.arange(m + 1, device=rows.device), n))


def prepare_draft_step(step: int, num_reqs: int | torch.Tensor, base_positions: torch.Tensor,
                       block_table: torch.Tensor, block_size: int, max_position: int, out: DraftStepBuffers,
                       *, use_triton: bool | None = None) -> None:
    """Fill `out` with the inputs of draft step `step` (>= 1) for rows < num_reqs, pad values past them.

    base_positions [>= max_num_reqs]: each request's last accepted position (where the draft
    prefill produced draft 1); block_table [>= max_num_reqs, max_blocks] int32 must cover
    block (base + step) // block_size of every real row. num_reqs is an int or a 1-element
    device tensor (read on the device, so graph replays may change it). Runs the Triton
    kernel on CUDA and torch ops elsewhere; use_triton forces either (tests run the kernel
    under TRITON_INTERPRET=1).
    """
    if use_triton is None:
        use_triton = out.positions.is_cuda
    if use_triton:
        from specserve.kernels.eagle_inputs import prepare_draft_step_triton

        prepare_draft_step_triton(step, num_reqs, base_positions, block_table, block_size, max_position, out)
    else:
        prepare_draft_step_torch(step, num_reqs, base_positions, block_table, block_size, max_position, out)
