"""The host's plan of one step: which batch rows sample, which verify drafts, and the index arrays the
device reads for them, staged with the step's inputs."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specserve.engine.scheduler import SchedulerOutput


@dataclass
class StepPlan:
    """The host's index lists for sampling, verification and drafting, staged with the step's inputs."""

    sample_rows: list[int]  # batch rows sampled without drafts
    verify_rows: list[int]  # batch rows whose drafts are verified
    extras: dict[str, np.ndarray]

    @classmethod
    def build(cls, sched: SchedulerOutput, sampling: list[int], draft_requests: list[tuple], inflight: list[tuple],
              drafts_on_device: bool, row_of, trees: bool = False) -> StepPlan:
        extras: dict[str, np.ndarray] = {}
        if inflight:
            extras["inflight"] = np.array(inflight, dtype=np.int64)
        # A sampling request's last token is its row's end; its drafts are the tokens before it.
        ends = {i: first + count for i, (first, count, *_) in enumerate(draft_requests)}
        sample_rows = [i for i in sampling if not sched.scheduled[i].spec_token_ids]
        verify_rows = [i for i in sampling if sched.scheduled[i].spec_token_ids]
        if sample_rows:
            extras["sample_index"] = np.array([ends[i] - 1 for i in sample_rows], dtype=np.int64)
            extras["sample_rows"] = np.array(sample_rows, dtype=np.int64)
        if verify_rows:
            num = np.array([len(sched.scheduled[i].spec_token_ids) for i in verify_rows], dtype=np.int64)
            last = np.array([ends[i] - 1 for i in verify_rows], dtype=np.int64)
            # Row j of request i is the target's prediction after its j-th draft (clamped for padding);
            # its draft j sits at token end - n + j.
            j = np.arange(int(num.max()) + 1)
            extras["verify_index"] = last[:, None] - num[:, None] + np.minimum(j[None, :], num[:, None])
            extras["verify_drafts"] = num
            extras["verify_rows"] = np.array(verify_rows, dtype=np.int64)
            if drafts_on_device:
                # Where the drafter kept each verified request's draft probabilities (sampled verification).
                extras["verify_draft_rows"] = np.array([row_of(sched.scheduled[i].request.request_id)
                                                        for i in verify_rows], dtype=np.int64)
        if drafts_on_device and sampling:
            extras["draft_requests"] = np.array(draft_requests, dtype=np.int64)
            # Each drafting request's row of the drafter's per-request state (row_of: request id -> row).
            extras["draft_rows"] = np.array([row_of(sched.scheduled[i].request.request_id) for i in sampling],
                                            dtype=np.int64)
            extras["sampling_rows"] = np.array(sampling, dtype=np.int64)
            if trees:
                # Each verified request's drafting index (draft_inputs.follow_tree_paths).
                drafting = {row: i for i, row in enumerate(sampling)}
                extras["verify_slots"] = np.array([drafting[i] for i in verify_rows], dtype=np.int64)
        return cls(sample_rows, verify_rows, extras)
