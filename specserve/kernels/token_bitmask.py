"""A grammar's token bitmask applied to logits in place, in one Triton launch (sample/token_bitmask.py calls it).

The bitmask is xgrammar's layout: int32 [rows, ceil(vocab / 32)], bit t % 32 of word t // 32 set where token t
is allowed. The launch takes no per-step value: the rows come from the logits' shape and the switch from a
device tensor, so a CUDA graph holds it and every replay reads that step's switch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, stride_logits, bitmask_ptr, stride_bitmask, n_cols, enabled_ptr,
                                HAS_SWITCH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < n_cols
    if HAS_SWITCH:
        # Broadcast to the block before the comparison: the interpreter takes a vector mask only.
        live = live & ((tl.zeros([BLOCK], tl.int64) + tl.load(enabled_ptr)) != 0)
    words = tl.load(bitmask_ptr + row * stride_bitmask + cols // 32, mask=live, other=-1)
    refused = ((words >> (cols % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_logits + cols, float("-inf"), mask=live & refused)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, enabled: torch.Tensor | None) -> None:
    rows, cols = logits.shape
    if rows:
        _apply_token_bitmask_kernel[(rows, triton.cdiv(cols, _BLOCK))](
            logits, logits.stride(0), bitmask, bitmask.stride(0), cols, enabled if enabled is not None else bitmask,
            HAS_SWITCH=enabled is not None, BLOCK=_BLOCK)
