"""Verification of greedy requests in one kernel, writing the step's outputs in place.

For a batch whose requests are all greedy, rejection sampling reduces to
comparing each draft with the target's argmax: request i accepts drafts up to
the first mismatch and then emits the argmax at that position. The general
rejection sampler does this in some thirty tensor ops, each a launch costing
the host more than the GPU work; here it is one launch that reads the drafts
where the step's input ids hold them and writes the accepted count and the
emitted tokens straight into the runner's StepOutputs rows. It gives what
`rejection_sample` gives for greedy rows, also under forced acceptance
(benchmarks: draft j passes iff uniform[i, j] < p), and tests hold it to that.

Per verified request i (n_i drafts, k = max n_i):
    index[i, j]    token index whose target prediction is row j (draft j sits at index[i, j + 1])
    target[i, j]   the target's argmax there, j <= k
    out_rows[i]    the request's row in StepOutputs
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional on CPU installs; the torch path serves there.
    triton = None


def greedy_verify_torch(target: torch.Tensor, input_ids: torch.Tensor, index: torch.Tensor,
                        num_drafts: torch.Tensor, out_rows: torch.Tensor, accepted_out: torch.Tensor,
                        tokens_out: torch.Tensor, uniform: torch.Tensor | None = None,
                        forced_accept_prob: float | None = None) -> None:
    """The verification in torch ops (the CPU path and the kernel's reference)."""
    n, k1 = target.shape
    k = k1 - 1
    slots = torch.arange(k, device=target.device)
    valid = slots < num_drafts[:, None]
    drafts = torch.where(valid, input_ids[index[:, 1:]], -1)
    ok = (uniform < forced_accept_prob) if forced_accept_prob is not None else drafts == target[:, :k]
    accepted = (valid & ok).long().cumprod(dim=1).sum(dim=1)
    cols = torch.arange(k1, device=target.device)[None, :]
    emitted = target.gather(1, accepted[:, None])
    padded = torch.nn.functional.pad(drafts, (0, 1), value=-1)
    tokens = torch.where(cols < accepted[:, None], padded, torch.where(cols == accepted[:, None], emitted, -1))
    accepted_out.index_copy_(0, out_rows, accepted)
    tokens_out[:, :k1].index_copy_(0, out_rows, tokens)


if triton is not None:

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


def greedy_verify(target: torch.Tensor, input_ids: torch.Tensor, index: torch.Tensor, num_drafts: torch.Tensor,
                  out_rows: torch.Tensor, accepted_out: torch.Tensor, tokens_out: torch.Tensor,
                  uniform: torch.Tensor | None = None, forced_accept_prob: float | None = None,
                  *, use_triton: bool | None = None) -> None:
    """Verify n greedy requests (see the module docstring) and write accepted_out[out_rows[i]] and
    tokens_out[out_rows[i], :k + 1] (accepted drafts, the argmax at the first failure, then -1).

    target [n, k + 1] int64; index [n, k + 1] int64; num_drafts, out_rows [n] int64; uniform [n, k]
    float32 with forced_accept_prob (benchmarks only). One Triton launch on CUDA, torch ops elsewhere
    (use_triton forces either; tests run the kernel under TRITON_INTERPRET=1).
    """
    if (uniform is None) != (forced_accept_prob is None):
        raise ValueError("uniform samples and forced_accept_prob go together")
    if use_triton is None:
        use_triton = triton is not None and target.is_cuda
    if not use_triton:
        greedy_verify_torch(target, input_ids, index, num_drafts, out_rows, accepted_out, tokens_out, uniform,
                            forced_accept_prob)
        return
    n, k1 = target.shape
    assert target.is_contiguous() and index.is_contiguous() and tokens_out.stride(1) == 1
    forced = forced_accept_prob is not None
    _greedy_verify_kernel[(n,)](
        target, input_ids, index, num_drafts, out_rows, uniform if forced else target,
        accepted_out, accepted_out.stride(0), tokens_out, tokens_out.stride(0), float(forced_accept_prob or 0.0),
        K1=k1, FORCED=forced, BLOCK=triton.next_power_of_2(k1),
    )


@dataclass
class UniformVerifyInputs:
    """greedy_verify's index inputs for a uniform batch, where every request verifies k drafts: request i's
    tokens are i * (k + 1) .. i * (k + 1) + k and its outputs are row i. They are the same every step, so a
    CUDA graph of the verification reads them from here, written once; with forced acceptance the graph
    also reads `uniform`, which the runner refills before each replay."""

    index: torch.Tensor  # [max_num_reqs, k + 1] int64: i * (k + 1) + j
    num_drafts: torch.Tensor  # [max_num_reqs] int64: k
    rows: torch.Tensor  # [max_num_reqs] int64: i
    uniform: torch.Tensor | None  # [max_num_reqs, k] float32, with forced acceptance only

    @classmethod
    def allocate(cls, max_num_reqs: int, k: int, device: torch.device, forced: bool) -> UniformVerifyInputs:
        rows = torch.arange(max_num_reqs, dtype=torch.int64, device=device)
        return cls(index=torch.arange(max_num_reqs * (k + 1), dtype=torch.int64, device=device).view(-1, k + 1),
                   num_drafts=torch.full((max_num_reqs,), k, dtype=torch.int64, device=device), rows=rows,
                   uniform=torch.zeros(max_num_reqs, k, dtype=torch.float32, device=device) if forced else None)
