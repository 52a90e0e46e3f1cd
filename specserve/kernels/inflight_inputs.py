"""The Triton kernel of worker/inflight_inputs.py: the inputs of requests whose previous step is still running,
filled in on the device in one launch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.worker.staged_inputs import HEADER_EXTRAS, StagedExtra


@triton.jit
def _take_inflight_inputs_kernel(
    staged_ptr, accepted_ptr, accepted_stride, tokens_ptr, tokens_stride, drafts_ptr, drafts_stride,
    input_ids_ptr, positions_ptr, seq_lens_ptr, slot_mapping_ptr, block_table_ptr, block_table_stride,
    block_size, META_AT: tl.constexpr, META_ROWS: tl.constexpr, NUM_DRAFT_COLS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    m = tl.program_id(0)
    # The grid is a bound; the header says how many requests are in flight and where their rows are.
    if m >= tl.load(staged_ptr + META_ROWS):
        return
    meta_ptr = staged_ptr + tl.load(staged_ptr + META_AT)
    row = tl.load(meta_ptr + m * 5)
    prev = tl.load(meta_ptr + m * 5 + 1)
    first = tl.load(meta_ptr + m * 5 + 2)
    count = tl.load(meta_ptr + m * 5 + 3)
    verified = tl.load(meta_ptr + m * 5 + 4)
    acc = tl.load(accepted_ptr + prev * accepted_stride)
    rejected = verified - acc
    last = tl.load(tokens_ptr + prev * tokens_stride + acc)
    t = tl.arange(0, BLOCK)
    live = t < count
    if NUM_DRAFT_COLS > 0:
        draft = tl.load(drafts_ptr + prev * drafts_stride + tl.maximum(t - 1, 0), mask=live & (t > 0), other=0)
    else:
        draft = last
    tl.store(input_ids_ptr + first + t, tl.where(t == 0, last, draft), mask=live)
    pos = tl.load(positions_ptr + first + t, mask=live, other=0) - rejected
    slot_pos = tl.sum(tl.where(t == 0, pos, 0), axis=0) + t
    tl.store(positions_ptr + first + t, pos, mask=live)
    block = tl.load(block_table_ptr + row * block_table_stride + slot_pos // block_size, mask=live, other=0)
    tl.store(slot_mapping_ptr + first + t, block.to(tl.int64) * block_size + slot_pos % block_size, mask=live)
    seq_len = tl.load(seq_lens_ptr + row)
    tl.store(seq_lens_ptr + row, (seq_len - rejected).to(tl.int32))


def take_inflight_inputs_triton(staged: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                                drafts: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                                seq_lens: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                                block_size: int, max_rows: int) -> None:
    """take_inflight_inputs (worker/inflight_inputs.py) as one launch of max_rows programs."""
    assert staged.dtype == torch.int64 and staged.is_contiguous()
    assert tokens.stride(1) == 1 and block_table.stride(1) == 1 and seq_lens.dtype == torch.int32
    k = drafts.shape[1]
    at_slot, rows_slot = HEADER_EXTRAS[StagedExtra.INFLIGHT]
    _take_inflight_inputs_kernel[(max_rows,)](
        staged, accepted, accepted.stride(0), tokens, tokens.stride(0), drafts, drafts.stride(0) if k else 0,
        input_ids, positions, seq_lens, slot_mapping, block_table, block_table.stride(0), block_size,
        META_AT=at_slot, META_ROWS=rows_slot, NUM_DRAFT_COLS=k, BLOCK=triton.next_power_of_2(k + 1),
    )
