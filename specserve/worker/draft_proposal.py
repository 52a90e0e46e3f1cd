"""The glue between the runner's step and a device drafter: the drafter's inputs, gathered on the device
from the step just run, then its proposal of the next drafts (spec_decode/speculator.py, DraftInput).

The accepted counts exist only on the device, so each drafting request's last accepted token, its
position and its block table are gathered there by one kernel (spec_decode/draft_inputs.py; for trees of
drafts, then along the accepted paths), and no host sync is needed before the drafter runs
(docs/design.md, 'Draft inputs'). A step with a grammar request is the exception: its drafts are masked
with the grammar states along their paths, which the host builds from the tokens it reads back
(Drafting.masked).
"""
from __future__ import annotations

import torch

from specserve.attention.metadata import AttentionMetadata
from specserve.distributed.messages import DraftFollow
from specserve.engine.scheduler import SchedulerOutput
from specserve.sample.sampler import SamplingBatch
from specserve.spec_decode.draft_inputs import follow_tree_paths, gather_draft_inputs
from specserve.spec_decode.speculator import DraftInput
from specserve.spec_decode.tree_verify import TreeOutcome
from specserve.structured_output.draft_masks import DraftMasks
from specserve.worker.cudagraph import BatchDescriptor
from specserve.worker.staged_inputs import StagedExtra
from specserve.worker.step_path import Drafting, StepPath, WholeStep


def _max_base_position(sched: SchedulerOutput, sampling: list[int]) -> int:
    """The largest position a drafting request drafts from: an upper bound of the device's, known on the host."""
    return max(sched.scheduled[i].start + sched.scheduled[i].num_new_tokens - 1 for i in sampling)


class DraftProposal:
    """ModelRunner's drafting glue (mixed into ModelRunner, whose state it uses)."""

    def _gather_draft_inputs(self, desc: BatchDescriptor, max_rows: int) -> None:
        """The drafter's inputs from this step's outputs (draft_inputs.py), padded to desc."""
        b = self.buffers
        gather_draft_inputs(b.staged, self.outputs.accepted, self.outputs.tokens, b.input_ids, b.positions,
                            b.block_table, desc.num_tokens, desc.num_reqs, self.speculator.next_ids,
                            self.draft_last_indices, self.draft_last_tokens, self.draft_base_positions,
                            self.draft_block_table, max_rows)

    def _draft_follow(self, sched: SchedulerOutput, sampling: list[int], path: StepPath) -> DraftFollow | None:
        """What the other ranks of a sharded drafter need to draft beside this one in a step of parts (the whole
        step's graph holds its drafting); None where they draft nothing."""
        if not self.config.drafter_sharded or not path.drafts_on_device or path.whole is not WholeStep.NONE:
            return None
        # A greedy request's drafts are the argmax (a tree's: its top guesses), a sampling request's are drawn.
        argmax = not path.drafting.masked and all(sched.scheduled[i].request.params.greedy for i in sampling)
        return DraftFollow(len(sampling), _max_base_position(sched, sampling), not argmax)

    def _propose(self, sched: SchedulerOutput, sampling: list[int], desc: BatchDescriptor, target_out: tuple,
                 metadata: AttentionMetadata, drafting: Drafting, follow: DraftFollow | None) -> None:
        """Draft the next tokens of every request that produced tokens this step, on the device: each
        request's last accepted token and its position follow from the accepted counts just written. follow:
        what the other ranks of a sharded drafter were sent, to draft beside this rank (follow_proposal)."""
        spec, b = self.speculator, self.buffers
        n = len(sampling)
        scheduled = [sched.scheduled[i] for i in sampling]
        self._gather_draft_inputs(desc, max_rows=len(sched.scheduled))
        moves = self._follow_tree_paths(self._tree_step)
        requests = [s.request for s in scheduled]
        masks = None
        if drafting.masked:
            # The step's new tokens, read back while the drafter's prefill runs (docs/design.md,
            # 'Structured output').
            step_tokens = self.outputs.packed.index_select(0, b.staged_extra(StagedExtra.SAMPLING_ROWS))
            masks = DraftMasks([r.grammar for r in requests], step_tokens,
                               self.tree.parents if self.tree is not None else None, self.buffers.draft_bitmask)
        inp = self._draft_input(n, desc, target_out, metadata, drafting, _max_base_position(sched, sampling),
                                SamplingBatch.build(requests, self.device), masks, moves,
                                follow is not None and follow.shared_picks)
        try:
            drafts = spec.propose(inp)
        finally:
            if masks is not None:
                masks.close()  # every matcher back where it was before the drafts, however propose ended
        if masks is not None:
            self._carried_masks = masks.carried([r.request_id for r in requests])
        if sampling[-1] == n - 1:  # rows 0..n-1: every scheduled request drafts
            self.outputs.drafts[:n].copy_(drafts)
        else:
            self.outputs.drafts.index_copy_(0, b.staged_extra(StagedExtra.SAMPLING_ROWS), drafts)

    def _prefill_drafter(self, desc: BatchDescriptor, target_out: tuple, metadata: AttentionMetadata,
                         num_scheduled: int) -> None:
        """A step that drafts nothing but ran prompt tokens (Drafting.PREFILL_ONLY): the drafter's prefill over the
        step's tokens, its inputs gathered from the step's outputs, so that the drafter's cache holds the prompt
        when the request drafts later. Every rank of a sharded drafter runs it (distributed/worker_process.py),
        after rank 0 shared the step's outputs, from which the inputs are gathered."""
        if self.config.drafter_sharded:
            self.outputs.share_from_rank0(num_scheduled)
        self._gather_draft_inputs(desc, max_rows=num_scheduled)
        self.speculator.prefill(desc, target_out, metadata)

    def follow_proposal(self, follow: DraftFollow, num_scheduled: int, desc: BatchDescriptor, target_out: tuple,
                        metadata: AttentionMetadata, drafting: Drafting, tree_step: TreeOutcome | None) -> None:
        """A rank > 0's part of rank 0's _propose with a sharded drafter (docs/design.md, 'Tensor parallelism'):
        the same inputs, gathered from the outputs rank 0 shared before drafting (and along the paths of the
        trees verified, tree_step: retrace_trees), and the same passes over the rank's shard of the head, so the
        collectives match; the drafts are rank 0's (the same argmax or top guesses, or rank 0's broadcast
        picks)."""
        self._gather_draft_inputs(desc, max_rows=num_scheduled)
        moves = self._follow_tree_paths(tree_step)
        inp = self._draft_input(follow.num_reqs, desc, target_out, metadata, drafting, follow.max_base_position,
                                None, None, moves, follow.shared_picks)
        drafts = self.speculator.propose(inp)
        self.outputs.drafts.index_copy_(0, self.buffers.staged_extra(StagedExtra.SAMPLING_ROWS), drafts)

    def _follow_tree_paths(self, outcome: TreeOutcome | None,
                           slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """After _gather_draft_inputs, the inputs of the requests that verified trees (outcome; None: no tree
        was verified), along their accepted paths (follow_tree_paths; slots: their drafting indices, by default
        as the step staged them). Returns the trees' KV moves, which the drafter makes in its own cache after its
        prefill."""
        if outcome is None:
            return None
        b = self.buffers
        follow_tree_paths(outcome.path_tokens, outcome.accepted, outcome.tokens,
                          b.staged_extra(StagedExtra.VERIFY_SLOTS) if slots is None else slots, b.positions,
                          self.speculator.next_ids, self.draft_last_indices, self.draft_base_positions)
        return outcome.moves

    def _draft_input(self, n: int, desc: BatchDescriptor, target_out: tuple, metadata: AttentionMetadata,
                     drafting: Drafting, max_base_position: int, sampling: SamplingBatch | None,
                     masks: DraftMasks | None, moves, shared_picks: bool) -> DraftInput:
        return DraftInput(
            target_out=target_out,
            descriptor=desc,
            metadata=metadata,
            num_reqs=n,
            last_token_indices=self.draft_last_indices[:n],
            base_positions=self.draft_base_positions,
            max_base_position=max_base_position,
            last_tokens=self.draft_last_tokens[:n],
            block_table=self.draft_block_table,
            rows=self.buffers.staged_extra(StagedExtra.DRAFT_ROWS),
            sampling=sampling,
            drafting=drafting,
            kv_moves=moves,
            masks=masks,
            shared_picks=shared_picks,
        )
