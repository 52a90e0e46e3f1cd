"""The runner's CUDA graphs: their capture, and the bodies of the greedy and whole-step graphs.

Every graph of the runner goes through one CUDAGraphManager each (worker/cudagraph.py), as the drafter's
do, all recorded through one recorder into one memory pool (docs/design.md, 'Batch descriptors and
padding'). The target's graphs replay its forward (docs/design.md, 'Graph modes'); the greedy graphs
replay the greedy sampling of a decode batch or the greedy verification of a uniform batch, reading the
target graph's outputs for the same descriptor; the whole-step graphs replay everything a greedy uniform
batch does (docs/design.md, 'Whole-step graphs'). Which of them a step replays is its StepPath's
decision (worker/step_path.py).
"""
from __future__ import annotations

import logging
import time

import torch

from specserve.attention.metadata import AttentionMetadata
from specserve.distributed.communication import broadcast_from_rank0
from specserve.distributed.graph_following import CaptureDone, GraphPart, capture_message
from specserve.engine.scheduler import SchedulerOutput
from specserve.sample.argmax import greedy_argmax
from specserve.sample.sampler import SamplingBatch
from specserve.sample.token_bitmask import TokenMask
from specserve.spec_decode.sampled_tree import TreeSampling
from specserve.spec_decode.greedy_verify import UniformVerifyInputs, greedy_verify
from specserve.spec_decode.tree_verify import TreeOutcome, move_kv, verify_tree
from specserve.worker.cudagraph import BatchDescriptor, CUDAGraphManager, default_capture_sizes
from specserve.worker.cudagraph_mode import CUDAGraphMode
from specserve.worker.graph_recorder import AttentionSplitter
from specserve.worker.inflight_inputs import take_inflight_inputs
from specserve.worker.staged_inputs import NUM_REQS, StagedExtra
from specserve.worker.step_path import StepPath, WholeStep

logger = logging.getLogger(__name__)


class TargetGraphs:
    """ModelRunner's graph capture and graph bodies (mixed into ModelRunner, whose state they use)."""

    def capture_graphs(self, mode: CUDAGraphMode, recorder, backend) -> None:
        """Record the target's graphs for `mode`, then the speculator's, all through `recorder`
        (one memory pool). `backend` is the attention backend the models were built with."""
        cfg = self.config
        splitter = AttentionSplitter(backend)
        splitter.install(self.model)
        k = self.outputs.num_drafts
        sizes = cfg.cudagraph_capture_sizes or default_capture_sizes(min(256, cfg.max_num_batched_tokens))
        self.graphs = self.target_graph_manager(mode, sizes, recorder, splitter)
        start, used_before = time.perf_counter(), recorder.memory_in_use()
        self._tell_workers(GraphPart.TARGET, self.graphs, self.graphs.capture_descriptors(), recorder, sizes=sizes)
        self.graphs.capture(self._target_forward, self._prepare_capture)
        query_lens = (1, 1 + k) if k else (1,)
        uniform = [d for d in self.graphs.capture_descriptors()
                   if d.mode is CUDAGraphMode.FULL and d.query_len in query_lens]
        if k:
            self.uniform_verify = self.uniform_verify_inputs()
        # Greedy sampling of a decode batch, and greedy verification of a chain of drafts.
        greedy_lens = (1,) if self.tree is not None else query_lens
        self.greedy_graphs = CUDAGraphManager(
            "greedy sampling", CUDAGraphMode.FULL_DECODE_ONLY, sizes, cfg.max_num_seqs, cfg.max_num_batched_tokens,
            uniform_query_lens=greedy_lens, recorder=recorder, debug=cfg.debug_cudagraph)
        greedy = [d for d in uniform if d.query_len in greedy_lens]
        self._tell_workers(GraphPart.GREEDY, self.greedy_graphs, greedy, recorder)
        self.greedy_graphs.capture(self._greedy_outputs, self._prepare_capture, greedy)
        drafter = self.speculator if self.speculator is not None and self.speculator.on_device else None
        if drafter is not None and hasattr(drafter, "capture_graphs"):
            if self.config.drafter_sharded:
                self._tell_workers(GraphPart.DRAFTER, self.graphs, [], recorder, sizes=sizes)
            drafter.capture_graphs(self.graphs, splitter, recorder, sizes, cfg.debug_cudagraph, self._prepare_capture,
                                   self.draft_base_positions, self.draft_block_table, self.config.drafter_sharded)
        # The debug check re-runs a graph's forward after its replay, but a whole step reads the outputs of the
        # step before, which its replay overwrote: under debug each part runs (and is checked) in its own graph.
        if self.tree is not None and not cfg.debug_cudagraph:
            # A tree's whole step, for batches where every request verifies the whole tree.
            self.whole_step_graphs = CUDAGraphManager(
                "whole tree step", CUDAGraphMode.FULL_DECODE_ONLY, sizes, cfg.max_num_seqs,
                cfg.max_num_batched_tokens, uniform_query_lens=(1 + k,), recorder=recorder)
            whole = [d for d in uniform if d.query_len == 1 + k]
            # The KV moves a request that rank 0 broadcasts: none to the ranks of a sharded drafter, which retrace
            # the walk from the outputs rank 0 shares (_whole_tree_step).
            moves = 0 if cfg.drafter_sharded else self.tree.depth
            self._tell_workers(GraphPart.WHOLE_TREE_STEP, self.whole_step_graphs, whole, recorder, moves)
            self.whole_step_graphs.capture(self._whole_tree_step, self._prepare_capture, whole)
            if self.tp_workers is None and drafter is not None and drafter.tree_draws is not None:
                # Its draws come from the engine's generator, registered with each graph: each replay draws anew.
                self.whole_sampled_tree_graphs = CUDAGraphManager(
                    "whole sampled tree step", CUDAGraphMode.FULL_DECODE_ONLY, sizes, cfg.max_num_seqs,
                    cfg.max_num_batched_tokens, uniform_query_lens=(1 + k,), recorder=recorder,
                    generator=self.sampler.default_generator)
                self.whole_sampled_tree_graphs.capture(self._whole_sampled_tree_step, self._prepare_capture, whole)
        elif not cfg.debug_cudagraph and (drafter is None or getattr(drafter, "greedy_loop_graphs", None)):
            self.whole_step_graphs = CUDAGraphManager(
                "whole step", CUDAGraphMode.FULL_DECODE_ONLY, sizes, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                uniform_query_lens=query_lens, recorder=recorder)
            self._tell_workers(GraphPart.WHOLE_STEP, self.whole_step_graphs, uniform, recorder)
            self.whole_step_graphs.capture(self._whole_step, self._prepare_capture, uniform)
        spec = cfg.speculative_config
        if (drafter is not None and not cfg.debug_cudagraph and self.tp_workers is None
                and (spec.dynamic or spec.disable_by_batch_size is not None)):
            # Steps the policy keeps from drafting decode as an engine without a speculator does.
            self.plain_step_graphs = CUDAGraphManager(
                "whole plain step", CUDAGraphMode.FULL_DECODE_ONLY, sizes, cfg.max_num_seqs,
                cfg.max_num_batched_tokens, uniform_query_lens=(1,), recorder=recorder)
            self.plain_step_graphs.capture(self._plain_step, self._prepare_capture,
                                           [d for d in uniform if d.query_len == 1])
        if self.tp_workers is not None:
            self.tp_workers.send_step(CaptureDone())
        self.buffers.reset()
        # The greedy graphs' warm-up runs wrote outputs for rows no step has had yet.
        self.outputs.packed.zero_()
        self.capture_seconds = time.perf_counter() - start
        self.graph_memory_bytes = recorder.memory_in_use() - used_before
        logger.info("CUDA graphs (%s): captured in %.1f s, %.0f MiB of GPU memory", mode.name, self.capture_seconds,
                    self.graph_memory_bytes / 2**20)

    def target_graph_manager(self, mode: CUDAGraphMode, sizes, recorder, splitter: AttentionSplitter
                             ) -> CUDAGraphManager:
        """The target's graph manager for mode and the capture sizes: on every rank the same, since a sharded
        drafter's graphs follow its descriptors and dispatch (drafter_graphs.py)."""
        cfg, k = self.config, self.outputs.num_drafts
        return CUDAGraphManager(
            "target", mode, sizes, cfg.max_num_seqs, cfg.max_num_batched_tokens,
            uniform_query_lens=(1, 1 + k) if k else (1,), recorder=recorder, debug=cfg.debug_cudagraph,
            splitter=splitter, single_request_query_lens=range(2, self.block_size + 1))

    def uniform_verify_inputs(self) -> UniformVerifyInputs:
        """The fixed inputs of a uniform batch's verification of every draft (greedy_verify.py)."""
        return UniformVerifyInputs.allocate(self.config.max_num_seqs, self.outputs.num_drafts, self.device,
                                            forced=self.forced_acceptance_prob is not None)

    def _tell_workers(self, part: GraphPart, manager: CUDAGraphManager, descriptors, recorder,
                      tree_depth: int = 0, sizes=()) -> None:
        """Under tensor parallelism, have the other ranks record their body of `part` for the same descriptors
        (distributed/graph_following.py) as this rank records its own."""
        if self.tp_workers is not None:
            self.tp_workers.send_step(capture_message(part, manager.mode, descriptors, recorder, tree_depth, sizes))

    def _prepare_capture(self, desc: BatchDescriptor) -> AttentionMetadata:
        # Recording executes nothing but the warm-up run, which must write no cache slot: every row is empty.
        self.buffers.reset()
        max_query_len = desc.query_len or desc.num_tokens
        return self.buffers.padded_metadata(desc.num_reqs, desc.num_tokens, max_query_len, self.config.max_model_len)

    def fill_inflight_inputs(self, max_rows: int) -> None:
        """The in-flight requests' inputs from the previous step's outputs (worker/inflight_inputs.py), in the
        persistent buffers the step has spread; max_rows: at least their number."""
        b, out = self.buffers, self.outputs
        take_inflight_inputs(b.staged, out.accepted, out.tokens, out.drafts, b.input_ids, b.positions, b.seq_lens,
                             b.slot_mapping, b.block_table, self.block_size, max_rows=max_rows)

    def _target_forward(self, desc: BatchDescriptor, metadata: AttentionMetadata):
        """The target's forward over the persistent inputs: (hidden states, auxiliary hidden states), padded to
        desc; eager, or recorded into the target's graphs."""
        n = desc.num_tokens
        return self.model(self.buffers.input_ids[:n], self.buffers.positions[:n], self.kv.layers, metadata)

    def _greedy_outputs(self, desc: BatchDescriptor, metadata):
        """_greedy_outputs_of the target graph's hidden states for the same descriptor, masked by the grammar
        masks of a step that staged them (InputBuffers.token_bitmask)."""
        return self._greedy_outputs_of(desc, self.graphs.graphs[desc.key].outputs[0], masked=True)

    def _greedy_outputs_of(self, desc: BatchDescriptor, padded_hidden: torch.Tensor, masked: bool) -> torch.Tensor:
        """The step outputs of a greedy uniform batch: a decode batch's tokens, or what a batch verifying k
        drafts per request accepts and emits. The batch's request i owns its tokens i * q .. i * q + q - 1 and
        output row i, so every index is the identity, and one recording serves every batch padded to
        desc.num_reqs (padded rows write rows of outputs that no request reads). masked: the logits row of
        token t is masked by bitmask row t of the runner's buffer where the step's staged header says the step
        has masks (a step without them pays one launch that reads the switch and writes nothing)."""
        n, q = desc.num_reqs, desc.query_len
        bitmask = self.buffers.token_bitmask
        mask = TokenMask(bitmask.device[: n * q], bitmask.switch) if masked else None
        tokens = self.model.greedy_tokens(padded_hidden[: n * q], captured=True, mask=mask)
        if q == 1:
            self.outputs.accepted[:n].zero_()
            self.outputs.tokens[:n, 0].copy_(tokens)
            return tokens
        v, forced = self.uniform_verify, self.forced_acceptance_prob
        greedy_verify(tokens.view(n, q), self.buffers.input_ids, v.index[:n], v.num_drafts[:n], v.rows[:n],
                      self.outputs.accepted, self.outputs.tokens, None if forced is None else v.uniform[:n], forced)
        return tokens

    def run_whole_step(self, desc: BatchDescriptor, sched: SchedulerOutput, path: StepPath, num_sampling: int) -> None:
        """Replay the step's whole-step graph (path.whole says which), after staging what its body reads."""
        if path.whole is WholeStep.SAMPLED_TREE:
            self.speculator.tree_draws.stage(SamplingBatch.build([s.request for s in sched.scheduled], self.device),
                                             self.buffers.staged_extra(StagedExtra.DRAFT_ROWS))
            graphs, body = self.whole_sampled_tree_graphs, self._whole_sampled_tree_step
        elif path.whole is WholeStep.PLAIN:
            graphs, body = self.plain_step_graphs, self._plain_step
        else:
            self._forced_draws(desc, num_sampling)
            graphs, body = self.whole_step_graphs, (self._whole_step if path.whole is WholeStep.CHAIN
                                                     else self._whole_tree_step)
        graphs.run(desc, body, None)

    def _whole_step(self, desc: BatchDescriptor, metadata, draft: bool = True):
        """Everything a greedy uniform batch does on the device, for one graph: the inputs spread from the
        staged copy, the in-flight requests' inputs, the target, its greedy outputs, and with a device drafter
        (unless not draft) the next drafts. Every launch reads its sizes from the staged header or from desc, so
        one recording serves every batch padded to desc.num_reqs; what it computes is what the parts compute on
        their own."""
        b, out, n = self.buffers, self.outputs, desc.num_reqs
        b.spread()
        self.fill_inflight_inputs(n)
        padded_hidden, padded_aux = self._target_forward(desc, metadata)
        # A step with grammar masks never runs whole (step_path.py): they are built after its forward is queued.
        self._greedy_outputs_of(desc, padded_hidden, masked=False)
        spec = self.speculator
        if draft and spec is not None and spec.on_device:
            if self.config.drafter_sharded:
                # The other ranks draft beside this one, from this step's accepted counts and tokens.
                out.share_from_rank0(n)
            self.draft_in_whole_step(desc, (padded_hidden, padded_aux), metadata)
        if self.shares_outputs and not self.config.drafter_sharded:
            out.share_from_rank0(n)

    def draft_in_whole_step(self, desc: BatchDescriptor, target_out: tuple, metadata: AttentionMetadata) -> None:
        """The greedy drafts of a whole step's batch (padded to desc.num_reqs) into the step outputs; every rank of
        a sharded drafter runs it, after rank 0 shared the step's outputs."""
        n = desc.num_reqs
        self._gather_draft_inputs(desc, max_rows=n)
        drafts = self.speculator.propose_greedy_in_graph(desc, target_out, metadata,
                                                         self.buffers.staged[NUM_REQS:NUM_REQS + 1],
                                                         self.draft_last_indices, self.draft_last_tokens)
        self.outputs.drafts[:n].copy_(drafts)

    def _whole_tree_step(self, desc: BatchDescriptor, metadata, sampled: bool = False):
        """_whole_step for trees of drafts: every request verifies the whole tree, so its tokens are rows
        i * (N + 1) .. of the step, and every index is fixed (self.uniform_verify; request i's output row is also
        its drafting index). Greedily; or, sampled, with the sampling TreeDraws.stage wrote for the batch: a
        sampling request's tree walked by recursive rejection sampling and its next tree's children drawn, as
        _verify_tree and the drafter's sampled tree graph do apart, from the engine's generator in the same
        order. Padded rows move cache slots only in the spare slot and draft nothing (tree_drafting.py)."""
        b, out, n, q = self.buffers, self.outputs, desc.num_reqs, desc.query_len
        b.spread()
        self.fill_inflight_inputs(n)
        padded_hidden, padded_aux = self._target_forward(desc, metadata)
        v = self.uniform_verify
        sampling = None
        if sampled:
            sampling = self.speculator.tree_draws.in_graph(n, b.staged[NUM_REQS:NUM_REQS + 1])
            target = self._sampled_tree_targets_in_graph(padded_hidden[:n * q], sampling, v.index[:n],
                                                         v.num_drafts[:n])
        else:
            target = self.model.greedy_tokens(padded_hidden[:n * q], captured=True).view(n, q)
        outcome = verify_tree(target, b.input_ids, v.index[:n], v.num_drafts[:n], self.tree_tables, b.slot_mapping,
                              self.kv.spare_slot, v.rows[:n], out.accepted, out.tokens)
        move_kv(self.kv.stack, *outcome.moves)
        sharded = self.config.drafter_sharded
        if sharded:
            # The other ranks retrace the walk from this step's outputs, moves included, and draft beside this one.
            out.share_from_rank0(n)
        elif self.tp_workers is not None:
            broadcast_from_rank0(torch.stack(outcome.moves))  # the other ranks' shards move too
        self.draft_tree_in_whole_step(desc, (padded_hidden, padded_aux), metadata, outcome, sampling)
        if self.shares_outputs and not sharded:
            out.share_from_rank0(n)

    def _whole_sampled_tree_step(self, desc: BatchDescriptor, metadata):
        return self._whole_tree_step(desc, metadata, sampled=True)

    def _plain_step(self, desc: BatchDescriptor, metadata):
        return self._whole_step(desc, metadata, draft=False)

    def _sampled_tree_targets_in_graph(self, hidden: torch.Tensor, sampling: TreeSampling, index: torch.Tensor,
                                       num_drafts: torch.Tensor) -> torch.Tensor:
        """_verify_tree's target table for n whole trees (hidden: their n * W rows), every request drawing with its
        temperature alone: from the target's probabilities under each request's temperature (greedy rows: 1,
        their walk on the argmax), and randomness drawn as _sampled_tree_targets draws it."""
        n, width = index.shape
        logits = self.model.compute_logits(hidden)
        probs = (logits / sampling.temperature.repeat_interleave(width).unsqueeze(1)).softmax(dim=-1)
        return self._sampled_tree_targets(probs.view(n, width, -1), greedy_argmax(logits).view(n, width), index,
                                          num_drafts, sampling.greedy, [None] * n, sampling.rows)

    def draft_tree_in_whole_step(self, desc: BatchDescriptor, target_out: tuple, metadata: AttentionMetadata,
                                 outcome: TreeOutcome, sampling: TreeSampling | None = None) -> None:
        """The next trees of a whole tree step's batch (padded to desc.num_reqs) into the step outputs, after the
        trees verified (outcome): every rank of a sharded drafter runs it, the other ranks from the walk they
        retraced (retrace_trees). sampling: how a sampled step's children are drawn (None: top guesses)."""
        n, b = desc.num_reqs, self.buffers
        self._gather_draft_inputs(desc, max_rows=n)
        # Request i's output row is also its drafting index.
        moves = self._follow_tree_paths(outcome, self.uniform_verify.rows[:n])
        self.speculator.propose_tree_in_graph(desc, target_out, metadata, moves, b.staged[NUM_REQS:NUM_REQS + 1],
                                              self.draft_last_indices, self.draft_base_positions,
                                              self.draft_block_table, self.outputs.drafts[:n], sampling)
