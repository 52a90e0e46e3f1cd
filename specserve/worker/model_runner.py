"""Runs one scheduled step: inputs into persistent buffers, target forward, sampling."""
from __future__ import annotations

import gc
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from specserve.config import EngineConfig
from specserve.engine.scheduler import SchedulerOutput
from specserve.sample.argmax import greedy_argmax
from specserve.models.arch_config import ArchConfig
from specserve.outputs import Logprob
from specserve.sample.sampler import (Sampler, SamplerOutput, SamplingBatch, filtered_probs, sample_from_probs,
                                      token_logprobs)
from specserve.spec_decode.config import MAX_DRAFT_TOKENS
from specserve.spec_decode.draft_inputs import follow_tree_paths, gather_draft_inputs
from specserve.spec_decode.greedy_verify import UniformVerifyInputs, greedy_verify
from specserve.spec_decode.rejection_sampler import draw_randomness, rejection_sample
from specserve.spec_decode.speculator import DraftInput, Speculator
from specserve.spec_decode.tree_verify import TreeOutcome, TreeTables, move_kv, verify_tree
from specserve.worker.cudagraph import BatchDescriptor, CUDAGraphManager, default_capture_sizes
from specserve.worker.cudagraph_mode import CUDAGraphMode
from specserve.worker.graph_recorder import AttentionSplitter, CudaGraphRecorder
from specserve.worker.host_block_table import HostBlockTable
from specserve.worker.inflight_inputs import take_inflight_inputs
from specserve.worker.input_buffers import InputBuffers
from specserve.worker.kv_layout import KVCacheLayout, KVCaches
from specserve.worker.kv_sizing import CudaMemory, KVCachePlan, plan_kv_cache
from specserve.worker.staged_inputs import NUM_REQS
from specserve.worker.step_handle import PendingLogprobs, StepHandle
from specserve.worker.step_outputs import StepOutputs
from specserve.worker.step_path import (Drafting, GraphsReady, Sampling, SpeculatorKind, StepPath, StepRows,
                                        Verification, WholeStep, choose_step_path)
from specserve.worker.step_plan import StepPlan

logger = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    # request id -> tokens produced this step (one, or accepted drafts + one)
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # request id -> one logprob dict per produced token
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    # request id -> draft tokens proposed for the next step
    drafts: dict[str, list[int]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, arch: ArchConfig, config: EngineConfig):
        self.model = model
        self.arch = arch
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        # The device's memory before the runner's buffers, the target's weights loaded: KV sizing counts the
        # engine's growth from here (kv_sizing.py). An engine dropped before may hold memory in a reference
        # cycle until collected: collected first, its memory reads as free.
        self.memory_at_start = None
        if self.device.type == "cuda":
            gc.collect()
            self.memory_at_start = CudaMemory(self.device).read()
        self.block_size = config.block_size
        # Allocated by initialize_kv_cache, once a drafter's layers have joined the target's (set_speculator).
        self.kv = KVCaches(KVCacheLayout.of(arch), self.block_size, self.dtype, self.device)
        self.kv_plan: KVCachePlan | None = None
        # Room for the context plus draft lookahead slots.
        max_blocks_per_req = -(-(config.max_model_len + MAX_DRAFT_TOKENS) // self.block_size) + 1
        spec = config.speculative_config
        # A tree of drafts (spec_decode/tree.py) instead of a chain, and its tables on the device.
        self.tree = spec.tree if spec else None
        self.tree_tables = TreeTables.build(self.tree, self.device) if self.tree else None
        # This step's accepted paths (token indices), accepted counts, emitted tokens and cache moves.
        self._tree_step: TreeOutcome | None = None
        # Each tree index's position shift (index - depth) and tree bits, as _tree_layout stages them.
        self._tree_shift = np.arange(self.tree.num_nodes + 1) - np.array(self.tree.depths) if self.tree else None
        self._tree_bits = np.array(self.tree.ancestor_bits) if self.tree else None
        # Extras a step stages beside its inputs, per request at most: the in-flight row (5), sampling or
        # verification indices (k + 4), the drafter's request row (5) and its rows (2); and one value of
        # alignment padding per extra.
        extras = config.max_num_seqs * (16 + MAX_DRAFT_TOKENS) + 16
        self.buffers = InputBuffers(config.max_num_seqs, config.max_num_batched_tokens, max_blocks_per_req, self.device,
                                    extra_capacity=extras, trees=self.tree is not None)
        self.outputs = StepOutputs(config.max_num_seqs, spec.num_draft_tokens if spec else 0, self.device,
                                   max_accepted=spec.num_speculative_tokens if spec else 0)
        # Request id -> (its batch row, drafts verified) in the last launched step, for a step scheduled
        # before that one's results were back.
        self._previous: dict[str, tuple[int, int]] = {}
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(generator)
        self.speculator: Speculator | None = None
        self.forced_acceptance_prob: float | None = None
        # Each running request owns one row of per-request persistent state: its block ids on the host, and
        # with a drafter its draft probabilities.
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self.host_block_table = HostBlockTable(config.max_num_seqs, max_blocks_per_req)
        self.graphs: CUDAGraphManager | None = None
        # Greedy sampling of a decode batch and greedy verification of a uniform one, one graph per full graph
        # of the target for them (see _greedy_outputs), and the verification's fixed inputs.
        self.greedy_graphs: CUDAGraphManager | None = None
        # The whole step of a greedy uniform batch in one graph (see _whole_step).
        self.whole_step_graphs: CUDAGraphManager | None = None
        self.uniform_verify: UniformVerifyInputs | None = None
        self.capture_seconds: float | None = None
        self.graph_memory_bytes: int | None = None

    def initialize_kv_cache(self, backend) -> None:
        """Size the KV cache pool (kv_sizing.py) and allocate it, once the models (and a drafter) are loaded and
        before the graphs are captured. backend: the attention backend the models were built with."""
        mode = CUDAGraphMode(self.config.cudagraph_mode)
        capture = None if mode is CUDAGraphMode.NONE else (
            lambda: self.capture_graphs(mode, CudaGraphRecorder(self.device), backend))
        self.kv_plan = plan_kv_cache(self, capture)
        self.kv.allocate(self.kv_plan.num_blocks)
        logger.info("%s", self.kv_plan.describe(self.config.max_model_len))

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

    def capture_graphs(self, mode: CUDAGraphMode, recorder, backend) -> None:
        """Record the target's graphs for `mode`, then the speculator's, all through `recorder`
        (one memory pool). `backend` is the attention backend the models were built with."""
        cfg = self.config
        splitter = AttentionSplitter(backend)
        splitter.install(self.model)
        k = self.outputs.num_drafts
        sizes = cfg.cudagraph_capture_sizes or default_capture_sizes(min(256, cfg.max_num_batched_tokens))
        self.graphs = CUDAGraphManager(
            "target", mode, sizes, cfg.max_num_seqs, cfg.max_num_batched_tokens,
            uniform_query_lens=(1, 1 + k) if k else (1,), recorder=recorder, debug=cfg.debug_cudagraph,
            splitter=splitter, single_request_query_lens=range(2, self.block_size + 1))
        start, used_before = time.perf_counter(), recorder.memory_in_use()
        self.graphs.capture(self._target_forward, self._prepare_capture)
        query_lens = (1, 1 + k) if k else (1,)
        uniform = [d for d in self.graphs.capture_descriptors()
                   if d.mode is CUDAGraphMode.FULL and d.query_len in query_lens]
        if k and self.tree is None:
            self.uniform_verify = UniformVerifyInputs.allocate(cfg.max_num_seqs, k, self.device,
                                                               forced=self.forced_acceptance_prob is not None)
        # Greedy sampling of a decode batch, and greedy verification of a chain of drafts.
        greedy_lens = (1,) if self.tree is not None else query_lens
        self.greedy_graphs = CUDAGraphManager(
            "greedy sampling", CUDAGraphMode.FULL_DECODE_ONLY, sizes, cfg.max_num_seqs, cfg.max_num_batched_tokens,
            uniform_query_lens=greedy_lens, recorder=recorder, debug=cfg.debug_cudagraph)
        self.greedy_graphs.capture(self._greedy_outputs, self._prepare_capture,
                                   [d for d in uniform if d.query_len in greedy_lens])
        drafter = self.speculator if self.speculator is not None and self.speculator.on_device else None
        if drafter is not None and hasattr(drafter, "capture_graphs"):
            drafter.capture_graphs(self.graphs, splitter, recorder, sizes, cfg.debug_cudagraph, self._prepare_capture,
                                   self.draft_base_positions, self.draft_block_table)
        # The debug check re-runs a graph's forward after its replay, but a whole step reads the outputs of the
        # step before, which its replay overwrote: under debug each part runs (and is checked) in its own graph.
        if self.tree is not None and not cfg.debug_cudagraph:
            # A tree's whole step, for batches where every request verifies the whole tree.
            self.tree_index = torch.arange(cfg.max_num_seqs * (1 + k), device=self.device).view(-1, 1 + k)
            # Request i's output row and drafting index.
            self.tree_rows = torch.arange(cfg.max_num_seqs, device=self.device)
            self.tree_num_drafts = torch.full((cfg.max_num_seqs,), k, device=self.device)
            self.whole_step_graphs = CUDAGraphManager(
                "whole tree step", CUDAGraphMode.FULL_DECODE_ONLY, sizes, cfg.max_num_seqs,
                cfg.max_num_batched_tokens, uniform_query_lens=(1 + k,), recorder=recorder)
            self.whole_step_graphs.capture(self._whole_tree_step, self._prepare_capture,
                                           [d for d in uniform if d.query_len == 1 + k])
        elif not cfg.debug_cudagraph and (drafter is None or getattr(drafter, "greedy_loop_graphs", None)):
            self.whole_step_graphs = CUDAGraphManager(
                "whole step", CUDAGraphMode.FULL_DECODE_ONLY, sizes, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                uniform_query_lens=query_lens, recorder=recorder)
            self.whole_step_graphs.capture(self._whole_step, self._prepare_capture, uniform)
        self.buffers.reset()
        # The greedy graphs' warm-up runs wrote outputs for rows no step has had yet.
        self.outputs.packed.zero_()
        self.capture_seconds = time.perf_counter() - start
        self.graph_memory_bytes = recorder.memory_in_use() - used_before
        logger.info("CUDA graphs (%s): captured in %.1f s, %.0f MiB of GPU memory", mode.name, self.capture_seconds,
                    self.graph_memory_bytes / 2**20)

    def release_graphs(self) -> None:
        """Drop every recorded graph, the runner's and the drafter's, so that their memory pool can be freed;
        steps run eagerly until capture_graphs records them again."""
        self.graphs = self.greedy_graphs = self.whole_step_graphs = None
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
            self._previous, self._tree_step = {}, None
            self.buffers.reset()
            self.outputs.packed.zero_()
            if self.speculator is not None:
                self.speculator.reset()
            generator.set_state(state)

    def _prepare_capture(self, desc: BatchDescriptor):
        # Recording executes nothing but the warm-up run, which must write no cache slot: every row is empty.
        self.buffers.reset()
        max_query_len = desc.query_len or desc.num_tokens
        return self.buffers.padded_metadata(desc.num_reqs, desc.num_tokens, max_query_len, self.config.max_model_len)

    def _target_forward(self, desc: BatchDescriptor, metadata):
        n = desc.num_tokens
        return self.model(self.buffers.input_ids[:n], self.buffers.positions[:n], self.kv.layers, metadata)

    def _greedy_outputs(self, desc: BatchDescriptor, metadata):
        """_greedy_outputs_of the target graph's hidden states for the same descriptor."""
        return self._greedy_outputs_of(desc, self.graphs.graphs[desc.key].outputs[0])

    def _greedy_outputs_of(self, desc: BatchDescriptor, padded_hidden: torch.Tensor) -> torch.Tensor:
        """The step outputs of a greedy uniform batch: a decode batch's tokens, or what a batch verifying k
        drafts per request accepts and emits. The batch's request i owns its tokens i * q .. i * q + q - 1 and
        output row i, so every index is the identity, and one recording serves every batch padded to
        desc.num_reqs (padded rows write rows of outputs that no request reads)."""
        n, q = desc.num_reqs, desc.query_len
        tokens = self.model.greedy_tokens(padded_hidden[: n * q], captured=True)
        if q == 1:
            self.outputs.accepted[:n].zero_()
            self.outputs.tokens[:n, 0].copy_(tokens)
            return tokens
        v, forced = self.uniform_verify, self.forced_acceptance_prob
        greedy_verify(tokens.view(n, q), self.buffers.input_ids, v.index[:n], v.num_drafts[:n], v.rows[:n],
                      self.outputs.accepted, self.outputs.tokens, None if forced is None else v.uniform[:n], forced)
        return tokens

    def _whole_step(self, desc: BatchDescriptor, metadata):
        """Everything a greedy uniform batch does on the device, for one graph: the inputs spread from the
        staged copy, the in-flight requests' inputs, the target, its greedy outputs, and with a device drafter
        the next drafts. Every launch reads its sizes from the staged header or from desc, so one recording
        serves every batch padded to desc.num_reqs; what it computes is what the parts compute on their own."""
        b, out, n = self.buffers, self.outputs, desc.num_reqs
        b.spread()
        take_inflight_inputs(b.staged, out.accepted, out.tokens, out.drafts, b.input_ids, b.positions, b.seq_lens,
                             b.slot_mapping, b.block_table, self.block_size, max_rows=n)
        padded_hidden, padded_aux = self._target_forward(desc, metadata)
        self._greedy_outputs_of(desc, padded_hidden)
        spec = self.speculator
        if spec is not None and spec.on_device:
            self._gather_draft_inputs(desc, max_rows=n)
            drafts = spec.propose_greedy_in_graph(desc, (padded_hidden, padded_aux), metadata,
                                                  b.staged[NUM_REQS:NUM_REQS + 1], self.draft_last_indices,
                                                  self.draft_last_tokens)
            out.drafts[:n].copy_(drafts)

    def _whole_tree_step(self, desc: BatchDescriptor, metadata):
        """_whole_step for trees of drafts: every request verifies the whole tree greedily, so its tokens are
        rows i * (N + 1) .. of the step, and every index is fixed (self.tree_index). Padded rows move cache
        slots only in the spare slot and draft nothing (tree_drafting.py)."""
        b, out, n, q = self.buffers, self.outputs, desc.num_reqs, desc.query_len
        b.spread()
        take_inflight_inputs(b.staged, out.accepted, out.tokens, out.drafts, b.input_ids, b.positions, b.seq_lens,
                             b.slot_mapping, b.block_table, self.block_size, max_rows=n)
        padded_hidden, padded_aux = self._target_forward(desc, metadata)
        target = self.model.greedy_tokens(padded_hidden[:n * q], captured=True).view(n, q)
        index, rows = self.tree_index[:n], self.tree_rows[:n]
        outcome = verify_tree(target, b.input_ids, index, self.tree_num_drafts[:n], self.tree_tables, b.slot_mapping,
                              self.kv.spare_slot, rows, out.accepted, out.tokens)
        move_kv(self.kv.stack, *outcome.moves)
        self._gather_draft_inputs(desc, max_rows=n)
        spec = self.speculator
        follow_tree_paths(outcome.path_tokens, outcome.accepted, outcome.tokens, rows, b.positions, spec.next_ids,
                          self.draft_last_indices, self.draft_base_positions)
        spec.propose_tree_in_graph(desc, (padded_hidden, padded_aux), metadata, outcome.moves,
                                   b.staged[NUM_REQS:NUM_REQS + 1], self.draft_last_indices, self.draft_base_positions,
                                   self.draft_block_table, out.drafts[:n])

    def _choose_path(self, desc: BatchDescriptor, sched: SchedulerOutput) -> StepPath:
        """The step's path (step_path.py), from its descriptor, its requests and the graphs recorded."""
        rows = StepRows.of(sched)
        spec = self.speculator
        kind = (SpeculatorKind.NONE if spec is None else
                SpeculatorKind.ON_DEVICE if spec.on_device else SpeculatorKind.ON_HOST)
        whole, greedy = self.whole_step_graphs, self.greedy_graphs
        graphs = GraphsReady(
            whole_step=whole is not None and not self.graphs.debug and whole.has_graph(desc),
            # Greedy verification graphs read the uniform batch's fixed inputs.
            greedy=greedy is not None and greedy.has_graph(desc) and (
                desc.query_len == 1 or self.uniform_verify is not None),
            drafting=kind is SpeculatorKind.ON_DEVICE and spec.has_drafting_graph(rows.num_sampling))
        return choose_step_path(desc, rows, graphs, kind, self.tree is not None)

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
    def launch(self, sched: SchedulerOutput) -> StepHandle:
        """Enqueue the whole step on the device (inputs, forward, sampling, drafts, the copy of the results to
        the host) without waiting for it; resolve() reads the results."""
        self.forget_requests(sched.finished + sched.preempted)
        ids, qlens, slens, rows, sampling, inflight = [], [], [], [], [], []
        # Per scheduled request, for the drafter: (first token, count, drafting index or -1, drafts verified,
        # the prompt's next token for a chunk that does not sample)
        draft_requests = []
        offset = 0
        for i, s in enumerate(sched.scheduled):
            req, start, n = s.request, s.start, s.num_new_tokens
            if s.from_device:
                prev_row, prev_drafts = self._previous[req.request_id]
                inflight.append((i, prev_row, offset, n, prev_drafts))
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
                draft_requests.append((offset, n, len(sampling), len(s.spec_token_ids), 0))
                sampling.append(i)
            else:
                draft_requests.append((offset, n, -1, 0, req.all_token_ids[start + n]))
            offset += n
        drafts_on_device = self.speculator is not None and self.speculator.on_device
        plan = StepPlan.build(sched, sampling, draft_requests, inflight, drafts_on_device, self._row,
                              trees=self.tree is not None)
        self._tree_step = None
        metadata = self.buffers.prepare(np.array(ids, dtype=np.int64), np.array(qlens, dtype=np.int64),
                                        np.array(slens, dtype=np.int64), self.host_block_table.gather(rows),
                                        self.block_size, plan.extras, *self._tree_layout(sched, offset))
        b = self.buffers
        desc = self.dispatch(offset, qlens)
        path = self._choose_path(desc, sched)
        handle = StepHandle(sched, sampling, path)
        self._previous = {sched.scheduled[i].request.request_id: (i, len(sched.scheduled[i].spec_token_ids))
                          for i in sampling}
        if path.whole is not WholeStep.NONE:
            self._forced_draws(desc, len(sampling))
            self.whole_step_graphs.run(desc, self._whole_step if path.whole is WholeStep.CHAIN else self._whole_tree_step,
                                       None)
            handle.host, handle.event = self.outputs.copy_to_host(len(sched.scheduled))
            return handle
        b.spread()
        if inflight:
            take_inflight_inputs(b.staged, self.outputs.accepted, self.outputs.tokens, self.outputs.drafts,
                                 b.input_ids, b.positions, b.seq_lens, b.slot_mapping, b.block_table, self.block_size,
                                 max_rows=len(inflight))
        (padded_hidden, padded_aux), metadata = self._run_target(desc, metadata)
        hidden = padded_hidden[:offset]
        if not sampling:
            return handle
        if path.sampling is not Sampling.NONE:
            self._sample(hidden, sched, plan.sample_rows, handle, desc, path.sampling)
        if path.verification in (Verification.TREE_ARGMAX, Verification.TREE_LOGITS):
            self._verify_tree(hidden, sched, plan.verify_rows, handle, path.verification)
        elif path.verification is not Verification.NONE:
            self._verify(hidden, sched, plan.verify_rows, handle, desc, path.verification)
        if path.drafts_on_device:
            self._propose(sched, sampling, desc, (padded_hidden, padded_aux), metadata, path.drafting)
        handle.host, handle.event = self.outputs.copy_to_host(len(sched.scheduled))
        return handle

    def _tree_layout(self, sched: SchedulerOutput, num_tokens: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(position shift, tree bits) of each token (InputBuffers.prepare) when drafting trees: a verifying
        request's last 1 + n tokens are the root and the first n drafts of the tree."""
        if self.tree is None:
            return None, None
        shift = np.zeros(num_tokens, dtype=np.int64)
        bits = np.full(num_tokens, -1, dtype=np.int64)
        end = 0
        for s in sched.scheduled:
            end += s.num_new_tokens
            n = len(s.spec_token_ids) + 1
            if s.samples and n > 1:
                shift[end - n:end] = self._tree_shift[:n]
                bits[end - n:end] = self._tree_bits[:n]
        return shift, bits

    def _forced_draws(self, desc: BatchDescriptor, n: int) -> None:
        """Under forced acceptance, the uniform draws a verification graph reads, from the generator the eager
        verification draws them from."""
        if self.forced_acceptance_prob is not None and desc.query_len > 1:
            torch.rand(n, desc.query_len - 1, generator=self.sampler.default_generator,
                       out=self.uniform_verify.uniform[:n])

    def resolve(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a launched step and return its tokens (and drafts) on the host."""
        out = RunnerOutput()
        if not handle.sampling:
            return out
        if handle.event is not None:
            handle.event.synchronize()
        table = handle.host.tolist()
        k = self.outputs.max_accepted
        scheduled = handle.sched.scheduled
        for i in handle.sampling:
            row = table[i]
            rid = scheduled[i].request.request_id
            out.sampled[rid] = row[1:row[0] + 2]
            if handle.path.drafts_on_device:
                out.drafts[rid] = row[k + 2:]
        for logprobs in handle.logprobs:
            logprobs.collect(table, handle.sched, out.logprobs)
        if handle.path.drafting is Drafting.ON_HOST:
            reqs = [scheduled[i].request for i in handle.sampling]
            contexts = [r.all_token_ids + out.sampled[r.request_id] for r in reqs]
            for req, d in zip(reqs, self.speculator.propose_from_contexts(contexts)):
                out.drafts[req.request_id] = d
        return out

    def _sample(self, hidden, sched: SchedulerOutput, batch_rows: list[int], handle: StepHandle,
                desc: BatchDescriptor, how: Sampling) -> None:
        """The token of each request that samples without drafts. Only the sampler applies penalties and
        min_tokens."""
        if how is Sampling.GREEDY_GRAPH:
            self.greedy_graphs.run(desc, self._greedy_outputs, None)
            return
        h = hidden.index_select(0, self.buffers.staged_extra("sample_index"))
        if how is Sampling.ARGMAX:
            result = SamplerOutput(self.model.greedy_tokens(h))
        else:
            batch = SamplingBatch.build([sched.scheduled[i].request for i in batch_rows], self.device)
            result = self.sampler(self.model.compute_logits(h), batch)
        where = self.buffers.staged_extra("sample_rows")
        self.outputs.accepted.index_fill_(0, where, 0)
        self.outputs.tokens[:, 0].index_copy_(0, where, result.token_ids)
        if result.sampled_logprobs is not None:
            handle.logprobs.append(PendingLogprobs.start(result, batch_rows, per_request=1))

    def _verify(self, hidden, sched: SchedulerOutput, batch_rows: list[int], handle: StepHandle,
                desc: BatchDescriptor, how: Verification) -> None:
        """Verify each request's chain of drafts against the target's argmax (greedy) or its logits (rejection
        sampling) at the verified positions. The drafts are read from the step's input ids on the device,
        where the host or the previous step (asynchronous scheduling) put them."""
        forced = self.forced_acceptance_prob
        if how is Verification.GREEDY_GRAPH:
            self._forced_draws(desc, len(batch_rows))
            self.greedy_graphs.run(desc, self._greedy_outputs, None)
            return
        b = self.buffers
        index, num, where = b.staged_extra("verify_index"), b.staged_extra("verify_drafts"), b.staged_extra("verify_rows")
        n, k = index.shape[0], index.shape[1] - 1
        verified = hidden.index_select(0, index.view(-1))
        if how is Verification.GREEDY:
            target = self.model.greedy_tokens(verified).view(n, k + 1)
            uniform = None if forced is None else torch.rand(n, k, device=self.device,
                                                             generator=self.sampler.default_generator)
            greedy_verify(target, b.input_ids, index, num, where, self.outputs.accepted, self.outputs.tokens,
                          uniform, forced)
            return
        reqs = [sched.scheduled[i].request for i in batch_rows]
        batch = SamplingBatch.build(reqs, self.device)
        logits = self.model.compute_logits(verified).view(n, k + 1, -1)
        if batch.all_greedy:
            target_probs = logits
        else:
            expanded = SamplingBatch.build([r for r in reqs for _ in range(k + 1)], self.device)
            target_probs = filtered_probs(logits.flatten(0, 1), expanded).view_as(logits)
        slots = torch.arange(k, device=self.device)
        drafts = torch.where(slots < num[:, None], b.input_ids[index[:, 1:]], -1)
        draft_probs = None
        if self.speculator.draft_probs is not None and not batch.all_greedy:
            draft_probs = self.speculator.draft_probs[b.staged_extra("verify_draft_rows"), :k]
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
                     how: Verification) -> None:
        """Verify each request's tree of drafts (tree_verify.py): the target's token at every node, argmax or
        sampled, then the walk from the root; then move the accepted nodes' keys and values to their
        positions' slots. Keeps the accepted paths and the moves for the drafter (self._tree_step)."""
        b, tables = self.buffers, self.tree_tables
        index, num, where = b.staged_extra("verify_index"), b.staged_extra("verify_drafts"), b.staged_extra("verify_rows")
        n, width = index.shape[0], index.shape[1]
        verified = hidden.index_select(0, index.view(-1))
        batch = None
        if how is Verification.TREE_ARGMAX:
            target = self.model.greedy_tokens(verified).view(n, width)
        else:
            reqs = [sched.scheduled[i].request for i in batch_rows]
            batch = SamplingBatch.build(reqs, self.device)
            logits = self.model.compute_logits(verified)
            target = greedy_argmax(logits)
            if not batch.all_greedy:
                expanded = SamplingBatch.build([r for r in reqs for _ in range(width)], self.device)
                sampled = sample_from_probs(filtered_probs(logits, expanded), expanded.generators,
                                            self.sampler.default_generator)
                target = torch.where(expanded.greedy, target, sampled)
            target = target.view(n, width)
        outcome = verify_tree(target, b.input_ids, index, num, tables, b.slot_mapping, self.kv.spare_slot,
                              where, self.outputs.accepted, self.outputs.tokens)
        move_kv(self.kv.stack, *outcome.moves)
        self._tree_step = outcome
        if batch is not None and batch.max_logprobs is not None:
            path_tokens = outcome.path_tokens
            raw = self.model.compute_logits(hidden.index_select(0, path_tokens.view(-1))).log_softmax(dim=-1)
            result = token_logprobs(raw, outcome.tokens.flatten().clamp(min=0), batch.max_logprobs)
            handle.logprobs.append(PendingLogprobs.start(result, batch_rows, per_request=path_tokens.shape[1]))

    def _gather_draft_inputs(self, desc: BatchDescriptor, max_rows: int) -> None:
        """The drafter's inputs from this step's outputs (draft_inputs.py), padded to desc."""
        b = self.buffers
        gather_draft_inputs(b.staged, self.outputs.accepted, self.outputs.tokens, b.input_ids, b.positions,
                            b.block_table, desc.num_tokens, desc.num_reqs, self.speculator.next_ids,
                            self.draft_last_indices, self.draft_last_tokens, self.draft_base_positions,
                            self.draft_block_table, max_rows)

    def _propose(self, sched, sampling, desc, target_out, metadata, drafting: Drafting) -> None:
        """Draft the next tokens of every request that produced tokens this step, on the device: each
        request's last accepted token and its position follow from the accepted counts just written."""
        spec, b = self.speculator, self.buffers
        n = len(sampling)
        scheduled = [sched.scheduled[i] for i in sampling]
        self._gather_draft_inputs(desc, max_rows=len(sched.scheduled))
        moves = None
        if self.tree is not None and self._tree_step is not None:
            outcome = self._tree_step
            moves = outcome.moves
            follow_tree_paths(outcome.path_tokens, outcome.accepted, outcome.tokens, b.staged_extra("verify_slots"),
                              b.positions, spec.next_ids, self.draft_last_indices, self.draft_base_positions)
        requests = [s.request for s in scheduled]
        inp = DraftInput(
            target_out=target_out,
            descriptor=desc,
            metadata=metadata,
            requests=requests,
            last_token_indices=self.draft_last_indices[:n],
            base_positions=self.draft_base_positions,
            max_base_position=max(s.start + s.num_new_tokens - 1 for s in scheduled),
            last_tokens=self.draft_last_tokens[:n],
            block_table=self.draft_block_table,
            rows=b.staged_extra("draft_rows"),
            sampling=SamplingBatch.build(requests, self.device),
            drafting=drafting,
            kv_moves=moves,
        )
        drafts = spec.propose(inp)
        if sampling[-1] == n - 1:  # rows 0..n-1: every scheduled request drafts
            self.outputs.drafts[:n].copy_(drafts)
        else:
            self.outputs.drafts.index_copy_(0, b.staged_extra("sampling_rows"), drafts)

