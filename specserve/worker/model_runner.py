"""Runs one scheduled step: inputs into persistent buffers, target forward, sampling."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from specserve.config import EngineConfig
from specserve.engine.scheduler import SchedulerOutput
from specserve.models.arch_config import ArchConfig
from specserve.outputs import Logprob
from specserve.sample.sampler import Sampler, SamplingBatch, filtered_probs, token_logprobs
from specserve.spec_decode.config import MAX_SPECULATIVE_TOKENS
from specserve.spec_decode.rejection_sampler import draw_randomness, rejection_sample
from specserve.spec_decode.speculator import DraftInput, Speculator
from specserve.transfer import to_device
from specserve.worker.cudagraph import BatchDescriptor, CUDAGraphManager, default_capture_sizes
from specserve.worker.cudagraph_mode import CUDAGraphMode
from specserve.worker.graph_recorder import AttentionSplitter
from specserve.worker.inflight_inputs import take_inflight_inputs
from specserve.worker.input_buffers import InputBuffers
from specserve.worker.step_handle import PendingLogprobs, StepHandle
from specserve.worker.step_outputs import StepOutputs

logger = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    # request id -> tokens produced this step (one, or accepted drafts + one)
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # request id -> one logprob dict per produced token
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    # request id -> draft tokens proposed for the next step
    drafts: dict[str, list[int]] = field(default_factory=dict)


def kv_block_bytes(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * block_size * arch.num_kv_heads * arch.head_dim * elem * arch.num_layers


class ModelRunner:
    def __init__(self, model: torch.nn.Module, arch: ArchConfig, config: EngineConfig):
        self.model = model
        self.arch = arch
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.num_blocks = config.num_kv_blocks or max(
            2, int(config.kv_cache_memory_gb * 2**30) // kv_block_bytes(arch, self.block_size, self.dtype)
        )
        self.kv_caches = self.allocate_kv_caches(arch)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", self.num_blocks, self.block_size,
                    self.num_blocks * kv_block_bytes(arch, self.block_size, self.dtype) / 2**30)
        # Room for the context plus draft lookahead slots.
        max_blocks_per_req = -(-(config.max_model_len + MAX_SPECULATIVE_TOKENS) // self.block_size) + 1
        self.buffers = InputBuffers(config.max_num_seqs, config.max_num_batched_tokens, max_blocks_per_req, self.device)
        spec = config.speculative_config
        self.outputs = StepOutputs(config.max_num_seqs, spec.num_speculative_tokens if spec else 0, self.device)
        # Request id -> (its batch row, drafts verified) in the last launched step, for a step scheduled
        # before that one's results were back.
        self._previous: dict[str, tuple[int, int]] = {}
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(generator)
        self.speculator: Speculator | None = None
        self.forced_acceptance_prob: float | None = None
        # Each running request owns one row of per-request persistent state (the draft-probability buffer).
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self.graphs: CUDAGraphManager | None = None
        self.capture_seconds: float | None = None
        self.graph_memory_bytes: int | None = None

    def allocate_kv_caches(self, arch: ArchConfig, num_layers: int | None = None) -> list[torch.Tensor]:
        """Paged KV caches in the runner's block layout (the target's, or a drafter's over the same blocks)."""
        shape = (2, self.num_blocks, self.block_size, arch.num_kv_heads, arch.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers or arch.num_layers)]

    def set_speculator(self, speculator: Speculator, forced_acceptance_prob: float | None) -> None:
        self.speculator = speculator
        self.forced_acceptance_prob = forced_acceptance_prob
        self.model.aux_hidden_layers = speculator.aux_hidden_layers
        n = self.config.max_num_seqs
        self.draft_base_positions = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.draft_block_table = torch.zeros_like(self.buffers.block_table)

    def capture_graphs(self, mode: CUDAGraphMode, recorder, backend) -> None:
        """Record the target's graphs for `mode`, then the speculator's, all through `recorder`
        (one memory pool). `backend` is the attention backend the models were built with."""
        cfg = self.config
        splitter = AttentionSplitter(backend)
        splitter.install(self.model)
        k = getattr(self.speculator, "num_speculative_tokens", 0)
        sizes = cfg.cudagraph_capture_sizes or default_capture_sizes(min(256, cfg.max_num_batched_tokens))
        self.graphs = CUDAGraphManager(
            "target", mode, sizes, cfg.max_num_seqs, cfg.max_num_batched_tokens,
            uniform_query_lens=(1, 1 + k) if k else (1,), recorder=recorder, debug=cfg.debug_cudagraph,
            splitter=splitter)
        start, used_before = time.perf_counter(), recorder.memory_in_use()
        self.graphs.capture(self._target_forward, self._prepare_capture)
        if self.speculator is not None and hasattr(self.speculator, "capture_graphs"):
            self.speculator.capture_graphs(self.graphs, splitter, recorder, sizes, cfg.debug_cudagraph,
                                           self._prepare_capture, self.draft_base_positions, self.draft_block_table)
        self.buffers.reset()
        self.capture_seconds = time.perf_counter() - start
        self.graph_memory_bytes = recorder.memory_in_use() - used_before
        logger.info("CUDA graphs (%s): captured in %.1f s, %.0f MiB of GPU memory", mode.name, self.capture_seconds,
                    self.graph_memory_bytes / 2**20)

    def _prepare_capture(self, desc: BatchDescriptor):
        # Recording executes nothing but the warm-up run, which must write no cache slot: every row is empty.
        self.buffers.reset()
        max_query_len = desc.query_len or desc.num_tokens
        return self.buffers.padded_metadata(desc.num_reqs, desc.num_tokens, max_query_len, self.config.max_model_len)

    def _target_forward(self, desc: BatchDescriptor, metadata):
        n = desc.num_tokens
        return self.model(self.buffers.input_ids[:n], self.buffers.positions[:n], self.kv_caches, metadata)

    def _run_target(self, num_tokens: int, query_lens: list[int], metadata):
        """Target forward for this step, replayed from a graph where one fits. Returns the descriptor
        and the forward's outputs over the descriptor's (padded) tokens."""
        uniform = query_lens[0] if all(q == query_lens[0] for q in query_lens) else None
        if self.graphs is None:
            desc = BatchDescriptor(CUDAGraphMode.NONE, num_tokens, len(query_lens), uniform)
            return desc, self._target_forward(desc, metadata), metadata
        desc = self.graphs.dispatch(num_tokens, len(query_lens), uniform)
        if desc.mode is CUDAGraphMode.PIECEWISE:
            # Attention runs eagerly over the padded tokens; padded ones belong to no request.
            metadata = replace(metadata, num_tokens=desc.num_tokens,
                               slot_mapping=self.buffers.slot_mapping[: desc.num_tokens])
        return desc, self.graphs.run(desc, self._target_forward, metadata), metadata

    def _release_rows(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            row = self.rows.pop(rid, None)
            if row is not None:
                self.free_rows.append(row)
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
        self._release_rows(sched.finished + sched.preempted)
        ids, pos, qlens, slens, rows, sample_ends, sampling, inflight = [], [], [], [], [], [], [], []
        # (index of the last token, the prompt token after it) of each prompt chunk that does not sample
        chunk_ends = []
        offset = 0
        for i, s in enumerate(sched.scheduled):
            req, start, n = s.request, s.start, s.num_new_tokens
            if s.from_device:
                prev_row, prev_drafts = self._previous[req.request_id]
                inflight.append((i, prev_row, offset, n, prev_drafts))
                ids.append([0] * n)
            else:
                known = req.all_token_ids
                ids.append(known[start:start + n] if start + n <= len(known)
                           else (known + s.spec_token_ids)[start:start + n])
            pos.append(np.arange(start, start + n))
            qlens.append(n)
            slens.append(start + n)
            rows.append(s.block_ids)
            offset += n
            if s.samples:
                sample_ends.append(offset)
                sampling.append(i)
            else:
                chunk_ends.append((offset - 1, req.all_token_ids[start + n]))
        input_ids = np.fromiter((t for chunk in ids for t in chunk), dtype=np.int64, count=offset)
        metadata = self.buffers.prepare(input_ids, np.concatenate(pos).astype(np.int64), np.array(qlens, dtype=np.int64),
                                        np.array(slens, dtype=np.int64), rows, self.block_size)
        if inflight:
            b = self.buffers
            take_inflight_inputs(b.upload("inflight", np.array(inflight, dtype=np.int32)), self.outputs.accepted,
                                 self.outputs.tokens, self.outputs.drafts, b.input_ids, b.positions, b.seq_lens,
                                 b.slot_mapping, b.block_table, self.block_size)
        desc, (padded_hidden, padded_aux), metadata = self._run_target(offset, qlens, metadata)
        hidden = padded_hidden[:offset]
        handle = StepHandle(sched, sampling)
        self._previous = {sched.scheduled[i].request.request_id: (i, len(sched.scheduled[i].spec_token_ids))
                          for i in sampling}
        if not sampling:
            return handle
        # Requests without drafts take the plain sampler, which also applies penalties and min_tokens.
        for verify in (False, True):
            chosen = [(i, end) for i, end in zip(sampling, sample_ends) if bool(sched.scheduled[i].spec_token_ids) == verify]
            if chosen:
                batch_rows, ends = map(list, zip(*chosen))
                (self._verify if verify else self._sample)(hidden, sched, batch_rows, ends, handle)
        if self.speculator is not None and self.speculator.on_device:
            self._propose(sched, sampling, sample_ends, chunk_ends, offset, desc, (padded_hidden, padded_aux), metadata)
        handle.host, handle.event = self.outputs.copy_to_host(len(sched.scheduled))
        return handle

    def resolve(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a launched step and return its tokens (and drafts) on the host."""
        out = RunnerOutput()
        if not handle.sampling:
            return out
        if handle.event is not None:
            handle.event.synchronize()
        table = handle.host.tolist()
        k = self.outputs.num_drafts
        scheduled = handle.sched.scheduled
        for i in handle.sampling:
            row = table[i]
            rid = scheduled[i].request.request_id
            out.sampled[rid] = row[1:row[0] + 2]
            if self.speculator is not None and self.speculator.on_device:
                out.drafts[rid] = row[k + 2:]
        for logprobs in handle.logprobs:
            logprobs.collect(table, handle.sched, out.logprobs)
        if self.speculator is not None and not self.speculator.on_device:
            reqs = [scheduled[i].request for i in handle.sampling]
            contexts = [r.all_token_ids + out.sampled[r.request_id] for r in reqs]
            for req, d in zip(reqs, self.speculator.propose_from_contexts(contexts)):
                out.drafts[req.request_id] = d
        return out

    def _sample(self, hidden, sched: SchedulerOutput, batch_rows: list[int], sample_ends: list[int],
                handle: StepHandle) -> None:
        reqs = [sched.scheduled[i].request for i in batch_rows]
        idx = self.buffers.upload("logits_indices", np.array(sample_ends, dtype=np.int64) - 1)
        result = self.sampler(self.model.compute_logits(hidden[idx]), SamplingBatch.build(reqs, self.device))
        where = to_device(batch_rows, self.device)
        self.outputs.accepted.index_fill_(0, where, 0)
        self.outputs.tokens[:, 0].index_copy_(0, where, result.token_ids)
        if result.sampled_logprobs is not None:
            handle.logprobs.append(PendingLogprobs.start(result, batch_rows, per_request=1))

    def _verify(self, hidden, sched: SchedulerOutput, batch_rows: list[int], sample_ends: list[int],
                handle: StepHandle) -> None:
        """Rejection-sample each request's drafts against the target's logits at the verified positions.
        The drafts are read from the step's input ids on the device, where the host or the previous
        step (asynchronous scheduling) put them."""
        scheduled = [sched.scheduled[i] for i in batch_rows]
        reqs = [s.request for s in scheduled]
        num_drafts = [len(s.spec_token_ids) for s in scheduled]
        k = max(num_drafts)
        # Row j of request i is the target's prediction after its j-th draft (clamped for padding); its
        # draft j sits at token end - n + j.
        index = np.array([[end - 1 - n + min(j, n) for j in range(k + 1)] for end, n in zip(sample_ends, num_drafts)])
        idx = to_device(index.reshape(-1), self.device)
        logits = self.model.compute_logits(hidden[idx]).view(len(reqs), k + 1, -1)
        batch = SamplingBatch.build(reqs, self.device)
        if batch.all_greedy:
            target_probs = logits
        else:
            expanded = SamplingBatch.build([r for r in reqs for _ in range(k + 1)], self.device)
            target_probs = filtered_probs(logits.flatten(0, 1), expanded).view_as(logits)
        num = to_device(num_drafts, self.device)
        slots = torch.arange(k, device=self.device)
        drafts = torch.where(slots < num[:, None], self.buffers.input_ids[idx.view(len(reqs), k + 1)[:, 1:]], -1)
        draft_probs = None
        if self.speculator.draft_probs is not None and not batch.all_greedy:
            rows = to_device([self._row(r.request_id) for r in reqs], self.device)
            draft_probs = self.speculator.draft_probs[rows, :k]
        if batch.all_greedy and self.forced_acceptance_prob is None:
            # Greedy rows read no randomness: skip drawing [N, k+1, V] exponentials (an expanded view
            # of one value costs no memory).
            uniform = torch.zeros(len(reqs), k, device=self.device)
            noise = torch.ones(1, 1, 1, device=self.device).expand(len(reqs), k + 1, logits.shape[-1])
        else:
            uniform, noise = draw_randomness(len(reqs), k, logits.shape[-1], batch.generators, self.device,
                                             self.sampler.default_generator)
        tokens, accepted = rejection_sample(drafts, num, draft_probs, target_probs, batch.greedy,
                                            logits.argmax(dim=-1), uniform, noise, self.forced_acceptance_prob)
        where = to_device(batch_rows, self.device)
        self.outputs.accepted.index_copy_(0, where, accepted)
        self.outputs.tokens[:, :k + 1].index_copy_(0, where, tokens)
        if batch.max_logprobs is not None:
            raw = logits.flatten(0, 1).log_softmax(dim=-1)
            result = token_logprobs(raw, tokens.flatten().clamp(min=0), batch.max_logprobs)
            handle.logprobs.append(PendingLogprobs.start(result, batch_rows, per_request=k + 1))

    def _propose(self, sched, sampling, sample_ends, chunk_ends, num_tokens, desc, target_out, metadata) -> None:
        """Draft the next tokens of every request that produced tokens this step, on the device: each
        request's last accepted token and its position follow from the accepted counts just written."""
        spec, dev = self.speculator, self.device
        n = len(sampling)
        scheduled = [sched.scheduled[i] for i in sampling]
        where = to_device(sampling, dev)
        accepted = self.outputs.accepted.index_select(0, where)
        # The last accepted token of request i is at index end - 1 - drafts + accepted.
        last_idx = to_device([end - 1 - len(s.spec_token_ids) for s, end in zip(scheduled, sample_ends)], dev) + accepted
        emitted = self.outputs.tokens.index_select(0, where).gather(1, accepted.unsqueeze(1)).squeeze(1)
        # Each position's next token: the following input, the prompt's next token at the end of a prompt
        # chunk, the newly emitted token at a request's last accepted position.
        next_ids = torch.roll(self.buffers.input_ids[:num_tokens], -1)
        if chunk_ends:
            at, values = zip(*chunk_ends)
            next_ids[to_device(at, dev)] = to_device(values, dev)
        next_ids[last_idx] = emitted
        self.draft_base_positions[:n].copy_(self.buffers.positions[last_idx])
        self.draft_block_table[:n].copy_(metadata.block_table.index_select(0, where))
        drafting = [s.request for s in scheduled]
        inp = DraftInput(
            next_ids=next_ids,
            target_out=target_out,
            descriptor=desc,
            metadata=metadata,
            requests=drafting,
            last_token_indices=last_idx,
            base_positions=self.draft_base_positions,
            max_base_position=max(s.start + s.num_new_tokens - 1 for s in scheduled),
            last_tokens=emitted,
            block_table=self.draft_block_table,
            rows=to_device([self._row(r.request_id) for r in drafting], dev),
            sampling=SamplingBatch.build(drafting, dev),
        )
        self.outputs.drafts.index_copy_(0, where, spec.propose(inp))
