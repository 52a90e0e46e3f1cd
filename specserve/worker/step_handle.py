"""A step launched on the device whose results the host has not read yet."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.engine.scheduler import SchedulerOutput
from specserve.outputs import Logprob
from specserve.sample.sampler import SamplerOutput
from specserve.worker.step_path import StepPath


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """Start copying t to the host without waiting (pinned memory on CUDA, so the copy is asynchronous)."""
    if t is None or not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class PendingLogprobs:
    """Logprobs of one sampler call, on their way to the host. Row r * per_request + j of the result is
    request r's j-th candidate token (per_request = k + 1 when verifying k drafts, of which the
    accepted ones and one more were emitted)."""

    batch_rows: list[int]
    per_request: int
    result: SamplerOutput

    @classmethod
    def start(cls, result: SamplerOutput, batch_rows: list[int], per_request: int) -> PendingLogprobs:
        fields = ("token_ids", "sampled_logprobs", "sampled_ranks", "top_ids", "top_logprobs")
        host = SamplerOutput(**{f: _to_host(getattr(result, f)) for f in fields})
        return cls(batch_rows, per_request, host)

    def collect(self, table: list[list[int]], sched: SchedulerOutput, logprobs: dict[str, list]) -> None:
        """Append each emitted token's logprob entry; table[i][0] is batch row i's accepted count."""
        r = self.result
        tokens, lp, ranks = r.token_ids.tolist(), r.sampled_logprobs.tolist(), r.sampled_ranks.tolist()
        top_ids = r.top_ids.tolist() if r.top_ids is not None else None
        top_lp = r.top_logprobs.tolist() if r.top_logprobs is not None else None
        for k, i in enumerate(self.batch_rows):
            req = sched.scheduled[i].request
            n = req.params.logprobs
            if n is None:
                continue
            emitted = table[i][0] + 1 if self.per_request > 1 else 1
            for row in range(k * self.per_request, k * self.per_request + emitted):
                entry = {tokens[row]: Logprob(lp[row], ranks[row])}
                for j in range(n):
                    entry.setdefault(top_ids[row][j], Logprob(top_lp[row][j], j + 1))
                logprobs.setdefault(req.request_id, []).append(entry)


@dataclass
class StepHandle:
    sched: SchedulerOutput
    # Rows of sched.scheduled that yield tokens this step.
    sampling: list[int]
    path: StepPath
    # The step's outputs on the host once `event` completes (StepOutputs columns).
    host: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    logprobs: list[PendingLogprobs] = field(default_factory=list)
