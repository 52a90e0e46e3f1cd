"""Runs one scheduled step: inputs into persistent buffers, target forward, sampling or verification,
drafting (docs/design.md, 'One engine step').

ModelRunner owns the step's state and its order: launch() stages the inputs, chooses the step's path
once (step_path.py), and runs the parts that path names; resolve() reads the results. The parts live in
modules of their own, mixed into ModelRunner: the graphs (target_graphs.py), sampling and verification
(sample_and_verify.py), and the drafter's inputs and proposal (draft_proposal.py).
"""
from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from specserve.config import EngineConfig
from specserve.distributed.communication import min_over_ranks
from specserve.distributed.step_following import broadcasts_tree_moves, worker_step
from specserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from specserve.models.arch_config import ArchConfig
from specserve.outputs import Logprob
from specserve.sample.sampler import Sampler
from specserve.spec_decode.config import MAX_DRAFT_TOKENS
from specserve.spec_decode.draft_inputs import DraftRequest
from specserve.spec_decode.greedy_verify import UniformVerifyInputs
from specserve.spec_decode.speculator import Speculator
from specserve.spec_decode.tree_verify import TreeOutcome, TreeTables
from specserve.structured_output.draft_masks import CarriedDraftMasks
from specserve.structured_output.step_masks import StepMasks
from specserve.worker.cudagraph import BatchDescriptor, CUDAGraphManager
from specserve.worker.cudagraph_mode import CUDAGraphMode
from specserve.worker.draft_proposal import DraftProposal
from specserve.worker.graph_recorder import CudaGraphRecorder
from specserve.worker.host_block_table import HostBlockTable
from specserve.worker.inflight_inputs import InflightRequest, PreviousRow
from specserve.worker.input_buffers import InputBuffers
from specserve.worker.kv_layout import KVCacheLayout, KVCaches
from specserve.worker.kv_sizing import CudaMemory, KVCachePlan, plan_kv_cache, use_expandable_segments
from specserve.worker.sample_and_verify import SampleAndVerify
from specserve.worker.step_handle import StepHandle
from specserve.worker.step_outputs import StepOutputs
from specserve.worker.step_path import (Drafting, GraphsReady, Sampling, SpeculatorKind, StepPath, StepRows,
                                        Verification, WholeStep, choose_step_path)
from specserve.worker.step_plan import StepPlan, TreeLayout
from specserve.worker.target_graphs import TargetGraphs

logger = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    # request id -> tokens produced this step (one, or accepted drafts + one)
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # request id -> one logprob dict per produced token
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    # request id -> draft tokens proposed for the next step
    drafts: dict[str, list[int]] = field(default_factory=dict)


class ModelRunner(TargetGraphs, SampleAndVerify, DraftProposal):
    def __init__(self, model: torch.nn.Module, arch: ArchConfig, config: EngineConfig, tp_workers=None):
        """arch: the architecture the model computes (a rank's shard under tensor parallelism). tp_workers: the
        other ranks (distributed/workers.py), sent each step before it runs; None at tensor_parallel_size 1."""
        self.model = model
        self.tp_workers = tp_workers
        self.arch = arch
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        # The device's memory before the runner's buffers, the target's weights loaded: KV sizing counts the
        # engine's growth from here (kv_sizing.py). An engine dropped before may hold memory in a reference
        # cycle until collected: collected first, its memory reads as free.
        self.memory_at_start = None
        if self.device.type == "cuda":
            use_expandable_segments()
            gc.collect()
            self.memory_at_start = CudaMemory(self.device).read()
        self.block_size = config.block_size
        # Allocated by initialize_kv_cache, once a drafter's layers have joined the target's (set_speculator).
        self.kv = KVCaches(KVCacheLayout.of(arch), self.block_size, config.kv_cache_torch_dtype, self.device)
        self.kv_plan: KVCachePlan | None = None
        # Room for the context plus draft lookahead slots.
        max_blocks_per_req = -(-(config.max_model_len + MAX_DRAFT_TOKENS) // self.block_size) + 1
        spec = config.speculative_config
        # A tree of drafts (spec_decode/tree.py) instead of a chain, and its tables on the device.
        self.tree = spec.tree if spec else None
        # Whether grammar requests' drafts are masked by their grammars (SpeculativeConfig.mask_drafts).
        self.mask_drafts = spec is None or spec.masks_drafts
        self.tree_tables = TreeTables.build(self.tree, self.device) if self.tree else None
        # This step's accepted paths (token indices), accepted counts, emitted tokens and cache moves.
        self._tree_step: TreeOutcome | None = None
        self.tree_layout = TreeLayout.of(self.tree) if self.tree else None
        self.buffers = InputBuffers.for_engine(config, self.tree, max_blocks_per_req, arch.vocab_size, self.device)
        self.outputs = StepOutputs(config.max_num_seqs, spec.num_draft_tokens if spec else 0, self.device,
                                   max_accepted=spec.num_speculative_tokens if spec else 0)
        # Every rank reads a step's in-flight inputs from the previous step's outputs (asynchronous scheduling),
        # which only rank 0 computes: each step that samples ends with rank 0 sharing them, on every rank.
        self.shares_outputs = config.tensor_parallel_size > 1 and config.async_scheduling
        # Request id -> its row in the last launched step, for a step scheduled before that one's results
        # were back.
        self._previous: dict[str, PreviousRow] = {}
        # The drafts the last resolved step proposed, by request: those its successor verifies on the device.
        self._resolved_drafts: dict[str, list[int]] = {}
        # The last step's chain drafter masks, for this step's verification masks only (draft_masks.py).
        self._carried_masks: CarriedDraftMasks | None = None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(generator)
        self.speculator: Speculator | None = None
        self.forced_acceptance_prob: float | None = None
        # A device drafter's inputs gathered from each step (draft_proposal.py), one row per drafting request;
        # allocated by set_speculator.
        self.draft_base_positions: torch.Tensor | None = None
        self.draft_block_table: torch.Tensor | None = None
        self.draft_last_indices: torch.Tensor | None = None
        self.draft_last_tokens: torch.Tensor | None = None
        # Each running request owns one row of per-request persistent state: its block ids on the host, and
        # with a drafter its draft probabilities.
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self.host_block_table = HostBlockTable(config.max_num_seqs, max_blocks_per_req)
        self.graphs: CUDAGraphManager | None = None
        # Greedy sampling of a decode batch and greedy verification of a uniform one, one graph per full graph
        # of the target for them (see _greedy_outputs), and the verification's fixed inputs.
        self.greedy_graphs: CUDAGraphManager | None = None
        # The whole step of a greedy uniform batch in one graph (see _whole_step, _whole_tree_step).
        self.whole_step_graphs: CUDAGraphManager | None = None
        # Trees with a request that samples (WholeStep.SAMPLED_TREE): one GPU, a drafter that draws children.
        self.whole_sampled_tree_graphs: CUDAGraphManager | None = None
        # Decode steps a policy keeps from drafting (WholeStep.PLAIN): one GPU, a policy that can.
        self.plain_step_graphs: CUDAGraphManager | None = None
        # The fixed inputs of a uniform batch's greedy verification, chain or tree, for their graphs.
        self.uniform_verify: UniformVerifyInputs | None = None
        self.capture_seconds: float | None = None
        self.graph_memory_bytes: int | None = None

    def initialize_kv_cache(self, backend, profile_step: Callable[[SchedulerOutput], None] | None = None,
                            capture: Callable[[], None] | None = None) -> None:
        """Size the KV cache pool (kv_sizing.py) and allocate it, once the models (and a drafter) are loaded and
        before the graphs are captured. backend: the attention backend the models were built with.
        profile_step, capture: how the memory profile runs its step and records the graphs (default
        execute_model and capture_graphs; ranks 1..N-1 follow rank 0's). Under tensor parallelism every rank
        sizes its own share and all take the smallest count, so that every rank holds the same blocks."""
        mode = CUDAGraphMode(self.config.cudagraph_mode)
        if mode is CUDAGraphMode.NONE:
            capture = None
        elif capture is None:
            capture = lambda: self.capture_graphs(mode, CudaGraphRecorder(self.device), backend)  # noqa: E731
        plan = plan_kv_cache(self, capture, profile_step or self.execute_model)
        if self.config.tensor_parallel_size > 1:
            plan = replace(plan, num_blocks=min_over_ranks(plan.num_blocks, self.device))
        self.kv_plan = plan
        self.kv.allocate(plan.num_blocks)
        logger.info("%s", plan.describe(self.config.max_model_len))

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    def set_speculator(self, speculator: Speculator, forced_acceptance_prob: float | None) -> None:
        self.speculator = speculator
        self.kv.add_drafter(speculator)
        self.forced_acceptance_prob = forced_acceptance_prob
        self.model.aux_hidden_layers = speculator.aux_hidden_layers
        n = self.config.max_num_seqs
        self.draft_base_positions = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.draft_block_table = torch.zeros_like(self.buffers.block_table)
        self.draft_last_indices = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.draft_last_tokens = torch.zeros(n, dtype=torch.int64, device=self.device)

    def release_graphs(self) -> None:
        """Drop every recorded graph, the runner's and the drafter's, so that their memory pool can be freed;
        steps run eagerly until capture_graphs records them again."""
        self.graphs = self.greedy_graphs = self.whole_step_graphs = None
        self.whole_sampled_tree_graphs = self.plain_step_graphs = None
        self.uniform_verify = None
        if self.speculator is not None:
            self.speculator.release_graphs()

    @contextmanager
    def scratch_steps(self):
        """Steps run inside leave nothing a later step reads: after them every request is forgotten, the
        staged inputs and step outputs are reset as after a capture, and the engine's generator is back
        where it was (a seeded engine draws the same numbers as without them)."""
        generator = self.sampler.default_generator
        state = generator.get_state()
        try:
            yield
        finally:
            self.forget_requests(list(self.rows))
            self._previous, self._tree_step, self._resolved_drafts, self._carried_masks = {}, None, {}, None
            self.buffers.reset()
            self.outputs.packed.zero_()
            if self.speculator is not None:
                self.speculator.reset()
            generator.set_state(state)

    def _choose_path(self, desc: BatchDescriptor, sched: SchedulerOutput) -> StepPath:
        """The step's path (step_path.py), from its descriptor, its requests and the graphs recorded."""
        rows = StepRows.of(sched)
        spec = self.speculator
        # A step the policy keeps from drafting runs as without a speculator (docs/design.md, 'Dynamic
        # speculation'), but for the whole-step graphs, which draft with a device drafter.
        kind = (SpeculatorKind.NONE if spec is None or not sched.propose_drafts else
                SpeculatorKind.ON_DEVICE if spec.on_device else SpeculatorKind.ON_HOST)
        whole, greedy, sampled = self.whole_step_graphs, self.greedy_graphs, self.whole_sampled_tree_graphs
        whole_step_drafts = spec is not None and spec.on_device
        graphs = GraphsReady(
            whole_step=whole is not None and not self.graphs.debug and whole.has_graph(desc) and (
                sched.propose_drafts or not whole_step_drafts),
            whole_sampled_tree=sampled is not None and sampled.has_graph(desc) and sched.propose_drafts,
            plain_step=self.plain_step_graphs is not None and self.plain_step_graphs.has_graph(desc),
            # Greedy verification graphs read the uniform batch's fixed inputs.
            greedy=greedy is not None and greedy.has_graph(desc) and (
                desc.query_len == 1 or self.uniform_verify is not None),
            drafting=kind is SpeculatorKind.ON_DEVICE and spec.has_drafting_graph(rows.num_sampling),
            sampled_tree=kind is SpeculatorKind.ON_DEVICE and spec.has_sampled_tree_graph(rows.num_sampling),
            drafter_cache=whole_step_drafts)
        return choose_step_path(desc, rows, graphs, kind, self.tree is not None, self.mask_drafts)

    def dispatch(self, num_tokens: int, query_lens: list[int]) -> BatchDescriptor:
        """How this step's target forward runs: the graph descriptor where graphs are recorded."""
        uniform = query_lens[0] if all(q == query_lens[0] for q in query_lens) else None
        if self.graphs is None:
            return BatchDescriptor(CUDAGraphMode.NONE, num_tokens, len(query_lens), uniform)
        return self.graphs.dispatch(num_tokens, len(query_lens), uniform)

    def _run_target(self, desc: BatchDescriptor, metadata):
        """Target forward for this step, replayed from a graph where one fits. Returns the forward's outputs
        over the descriptor's (padded) tokens, and the metadata its attention ran with."""
        if self.graphs is None:
            return self._target_forward(desc, metadata), metadata
        if desc.mode is CUDAGraphMode.PIECEWISE:
            # Attention runs eagerly over the padded tokens; padded ones belong to no request.
            metadata = replace(metadata, num_tokens=desc.num_tokens,
                               slot_mapping=self.buffers.slot_mapping[: desc.num_tokens])
        return self.graphs.run(desc, self._target_forward, metadata), metadata

    def forget_requests(self, request_ids: list[str]) -> None:
        """Release the rows of requests that finished or were preempted."""
        for rid in request_ids:
            row = self.rows.pop(rid, None)
            if row is not None:
                self.free_rows.append(row)
                self.host_block_table.clear(row)
            if self.speculator is not None:
                self.speculator.forget(rid)

    def _row(self, request_id: str) -> int:
        if request_id not in self.rows:
            self.rows[request_id] = self.free_rows.pop()
        return self.rows[request_id]

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> RunnerOutput:
        """One step, start to finish (launch, then wait for its results)."""
        return self.resolve(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, complete_previous: Callable[[], None] | None = None) -> StepHandle:
        """Enqueue the whole step on the device (inputs, forward, sampling, drafts, the copy of the results to
        the host) without waiting for it; resolve() reads the results. complete_previous: with a step still
        in flight, completes it (resolves it and hands its tokens to the requests); a step with grammar masks
        calls it once its forward is enqueued, as the masks start from every token before the step."""
        self.forget_requests(sched.finished + sched.preempted)
        carried, self._carried_masks = self._carried_masks, None  # the step before's drafts, or none
        ids, qlens, slens, rows, sampling = [], [], [], [], []
        inflight: list[InflightRequest] = []
        draft_requests: list[DraftRequest] = []  # per scheduled request, for the drafter
        offset = 0
        for i, s in enumerate(sched.scheduled):
            req, start, n = s.request, s.start, s.num_new_tokens
            if s.from_device:
                inflight.append(InflightRequest.of(i, self._previous[req.request_id], offset, n))
                ids.extend([0] * n)
            else:
                known = req.all_token_ids
                ids.extend(known[start:start + n] if start + n <= len(known)
                           else (known + s.spec_token_ids)[start:start + n])
            qlens.append(n)
            slens.append(start + n)
            row = self._row(req.request_id)
            self.host_block_table.sync(row, s.block_ids)
            rows.append(row)
            if s.samples:
                draft_requests.append(DraftRequest(offset, n, len(sampling), len(s.spec_token_ids), 0))
                sampling.append(i)
            else:
                draft_requests.append(DraftRequest(offset, n, -1, 0, req.all_token_ids[start + n]))
            offset += n
        desc = self.dispatch(offset, qlens)
        path = self._choose_path(desc, sched)
        drafter_on_device = self.speculator is not None and self.speculator.on_device
        plan = StepPlan.build(sched, sampling, draft_requests, inflight, drafter_on_device,
                              drafter_on_device and sched.propose_drafts, self._row, trees=self.tree is not None,
                              prefills_drafter=path.drafting is Drafting.PREFILL_ONLY)
        self._tree_step = None
        ids, qlens_np, slens = (np.array(ids, dtype=np.int64), np.array(qlens, dtype=np.int64),
                                np.array(slens, dtype=np.int64))
        table = self.host_block_table.gather(rows)
        # A step that verifies no tree stages no layout: every token's shift is then 0 and its bits -1, as stage()
        # would give them.
        tree_layout = (self.tree_layout.stage(sched, offset) if self.tree_layout
                       and path.verification is not Verification.NONE else (None, None))
        metadata = self.buffers.prepare(ids, qlens_np, slens, table, self.block_size, plan.extras, *tree_layout,
                                        masked=path.masked)
        b = self.buffers
        follow = self._draft_follow(sched, sampling, path) if sampling else None
        if self.tp_workers is not None:
            self.tp_workers.send_step(worker_step(ids, qlens_np, slens, table, tree_layout, plan, desc, path,
                                                  self.tree.depth if self.tree else 0,
                                                  self.shares_outputs and bool(sampling), follow))
        handle = StepHandle(sched, sampling, path)
        self._previous = {sched.scheduled[i].request.request_id:
                          PreviousRow(i, len(sched.scheduled[i].spec_token_ids)) for i in sampling}
        if path.whole is not WholeStep.NONE:
            self.run_whole_step(desc, sched, path, len(sampling))
            handle.host, handle.event = self.outputs.copy_to_host(len(sched.scheduled))
            return handle
        b.spread()
        if inflight:
            self.fill_inflight_inputs(len(inflight))
        target_out, metadata = self._run_target(desc, metadata)
        hidden = target_out[0][:offset]
        if not sampling:
            if path.drafting is Drafting.PREFILL_ONLY:
                self._prefill_drafter(desc, target_out, metadata, len(sched.scheduled))
            return handle
        masks = None
        if path.masked:
            if complete_previous is not None:
                complete_previous()
            masks = StepMasks.build(sched, plan.sample_rows, plan.verify_rows, b.token_bitmask,
                                    self._verified_drafts, self.tree.parents if self.tree is not None else None,
                                    carried)
        if path.sampling is not Sampling.NONE:
            self._sample(hidden, sched, plan.sample_rows, handle, desc, path.sampling, masks)
        if path.verifies_trees:
            self._verify_tree(hidden, sched, plan.verify_rows, handle, path.verification, masks,
                              self.tp_workers is not None and broadcasts_tree_moves(path, follow))
        elif path.verification is not Verification.NONE:
            self._verify(hidden, sched, plan.verify_rows, handle, desc, path.verification, masks)
        if follow is not None:
            # The other ranks draft beside this one, from this step's accepted counts and tokens.
            self.outputs.share_from_rank0(len(sched.scheduled))
        if path.drafts_on_device:
            self._propose(sched, sampling, desc, target_out, metadata, path.drafting, follow)
        elif path.drafting is Drafting.PREFILL_ONLY:
            self._prefill_drafter(desc, target_out, metadata, len(sched.scheduled))
        # A sharded drafter's prefill began with the share (_prefill_drafter).
        prefill_shared = path.drafting is Drafting.PREFILL_ONLY and self.config.drafter_sharded
        if self.shares_outputs and follow is None and not prefill_shared:
            self.outputs.share_from_rank0(len(sched.scheduled))
        handle.host, handle.event = self.outputs.copy_to_host(len(sched.scheduled))
        return handle

    def _verified_drafts(self, s: ScheduledRequest) -> list[int]:
        """The drafts a scheduled request verifies: those of a row that takes them from the device are the ones
        the previous step proposed, read back by its resolve()."""
        if not s.from_device:
            return s.spec_token_ids
        return self._resolved_drafts.get(s.request.request_id, [])[:len(s.spec_token_ids)]

    def resolve(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a launched step and return its tokens (and drafts) on the host."""
        out = RunnerOutput()
        if not handle.sampling:
            return out
        if handle.event is not None:
            handle.event.synchronize()
        path = handle.path
        k = self.outputs.max_accepted
        table = handle.host[:, :self.outputs.columns_written(path.verification is not Verification.NONE,
                                                             path.drafts_on_device)].tolist()
        scheduled = handle.sched.scheduled
        for i in handle.sampling:
            row = table[i]
            rid = scheduled[i].request.request_id
            out.sampled[rid] = row[1:row[0] + 2]
            if path.drafts_on_device:
                out.drafts[rid] = row[k + 2:]
        for logprobs in handle.logprobs:
            logprobs.collect(table, handle.sched, out.logprobs)
        if path.drafting is Drafting.ON_HOST:
            reqs = [scheduled[i].request for i in handle.sampling]
            contexts = [r.all_token_ids + out.sampled[r.request_id] for r in reqs]
            for req, d in zip(reqs, self.speculator.propose_from_contexts(contexts)):
                out.drafts[req.request_id] = d
        self._resolved_drafts = out.drafts
        return out

