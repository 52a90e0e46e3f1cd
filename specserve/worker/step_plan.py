"""The host's plan of one step: which batch rows sample, which verify drafts, and the index arrays the
device reads for them, staged with the step's inputs."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specserve.engine.scheduler import SchedulerOutput
from specserve.spec_decode.draft_inputs import DraftRequest, draft_request_rows
from specserve.spec_decode.tree import DraftTree
from specserve.worker.inflight_inputs import InflightRequest, inflight_rows
from specserve.worker.staged_inputs import StagedExtra


@dataclass
class StepPlan:
    """The host's index lists for sampling, verification and drafting, staged with the step's inputs."""

    sample_rows: list[int]  # batch rows sampled without drafts
    verify_rows: list[int]  # batch rows whose drafts are verified
    extras: dict[StagedExtra, np.ndarray]

    @classmethod
    def build(cls, sched: SchedulerOutput, sampling: list[int], draft_requests: list[DraftRequest],
              inflight: list[InflightRequest], drafter_on_device: bool, proposes_on_device: bool, row_of,
              trees: bool = False, prefills_drafter: bool = False) -> StepPlan:
        """drafter_on_device: the verified drafts come from a device drafter, which kept their probabilities;
        proposes_on_device: it proposes this step's drafts; prefills_drafter: it only runs the drafter's prefill
        (Drafting.PREFILL_ONLY), whose inputs are gathered per scheduled request too."""
        extras: dict[StagedExtra, np.ndarray] = {}
        if inflight:
            extras[StagedExtra.INFLIGHT] = inflight_rows(inflight)
        # A sampling request's last token is its row's end; its drafts are the tokens before it.
        ends = {i: r.first + r.count for i, r in enumerate(draft_requests)}
        sample_rows = [i for i in sampling if not sched.scheduled[i].spec_token_ids]
        verify_rows = [i for i in sampling if sched.scheduled[i].spec_token_ids]
        if sample_rows:
            extras[StagedExtra.SAMPLE_INDEX] = np.array([ends[i] - 1 for i in sample_rows], dtype=np.int64)
            extras[StagedExtra.SAMPLE_ROWS] = np.array(sample_rows, dtype=np.int64)
        if verify_rows:
            num = np.array([len(sched.scheduled[i].spec_token_ids) for i in verify_rows], dtype=np.int64)
            last = np.array([ends[i] - 1 for i in verify_rows], dtype=np.int64)
            # Row j of request i is the target's prediction after its j-th draft (clamped for padding);
            # its draft j sits at token end - n + j.
            j = np.arange(int(num.max()) + 1)
            extras[StagedExtra.VERIFY_INDEX] = last[:, None] - num[:, None] + np.minimum(j[None, :], num[:, None])
            extras[StagedExtra.VERIFY_DRAFTS] = num
            extras[StagedExtra.VERIFY_ROWS] = np.array(verify_rows, dtype=np.int64)
            if drafter_on_device:
                # Where the drafter kept each verified request's draft probabilities (sampled verification).
                extras[StagedExtra.VERIFY_DRAFT_ROWS] = np.array(
                    [row_of(sched.scheduled[i].request.request_id) for i in verify_rows], dtype=np.int64)
        if proposes_on_device and sampling:
            extras[StagedExtra.DRAFT_REQUESTS] = draft_request_rows(draft_requests)
            # Each drafting request's row of the drafter's per-request state (row_of: request id -> row).
            extras[StagedExtra.DRAFT_ROWS] = np.array(
                [row_of(sched.scheduled[i].request.request_id) for i in sampling], dtype=np.int64)
            extras[StagedExtra.SAMPLING_ROWS] = np.array(sampling, dtype=np.int64)
            if trees:
                # Each verified request's drafting index (draft_inputs.follow_tree_paths).
                drafting = {row: i for i, row in enumerate(sampling)}
                extras[StagedExtra.VERIFY_SLOTS] = np.array([drafting[i] for i in verify_rows], dtype=np.int64)
        elif prefills_drafter:
            extras[StagedExtra.DRAFT_REQUESTS] = draft_request_rows(draft_requests)
        return cls(sample_rows, verify_rows, extras)


@dataclass(frozen=True)
class TreeLayout:
    """Where a step's trees of drafts sit: each tree index's position shift (index - depth) and tree bits
    (DraftTree.ancestor_bits), staged per token with the step's inputs (InputBuffers.prepare)."""

    shift: np.ndarray  # [N + 1] int64
    bits: np.ndarray  # [N + 1] int64

    @classmethod
    def of(cls, tree: DraftTree) -> TreeLayout:
        return cls(np.arange(tree.num_nodes + 1) - np.array(tree.depths), np.array(tree.ancestor_bits))

    def stage(self, sched: SchedulerOutput, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(position shift, tree bits) of each of the step's tokens: a verifying request's last 1 + n tokens are
        the root and the first n drafts of its tree; every other token has shift 0 and bits -1."""
        shift = np.zeros(num_tokens, dtype=np.int64)
        bits = np.full(num_tokens, -1, dtype=np.int64)
        end = 0
        for s in sched.scheduled:
            end += s.num_new_tokens
            n = len(s.spec_token_ids) + 1
            if s.samples and n > 1:
                shift[end - n:end] = self.shift[:n]
                bits[end - n:end] = self.bits[:n]
        return shift, bits
