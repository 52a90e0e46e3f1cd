"""A request with SamplingParams.n > 1 as n sequences: what the front end sends the core for each.

The engine core knows nothing of n: each sequence is a core request of its own, with n = 1, the same
prompt and, with a seed, the seed + its index. The front end (output_processor.py) gathers their outputs
back into one RequestOutput whose CompletionOutputs carry the sequences' indices, and aborts every
sequence when the request is aborted. How the sequences share the prompt's KV blocks: docs/design.md,
'Several sequences per request'.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from specserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class SequenceRequest:
    """One sequence of a request, as the core runs it."""

    core_request_id: str  # the request's own id when n = 1
    index: int  # its CompletionOutput.index
    params: SamplingParams  # n = 1; a seed moved by the index


def sequence_requests(request_id: str, params: SamplingParams) -> list[SequenceRequest]:
    """The core requests of a request, in index order: the order the core queues, and so admits, them in."""
    if params.n == 1:
        return [SequenceRequest(request_id, 0, params)]
    return [SequenceRequest(f"{request_id}#{i}", i,
                            replace(params, n=1, seed=None if params.seed is None else params.seed + i))
            for i in range(params.n)]
