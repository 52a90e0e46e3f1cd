"""The Triton kernel of worker/staged_inputs.py: one launch spreads a step's staged inputs into the persistent
buffers."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.metadata import PAD_SLOT_ID
from specserve.worker.staged_inputs import HEADER_SLOTS

# Tokens and request rows per program: a few programs cover the largest buffers.
_TOKENS_PER_PROGRAM = 1024
_REQS_PER_PROGRAM = 64
_TABLE_COLUMNS = 64


@triton.jit
def _scatter_staged_inputs_kernel(
    staged_ptr, input_ids_ptr, positions_ptr, slot_mapping_ptr, seq_lens_ptr, query_start_loc_ptr,
    block_table_ptr, block_table_stride, max_tokens, max_reqs, max_blocks, tree_bits_ptr,
    PAD_SLOT: tl.constexpr, TOKENS: tl.constexpr, REQS: tl.constexpr, COLUMNS: tl.constexpr,
    HEADER: tl.constexpr, TREE: tl.constexpr,
):
    # The step's sizes come from the header (slots 0-2, see HEADER_SLOTS), so one launch, or one graph
    # of it, serves every step; the parts follow the header in StagedLayout's order.
    num_tokens = tl.load(staged_ptr)
    num_reqs = tl.load(staged_ptr + 1)
    table_width = tl.load(staged_ptr + 2)
    positions_at = HEADER + num_tokens
    slots_at = positions_at + num_tokens
    tree_bits_at = slots_at + num_tokens
    seq_lens_at = tree_bits_at + num_tokens
    query_ends_at = seq_lens_at + num_reqs
    table_at = query_ends_at + num_reqs
    pid = tl.program_id(0)
    t = pid * TOKENS + tl.arange(0, TOKENS)
    live = t < num_tokens
    in_buffer = t < max_tokens
    ids = tl.load(staged_ptr + HEADER + t, mask=live, other=0)
    pos = tl.load(staged_ptr + positions_at + t, mask=live, other=0)
    slot = tl.load(staged_ptr + slots_at + t, mask=live, other=PAD_SLOT)
    tl.store(input_ids_ptr + t, ids, mask=in_buffer)
    tl.store(positions_ptr + t, pos, mask=in_buffer)
    tl.store(slot_mapping_ptr + t, slot, mask=in_buffer)
    if TREE:
        bits = tl.load(staged_ptr + tree_bits_at + t, mask=live, other=-1)
        tl.store(tree_bits_ptr + t, bits, mask=in_buffer)

    r = pid * REQS + tl.arange(0, REQS)
    real = r < num_reqs
    seq_len = tl.load(staged_ptr + seq_lens_at + r, mask=real, other=0)
    tl.store(seq_lens_ptr + r, seq_len.to(tl.int32), mask=r < max_reqs)
    end = tl.load(staged_ptr + query_ends_at + r, mask=real, other=num_tokens)
    tl.store(query_start_loc_ptr + r + 1, end.to(tl.int32), mask=r < max_reqs)
    if pid == 0:
        tl.store(query_start_loc_ptr, 0)
    for c0 in range(0, max_blocks, COLUMNS):
        c = c0 + tl.arange(0, COLUMNS)
        staged_col = real[:, None] & (c < table_width)[None, :]
        block = tl.load(staged_ptr + table_at + r[:, None] * table_width + c[None, :], mask=staged_col, other=0)
        tl.store(block_table_ptr + r[:, None] * block_table_stride + c[None, :], block.to(tl.int32),
                 mask=real[:, None] & (c < max_blocks)[None, :])


def scatter_staged_inputs_triton(staged: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                                 slot_mapping: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                                 block_table: torch.Tensor, tree_bits: torch.Tensor | None) -> None:
    """scatter_staged_inputs (worker/staged_inputs.py) as one launch, the same for every step."""
    assert staged.dtype == torch.int64 and block_table.stride(1) == 1 and seq_lens.dtype == torch.int32
    max_tokens, max_reqs = input_ids.shape[0], seq_lens.shape[0]
    grid = (max(triton.cdiv(max_tokens, _TOKENS_PER_PROGRAM), triton.cdiv(max_reqs, _REQS_PER_PROGRAM)),)
    _scatter_staged_inputs_kernel[grid](
        staged, input_ids, positions, slot_mapping, seq_lens, query_start_loc, block_table, block_table.stride(0),
        max_tokens, max_reqs, block_table.shape[1], input_ids if tree_bits is None else tree_bits,
        PAD_SLOT=PAD_SLOT_ID, TOKENS=_TOKENS_PER_PROGRAM, REQS=_REQS_PER_PROGRAM, COLUMNS=_TABLE_COLUMNS,
        HEADER=HEADER_SLOTS, TREE=tree_bits is not None,
    )
