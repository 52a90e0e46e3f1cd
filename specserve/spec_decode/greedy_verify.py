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
        use_triton = target.is_cuda
    if use_triton:
        from specserve.kernels.greedy_verify import greedy_verify_triton

        greedy_verify_triton(target, input_ids, index, num_drafts, out_rows, accepted_out, tokens_out, uniform,
                             forced_accept_prob)
    else:
        greedy_verify_torch(target, input_ids, index, num_drafts, out_rows, accepted_out, tokens_out, uniform,
                            forced_accept_prob)


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
