"""The Triton kernel of spec_decode/greedy_verify.py: verification of greedy requests in one launch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _greedy_verify_kernel(
    target_ptr, input_ids_ptr, index_ptr, num_drafts_ptr, out_rows_ptr, uniform_ptr,
    accepted_ptr, accepted_stride, tokens_ptr, tokens_stride, forced_accept_prob,
    K1: tl.constexpr, FORCED: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    num = tl.load(num_drafts_ptr + i)
    row = tl.load(out_rows_ptr + i)
    target = tl.load(target_ptr + i * K1 + j, mask=j < K1, other=0)
    has_draft = j < num
    at = tl.load(index_ptr + i * K1 + j + 1, mask=has_draft, other=0)
    draft = tl.load(input_ids_ptr + at, mask=has_draft, other=-1)
    if FORCED:
        ok = tl.load(uniform_ptr + i * (K1 - 1) + j, mask=has_draft, other=1.0) < forced_accept_prob
    else:
        ok = draft == target
    # The first position that fails (a mismatch, or past the drafts) is the number accepted.
    accepted = tl.min(tl.where(has_draft & ok, BLOCK, j), axis=0)
    emitted = tl.sum(tl.where(j == accepted, target, 0), axis=0)
    out = tl.where(j < accepted, draft, tl.where(j == accepted, emitted, -1))
    tl.store(tokens_ptr + row * tokens_stride + j, out, mask=j < K1)
    tl.store(accepted_ptr + row * accepted_stride, accepted.to(tl.int64))


def greedy_verify_triton(target: torch.Tensor, input_ids: torch.Tensor, index: torch.Tensor, num_drafts: torch.Tensor,
                         out_rows: torch.Tensor, accepted_out: torch.Tensor, tokens_out: torch.Tensor,
                         uniform: torch.Tensor | None, forced_accept_prob: float | None) -> None:
    """greedy_verify (spec_decode/greedy_verify.py) as one launch."""
    n, k1 = target.shape
    assert target.is_contiguous() and index.is_contiguous() and tokens_out.stride(1) == 1
    forced = forced_accept_prob is not None
    _greedy_verify_kernel[(n,)](
        target, input_ids, index, num_drafts, out_rows, uniform if forced else target,
        accepted_out, accepted_out.stride(0), tokens_out, tokens_out.stride(0), float(forced_accept_prob or 0.0),
        K1=k1, FORCED=forced, BLOCK=triton.next_power_of_2(k1),
    )
