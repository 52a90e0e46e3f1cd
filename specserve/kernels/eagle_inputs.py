"""The Triton kernel of spec_decode/eagle_inputs.py: the inputs of one EAGLE draft decode step, in one launch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.metadata import PAD_SLOT_ID
from specserve.spec_decode.eagle_inputs import DraftStepBuffers, num_reqs_on_device

# Rows handled by one Triton program; a few programs cover any realistic max_num_reqs.
_ROWS_PER_PROGRAM = 128


# step changes every draft step; not specializing on it (Triton treats 1 specially)
# lets all steps share one compiled kernel.
@triton.jit(do_not_specialize=["step"])
def _prepare_draft_step_kernel(
    num_reqs_ptr, base_positions_ptr, block_table_ptr, block_table_stride,
    positions_ptr, seq_lens_ptr, query_start_loc_ptr, slot_mapping_ptr, last_token_indices_ptr,
    step, block_size, max_position, max_num_reqs,
    PAD_SLOT: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    num_reqs = tl.load(num_reqs_ptr)
    is_row = rows < max_num_reqs
    real = is_row & (rows < num_reqs)
    # Loads are masked to real rows: padded rows' base positions and table rows are never read.
    base = tl.load(base_positions_ptr + rows, mask=real, other=0)
    pos = tl.where(real, tl.minimum(base + step, max_position - 1), 0)
    block = tl.load(block_table_ptr + rows * block_table_stride + pos // block_size, mask=real, other=0)
    slot = block.to(tl.int64) * block_size + pos % block_size
    tl.store(positions_ptr + rows, pos, mask=is_row)
    tl.store(seq_lens_ptr + rows, tl.where(real, pos + 1, 0).to(tl.int32), mask=is_row)
    tl.store(slot_mapping_ptr + rows, tl.where(real, slot, PAD_SLOT), mask=is_row)
    tl.store(last_token_indices_ptr + rows, tl.where(real, rows, 0).to(tl.int64), mask=is_row)
    # query_start_loc has max_num_reqs + 1 entries; the grid covers the extra one.
    tl.store(query_start_loc_ptr + rows, tl.minimum(rows, num_reqs).to(tl.int32), mask=rows <= max_num_reqs)


def prepare_draft_step_triton(step: int, num_reqs: int | torch.Tensor, base_positions: torch.Tensor,
                              block_table: torch.Tensor, block_size: int, max_position: int,
                              out: DraftStepBuffers) -> None:
    """prepare_draft_step (spec_decode/eagle_inputs.py) as one launch; capturable in a CUDA graph."""
    assert step >= 1, "draft step 0 is the prefill, which reuses the target's metadata"
    # The kernel indexes base positions and a table row's blocks with unit stride.
    assert base_positions.stride(0) == 1 and block_table.stride(1) == 1
    n = num_reqs_on_device(num_reqs, out)
    m = out.max_num_reqs
    grid = (triton.cdiv(m + 1, _ROWS_PER_PROGRAM),)
    _prepare_draft_step_kernel[grid](
        n, base_positions, block_table, block_table.stride(0),
        out.positions, out.seq_lens, out.query_start_loc, out.slot_mapping, out.last_token_indices,
        step, block_size, max_position, m,
        PAD_SLOT=PAD_SLOT_ID, BLOCK=_ROWS_PER_PROGRAM,
    )
