"""The Triton kernels of spec_decode/draft_inputs.py: a device drafter's inputs gathered from the target step
just run, one launch each."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.worker.staged_inputs import HEADER_EXTRAS, NUM_TOKENS, StagedExtra

_TOKENS_PER_LOOP = 128
_TABLE_COLUMNS = 64


# pad_to and pad_reqs are a graph's sizes, one per recorded batch size: not specializing on them keeps
# one compiled kernel for all.
@triton.jit(do_not_specialize=["pad_to", "pad_reqs"])
def _gather_draft_inputs_kernel(
    staged_ptr, accepted_ptr, accepted_stride, tokens_ptr, tokens_stride, input_ids_ptr, positions_ptr,
    block_table_ptr, block_table_stride, pad_to, pad_reqs,
    next_ids_ptr, last_ptr, last_tokens_ptr, base_positions_ptr, draft_table_ptr, draft_table_stride,
    max_blocks, REQUESTS_AT: tl.constexpr, REQUESTS_ROWS: tl.constexpr, NUM_TOKENS_AT: tl.constexpr,
    TOKENS: tl.constexpr, COLUMNS: tl.constexpr,
):
    r = tl.program_id(0)
    # The grid is a bound: the header says how many requests there are and where their rows are.
    num_scheduled = tl.load(staged_ptr + REQUESTS_ROWS)
    num_tokens = tl.load(staged_ptr + NUM_TOKENS_AT)
    requests_ptr = staged_ptr + tl.load(staged_ptr + REQUESTS_AT)
    if r > num_scheduled:
        return
    if r == num_scheduled:
        # The extra program: zeros over the drafter graph's padded tokens and rows.
        for p0 in range(num_tokens, pad_to, TOKENS):
            p = p0 + tl.arange(0, TOKENS)
            tl.store(next_ids_ptr + p, tl.zeros([TOKENS], dtype=tl.int64), mask=p < pad_to)
        for i0 in range(num_scheduled, pad_reqs, TOKENS):
            i = i0 + tl.arange(0, TOKENS)
            tl.store(last_ptr + i, tl.zeros([TOKENS], dtype=tl.int64), mask=i < pad_reqs)
            tl.store(last_tokens_ptr + i, tl.zeros([TOKENS], dtype=tl.int64), mask=i < pad_reqs)
    else:
        first = tl.load(requests_ptr + r * 5)
        end = first + tl.load(requests_ptr + r * 5 + 1)
        slot = tl.load(requests_ptr + r * 5 + 2)
        override_at = end - 1
        value = tl.load(requests_ptr + r * 5 + 4)
        if slot >= 0:
            acc = tl.load(accepted_ptr + r * accepted_stride)
            override_at = end - 1 - tl.load(requests_ptr + r * 5 + 3) + acc
            value = tl.load(tokens_ptr + r * tokens_stride + acc)
            tl.store(last_ptr + slot, override_at)
            tl.store(last_tokens_ptr + slot, value)
            tl.store(base_positions_ptr + slot, tl.load(positions_ptr + override_at))
            for c0 in range(0, max_blocks, COLUMNS):
                c = c0 + tl.arange(0, COLUMNS)
                block = tl.load(block_table_ptr + r * block_table_stride + c, mask=c < max_blocks, other=0)
                tl.store(draft_table_ptr + slot * draft_table_stride + c, block, mask=c < max_blocks)
        for t0 in range(first, end, TOKENS):
            t = t0 + tl.arange(0, TOKENS)
            live = t < end
            following = tl.where(t + 1 < num_tokens, t + 1, 0)
            nxt = tl.load(input_ids_ptr + following, mask=live, other=0)
            tl.store(next_ids_ptr + t, tl.where(t == override_at, value, nxt), mask=live)


def gather_draft_inputs_triton(staged: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                               input_ids: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                               pad_to: int, pad_reqs: int, next_ids: torch.Tensor, last: torch.Tensor,
                               last_tokens: torch.Tensor, base_positions: torch.Tensor,
                               draft_block_table: torch.Tensor, max_rows: int) -> None:
    """gather_draft_inputs (spec_decode/draft_inputs.py) as one launch of max_rows + 1 programs."""
    assert staged.is_contiguous() and staged.dtype == torch.int64 and block_table.stride(1) == 1
    assert draft_block_table.stride(1) == 1 and tokens.stride(1) == 1
    at_slot, rows_slot = HEADER_EXTRAS[StagedExtra.DRAFT_REQUESTS]
    _gather_draft_inputs_kernel[(max_rows + 1,)](
        staged, accepted, accepted.stride(0), tokens, tokens.stride(0), input_ids, positions,
        block_table, block_table.stride(0), pad_to, pad_reqs,
        next_ids, last, last_tokens, base_positions, draft_block_table, draft_block_table.stride(0),
        block_table.shape[1], REQUESTS_AT=at_slot, REQUESTS_ROWS=rows_slot, NUM_TOKENS_AT=NUM_TOKENS,
        TOKENS=_TOKENS_PER_LOOP, COLUMNS=_TABLE_COLUMNS,
    )


@triton.jit
def _follow_tree_paths_kernel(path_ptr, accepted_ptr, tokens_ptr, slots_ptr, positions_ptr, next_ids_ptr,
                              last_ptr, base_positions_ptr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    acc = tl.load(accepted_ptr + i)
    on_path = d <= acc
    path = tl.load(path_ptr + i * WIDTH + d, mask=on_path, other=0)
    tl.store(next_ids_ptr + path, tl.load(tokens_ptr + i * WIDTH + d, mask=on_path, other=0), mask=on_path)
    last_index = tl.load(path_ptr + i * WIDTH + acc)
    slot = tl.load(slots_ptr + i)
    tl.store(last_ptr + slot, last_index)
    tl.store(base_positions_ptr + slot, tl.load(positions_ptr + last_index))


def follow_tree_paths_triton(path_tokens: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                             slots: torch.Tensor, positions: torch.Tensor, next_ids: torch.Tensor, last: torch.Tensor,
                             base_positions: torch.Tensor) -> None:
    """follow_tree_paths (spec_decode/draft_inputs.py) as one launch."""
    n, width = path_tokens.shape
    assert path_tokens.is_contiguous() and tokens.is_contiguous() and tokens.shape[1] == width
    if n:
        _follow_tree_paths_kernel[(n,)](path_tokens, accepted, tokens, slots, positions, next_ids, last,
                                        base_positions, WIDTH=width, BLOCK=triton.next_power_of_2(width))
