"""The runner's tokens for a step: sampling the rows without drafts, verifying the rows with drafts.

Each request's row of the step outputs (worker/step_outputs.py) gets its accepted count and its emitted
tokens: greedy sampling and verification (spec_decode/greedy_verify.py), the sampler, rejection sampling
(spec_decode/rejection_sampler.py) or the walk of trees (spec_decode/tree_verify.py), as the step's
StepPath says (worker/step_path.py). What "the target's own tokens" means for each: docs/design.md,
'Exactness'.
"""
from __future__ import annotations

import torch

from specserve.distributed.communication import broadcast_from_rank0
from specserve.engine.scheduler import SchedulerOutput
from specserve.sample.argmax import greedy_argmax
from specserve.sample.logit_bias import apply_logit_bias
from specserve.sample.sampler import SamplerOutput, SamplingBatch, repeated_rows_probs, token_logprobs
from specserve.spec_decode.greedy_verify import greedy_verify
from specserve.spec_decode.rejection_sampler import draw_randomness, rejection_sample
from specserve.spec_decode.sampled_tree import sampled_tree_targets
from specserve.spec_decode.tree_verify import TreeOutcome, move_kv, retrace_tree, verify_tree
from specserve.structured_output.step_masks import StepMasks
from specserve.worker.cudagraph import BatchDescriptor
from specserve.worker.staged_inputs import StagedExtra
from specserve.worker.step_handle import PendingLogprobs, StepHandle
from specserve.worker.step_path import Sampling, Verification


class SampleAndVerify:
    """ModelRunner's sampling and verification (mixed into ModelRunner, whose state they use)."""

    def _forced_draws(self, desc: BatchDescriptor, n: int) -> None:
        """Under forced acceptance, the uniform draws a verification graph reads, from the generator the eager
        verification draws them from."""
        if self.forced_acceptance_prob is not None and desc.query_len > 1:
            torch.rand(n, desc.query_len - 1, generator=self.sampler.default_generator,
                       out=self.uniform_verify.uniform[:n])

    def _verified_tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The verifying requests' staged (token indices [n, max drafts + 1], drafts, batch rows)."""
        b = self.buffers
        return (b.staged_extra(StagedExtra.VERIFY_INDEX), b.staged_extra(StagedExtra.VERIFY_DRAFTS),
                b.staged_extra(StagedExtra.VERIFY_ROWS))

    def _sample(self, hidden, sched: SchedulerOutput, batch_rows: list[int], handle: StepHandle,
                desc: BatchDescriptor, how: Sampling, masks: StepMasks | None) -> None:
        """The token of each request that samples without drafts. Only the sampler applies penalties,
        min_tokens and logit_bias; every path applies the grammar masks."""
        if how is Sampling.GREEDY_GRAPH:
            # The graph applies the masks StepMasks put in the bitmask buffer, rows as the batch's.
            self.greedy_graphs.run(desc, self._greedy_outputs, None)
            return
        h = hidden.index_select(0, self.buffers.staged_extra(StagedExtra.SAMPLE_INDEX))
        if how is Sampling.ARGMAX:
            result = SamplerOutput(self.model.greedy_tokens(h, mask=masks.sample if masks else None))
        else:
            reqs = [sched.scheduled[i].request for i in batch_rows]
            batch = SamplingBatch.build(reqs, self.device)
            logits = self.model.compute_logits(h)
            if masks is not None:
                StepMasks.apply(logits, masks.sample)
            apply_logit_bias(logits, reqs)
            result = self.sampler(logits, batch)
        where = self.buffers.staged_extra(StagedExtra.SAMPLE_ROWS)
        self.outputs.accepted.index_fill_(0, where, 0)
        self.outputs.tokens[:, 0].index_copy_(0, where, result.token_ids)
        if result.sampled_logprobs is not None:
            handle.logprobs.append(PendingLogprobs.start(result, batch_rows, per_request=1))

    def _verify(self, hidden, sched: SchedulerOutput, batch_rows: list[int], handle: StepHandle,
                desc: BatchDescriptor, how: Verification, masks: StepMasks | None) -> None:
        """Verify each request's chain of drafts against the target's argmax (greedy) or its logits (rejection
        sampling) at the verified positions. A request with a grammar has its logits at each position masked
        with the grammar's state after the drafts before it (StepMasks), so a draft the grammar refuses has
        probability 0 and is rejected, and the token taken there is one the grammar allows. The drafts are read from the step's input ids on the device,
        where the host or the previous step (asynchronous scheduling) put them."""
        forced = self.forced_acceptance_prob
        if how is Verification.GREEDY_GRAPH:
            self._forced_draws(desc, len(batch_rows))
            self.greedy_graphs.run(desc, self._greedy_outputs, None)
            return
        b = self.buffers
        index, num, where = self._verified_tokens()
        n, k = index.shape[0], index.shape[1] - 1
        verified = hidden.index_select(0, index.view(-1))
        if how is Verification.GREEDY:
            target = self.model.greedy_tokens(verified, mask=masks.verify if masks else None).view(n, k + 1)
            uniform = None if forced is None else torch.rand(n, k, device=self.device,
                                                             generator=self.sampler.default_generator)
            greedy_verify(target, b.input_ids, index, num, where, self.outputs.accepted, self.outputs.tokens,
                          uniform, forced)
            return
        reqs = [sched.scheduled[i].request for i in batch_rows]
        batch = SamplingBatch.build(reqs, self.device)
        logits = self.model.compute_logits(verified).view(n, k + 1, -1)
        if masks is not None:
            StepMasks.apply(logits.view(n * (k + 1), -1), masks.verify)
        apply_logit_bias(logits.view(n * (k + 1), -1), reqs, k + 1)
        if batch.all_greedy:
            target_probs = logits
        else:
            target_probs = repeated_rows_probs(logits.flatten(0, 1), batch, k + 1).view_as(logits)
        slots = torch.arange(k, device=self.device)
        drafts = torch.where(slots < num[:, None], b.input_ids[index[:, 1:]], -1)
        draft_probs = None
        if self.speculator.draft_probs is not None and not batch.all_greedy:
            draft_probs = self.speculator.draft_probs[b.staged_extra(StagedExtra.VERIFY_DRAFT_ROWS), :k]
        if batch.all_greedy and forced is None:
            # Greedy rows read no randomness: skip drawing [N, V] exponentials (an expanded view of one
            # value costs no memory).
            uniform = torch.zeros(n, k, device=self.device)
            noise = torch.ones(1, 1, device=self.device).expand(n, logits.shape[-1])
        else:
            uniform, noise = draw_randomness(n, k, logits.shape[-1], batch.generators, self.device,
                                             self.sampler.default_generator)
        tokens, accepted = rejection_sample(drafts, num, draft_probs, target_probs, batch.greedy,
                                            greedy_argmax(logits.flatten(0, 1)).view(n, k + 1), uniform, noise, forced)
        self.outputs.accepted.index_copy_(0, where, accepted)
        self.outputs.tokens[:, :k + 1].index_copy_(0, where, tokens)
        if batch.max_logprobs is not None:
            raw = logits.flatten(0, 1).log_softmax(dim=-1)
            result = token_logprobs(raw, tokens.flatten().clamp(min=0), batch.max_logprobs)
            handle.logprobs.append(PendingLogprobs.start(result, batch_rows, per_request=k + 1))

    def _verify_tree(self, hidden, sched: SchedulerOutput, batch_rows: list[int], handle: StepHandle,
                     how: Verification, masks: StepMasks | None, broadcast_moves: bool) -> None:
        """Verify each request's tree of drafts (tree_verify.py): a greedy request's walk from the root on the
        target's argmax at every node, a sampling request's by recursive rejection sampling of the children drawn
        for it (sampled_tree.py); then move the accepted nodes' keys and values to their
        positions' slots, and with broadcast_moves send the moves to the other ranks, which move their shards
        of the same slots (distributed/step_following.py says when). Keeps the accepted paths and the moves for
        the drafter (self._tree_step). A request with a grammar has its logits at each node masked with the
        grammar's state along the node's path (StepMasks), so the target's token there is one the grammar
        allows, and a node the grammar refuses never carries it."""
        b, tables = self.buffers, self.tree_tables
        index, num, where = self._verified_tokens()
        n, width = index.shape[0], index.shape[1]
        verified = hidden.index_select(0, index.view(-1))
        batch = None
        if how is Verification.TREE_ARGMAX:
            target = self.model.greedy_tokens(verified, mask=masks.verify if masks else None).view(n, width)
        else:
            reqs = [sched.scheduled[i].request for i in batch_rows]
            batch = SamplingBatch.build(reqs, self.device)
            logits = self.model.compute_logits(verified)
            if masks is not None:
                StepMasks.apply(logits, masks.verify)
            apply_logit_bias(logits, reqs, width)
            target = greedy_argmax(logits).view(n, width)
            if not batch.all_greedy:
                target = self._sampled_tree_targets(repeated_rows_probs(logits, batch, width).view(n, width, -1),
                                                    target, index, num, batch.greedy, batch.generators,
                                                    b.staged_extra(StagedExtra.VERIFY_DRAFT_ROWS))
        outcome = verify_tree(target, b.input_ids, index, num, tables, b.slot_mapping, self.kv.spare_slot,
                              where, self.outputs.accepted, self.outputs.tokens)
        move_kv(self.kv.stack, *outcome.moves)
        if broadcast_moves:
            broadcast_from_rank0(torch.stack(outcome.moves))
        self._tree_step = outcome
        if batch is not None and batch.max_logprobs is not None:
            # The logits at each path node, among those of every node (a node's token index is unique in
            # its request's row of index; padding repeats the last, whose logits are the same).
            path_tokens = outcome.path_tokens
            column = (index[:, None, :] == path_tokens[:, :, None]).int().argmax(dim=-1)
            raw = logits.view(n, width, -1).gather(1, column[..., None].expand(-1, -1, logits.shape[-1]))
            result = token_logprobs(raw.flatten(0, 1).log_softmax(dim=-1), outcome.tokens.flatten().clamp(min=0),
                                    batch.max_logprobs)
            handle.logprobs.append(PendingLogprobs.start(result, batch_rows, per_request=path_tokens.shape[1]))

    def _sampled_tree_targets(self, probs: torch.Tensor, argmax: torch.Tensor, index: torch.Tensor,
                              num_drafts: torch.Tensor, greedy: torch.Tensor,
                              generators: list[torch.Generator | None], rows: torch.Tensor) -> torch.Tensor:
        """The target tokens per tree index (sampled_tree.sampled_tree_targets) of a batch with a request that
        samples: its trees' children were drawn from the head, whose distributions the drafter kept (each
        request's row of them: rows), and are verified by recursive rejection sampling against the target's
        probs [n, W, V]. greedy, generators: each request's (SamplingBatch)."""
        n, width = index.shape
        uniform, noise = draw_randomness(n, width, probs.shape[-1], generators, self.device,
                                         self.sampler.default_generator)
        return sampled_tree_targets(probs, argmax, greedy, self.buffers.input_ids, index, num_drafts,
                                    self.speculator.tree_draws.node_probs, rows, self.tree_tables, uniform, noise)

    def retrace_trees(self, index: torch.Tensor, num_drafts: torch.Tensor, rows: torch.Tensor) -> TreeOutcome:
        """A rank > 0's _verify_tree of a sharded drafter's step, after rank 0 shared its outputs: the same walk
        retraced from the tokens rank 0 emitted (tree_verify.retrace_tree), its moves made in this rank's shard of
        the cache. index, num_drafts, rows: the verifying requests' token indices, drafts and output rows, as
        rank 0's verification read them. Returns the outcome, from which the drafter's inputs follow."""
        b = self.buffers
        outcome = retrace_tree(b.input_ids, index, num_drafts, self.tree_tables, b.slot_mapping, self.kv.spare_slot,
                               rows, self.outputs.accepted, self.outputs.tokens)
        move_kv(self.kv.stack, *outcome.moves)
        return outcome
