"""Inputs of one draft decode step, prepared on the device (design.md 4.5-4.7).

For draft step j each drafting request has one query token at position
base + j (clamped below max_position, where drafts are never accepted
anyway). Everything is computed from persistent buffers on the device, with
no host sync, and rows past num_reqs get values that are always safe to read:
an empty request at the last real end, seq_len 0, a slot that writes nothing,
last-token index 0. num_reqs may be a device tensor, so a captured graph can
be replayed for another batch size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.attention.metadata import PAD_SLOT_ID

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path below serves CPU-only installs
    triton = None


@dataclass
class DraftStepBuffers:
    positions: torch.Tensor  # [max_num_reqs] int64
    seq_lens: torch.Tensor  # [max_num_reqs] int32
    query_start_loc: torch.Tensor  # [max_num_reqs + 1] int32
    slot_mapping: torch.Tensor  # [max_num_reqs] int64
    last_token_indices: torch.Tensor  # [max_num_reqs] int64

    @classmethod
    def allocate(cls, max_num_reqs: int, device) -> "DraftStepBuffers":
        def z(n, dtype):
            return torch.zeros(n, dtype=dtype, device=device)

        return cls(z(max_num_reqs, torch.int64), z(max_num_reqs, torch.int32), z(max_num_reqs + 1, torch.int32),
                   z(max_num_reqs, torch.int64), z(max_num_reqs, torch.int64))

    @property
    def max_num_reqs(self) -> int:
        return self.positions.shape[0]


def _as_tensor(num_reqs, device) -> torch.Tensor:
    if isinstance(num_reqs, torch.Tensor):
        return num_reqs.reshape(1).to(device=device, dtype=torch.int32)
    return torch.tensor([num_reqs], dtype=torch.int32, device=device)


def prepare_draft_step_torch(step: int, num_reqs, base_positions: torch.Tensor, block_table: torch.Tensor,
                             block_size: int, max_position: int, out: DraftStepBuffers) -> None:
    n = _as_tensor(num_reqs, out.positions.device).to(torch.int64)
    rows = torch.arange(out.max_num_reqs, device=out.positions.device)
    real = rows < n
    pos = torch.clamp(base_positions[: out.max_num_reqs] + step, max=max_position - 1)
    block_idx = torch.where(real, pos // block_size, 0)
    blocks = block_table[: out.max_num_reqs].gather(1, block_idx.unsqueeze(1)).squeeze(1).to(torch.int64)
    out.positions.copy_(torch.where(real, pos, 0))
    out.seq_lens.copy_(torch.where(real, pos + 1, 0))
    out.slot_mapping.copy_(torch.where(real, blocks * block_size + pos % block_size, PAD_SLOT_ID))
    out.last_token_indices.copy_(torch.where(real, rows, 0))
    # Request i's single token is query i; padded requests are empty at the last real end, n.
    out.query_start_loc.copy_(torch.minimum(torch.arange(out.max_num_reqs + 1, device=rows.device), n))


if triton is not None:

    @triton.jit
    def _prepare_kernel(num_reqs_ptr, base_ptr, table_ptr, table_stride, pos_ptr, seq_ptr, qsl_ptr, slot_ptr,
                        last_ptr, step, block_size, max_position, max_num_reqs, PAD: tl.constexpr,
                        BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        in_range = rows < max_num_reqs
        n = tl.load(num_reqs_ptr)
        real = in_range & (rows < n)
        pos = tl.minimum(tl.load(base_ptr + rows, mask=real, other=0) + step, max_position - 1)
        block = tl.load(table_ptr + rows * table_stride + pos // block_size, mask=real, other=0).to(tl.int64)
        tl.store(pos_ptr + rows, tl.where(real, pos, 0), mask=in_range)
        tl.store(seq_ptr + rows, tl.where(real, pos + 1, 0).to(tl.int32), mask=in_range)
        tl.store(slot_ptr + rows, tl.where(real, block * block_size + pos % block_size, PAD), mask=in_range)
        tl.store(last_ptr + rows, tl.where(real, rows, 0).to(tl.int64), mask=in_range)
        # query_start_loc has one more entry than there are rows.
        qrows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(qsl_ptr + qrows, tl.minimum(qrows, n).to(tl.int32), mask=qrows <= max_num_reqs)


def prepare_draft_step_triton(step: int, num_reqs, base_positions: torch.Tensor, block_table: torch.Tensor,
                              block_size: int, max_position: int, out: DraftStepBuffers) -> None:
    m = out.max_num_reqs
    block = 128
    n = _as_tensor(num_reqs, out.positions.device)
    _prepare_kernel[(triton.cdiv(m + 1, block),)](
        n, base_positions, block_table, block_table.stride(0), out.positions, out.seq_lens, out.query_start_loc,
        out.slot_mapping, out.last_token_indices, step, block_size, max_position, m, PAD=PAD_SLOT_ID, BLOCK=block)


def prepare_draft_step(step: int, num_reqs, base_positions: torch.Tensor, block_table: torch.Tensor,
                       block_size: int, max_position: int, out: DraftStepBuffers, use_triton: bool | None = None
                       ) -> None:
    """Fill `out` for draft step `step` (>= 1); Triton on CUDA, torch elsewhere unless use_triton says."""
    if use_triton is None:
        use_triton = triton is not None and out.positions.is_cuda
    fn = prepare_draft_step_triton if use_triton else prepare_draft_step_torch
    fn(step, num_reqs, base_positions, block_table, block_size, max_position, out)
