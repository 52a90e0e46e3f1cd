"""The Triton kernel of spec_decode/tree_drafting.py: the inputs of the pass over one depth of a tree of drafts,
in one launch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.metadata import PAD_SLOT_ID
from specserve.spec_decode.tree_drafting import PassInputs
from specserve.spec_decode.tree_verify import TreeTables


# n is a graph's padded batch size: at 1 Triton would make it a constant, and n * m a Python int.
@triton.jit(do_not_specialize=["n"])
def _tree_pass_kernel(
    base_positions_ptr, block_table_ptr, block_table_stride, num_reqs_ptr, ancestor_bits_ptr, level_parents_ptr,
    positions_ptr, slots_ptr, seq_lens_ptr, query_start_loc_ptr, tree_bits_ptr, parent_rows_ptr,
    n, block_size, max_position, max_slot_position,
    DEPTH: tl.constexpr, START: tl.constexpr, STOP: tl.constexpr, PARENTS: tl.constexpr, PADDED: tl.constexpr,
    PAD_SLOT: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    m: tl.constexpr = STOP - START
    j = tl.arange(0, BLOCK)
    live = j < m
    base = tl.load(base_positions_ptr + r)
    real = r >= 0
    if PADDED:
        real = r < tl.load(num_reqs_ptr)
    slot_pos = tl.minimum(base + START + j, max_slot_position)
    block = tl.load(block_table_ptr + r * block_table_stride + slot_pos // block_size, mask=live, other=0)
    slot = tl.where(real, block.to(tl.int64) * block_size + slot_pos % block_size, PAD_SLOT)
    out = r * m + j
    tl.store(positions_ptr + out, tl.zeros_like(slot_pos) + tl.minimum(base + DEPTH, max_position - 1), mask=live)
    tl.store(slots_ptr + out, slot, mask=live)
    tl.store(tree_bits_ptr + out, tl.load(ancestor_bits_ptr + START + j, mask=live, other=0) >> 1, mask=live)
    parent = tl.load(level_parents_ptr + START + j, mask=live, other=0)
    tl.store(parent_rows_ptr + out, r.to(tl.int64) * PARENTS + parent, mask=live)
    tl.store(seq_lens_ptr + r, tl.where(real, base + STOP, 0).to(tl.int32))
    tl.store(query_start_loc_ptr + r, (r * m).to(tl.int32))
    if r == n - 1:
        tl.store(query_start_loc_ptr + n, (n * m).to(tl.int32))


def tree_pass_inputs_triton(tables: TreeTables, d: int, n: int, base_positions: torch.Tensor,
                            block_table: torch.Tensor, block_size: int, max_position: int,
                            num_reqs: torch.Tensor | None) -> PassInputs:
    """tree_pass_metadata's inputs (spec_decode/tree_drafting.py) as one launch."""
    level = tables.tree.level(d)
    m, dev = len(level), base_positions.device
    assert block_table.stride(1) == 1
    long, int32 = dict(dtype=torch.int64, device=dev), dict(dtype=torch.int32, device=dev)
    inputs = PassInputs(torch.empty(n * m, **long), torch.empty(n * m, **long), torch.empty(n, **int32),
                        torch.empty(n + 1, **int32), torch.empty(n * m, **long), torch.empty(n * m, **long))
    _tree_pass_kernel[(n,)](
        base_positions, block_table, block_table.stride(0), base_positions if num_reqs is None else num_reqs,
        tables.ancestor_bits, tables.level_parents, inputs.positions, inputs.slot_mapping, inputs.seq_lens,
        inputs.query_start_loc, inputs.tree_bits, inputs.parent_rows, n, block_size, max_position,
        block_table.shape[1] * block_size - 1, DEPTH=d, START=level.start, STOP=level.stop,
        PARENTS=len(tables.tree.level(d - 1)), PADDED=num_reqs is not None, PAD_SLOT=PAD_SLOT_ID,
        BLOCK=triton.next_power_of_2(m))
    return inputs
