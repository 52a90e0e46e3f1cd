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
from specserve.worker.cudagraph import BatchDescriptor, CUDAGraphManager, default_capture_sizes
from specserve.worker.cudagraph_mode import CUDAGraphMode
from specserve.worker.graph_recorder import AttentionSplitter
from specserve.worker.input_buffers import InputBuffers

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
        self._release_rows(sched.finished + sched.preempted)
        ids, pos, qlens, slens, rows, sample_ends, sampling = [], [], [], [], [], [], []
        offset = 0
        for i, s in enumerate(sched.scheduled):
            req = s.request
            start = req.num_computed_tokens
            ids.append((req.all_token_ids + s.spec_token_ids)[start:start + s.num_new_tokens])
            pos.append(np.arange(start, start + s.num_new_tokens))
            qlens.append(s.num_new_tokens)
            slens.append(start + s.num_new_tokens)
            rows.append(s.block_ids)
            offset += s.num_new_tokens
            if s.samples:
                sample_ends.append(offset)
                sampling.append(i)
        input_ids = np.fromiter((t for chunk in ids for t in chunk), dtype=np.int64, count=offset)
        metadata = self.buffers.prepare(input_ids, np.concatenate(pos).astype(np.int64), np.array(qlens, dtype=np.int64),
                                        np.array(slens, dtype=np.int64), rows, self.block_size)
        desc, (padded_hidden, padded_aux), metadata = self._run_target(offset, qlens, metadata)
        hidden = padded_hidden[:offset]
        out = RunnerOutput()
        if not sampling:
            return out
        # Requests without drafts take the plain sampler, which also applies penalties and min_tokens.
        for verify in (False, True):
            chosen = [(sched.scheduled[i], end) for i, end in zip(sampling, sample_ends)
                      if bool(sched.scheduled[i].spec_token_ids) == verify]
            if chosen:
                (self._verify if verify else self._sample)(hidden, *map(list, zip(*chosen)), out)
        if self.speculator is not None:
            self._propose(sched, sampling, sample_ends, input_ids, desc, (padded_hidden, padded_aux), metadata, out)
        return out

    def _sample(self, hidden, scheduled, sample_ends, out: RunnerOutput) -> None:
        reqs = [s.request for s in scheduled]
        idx = self.buffers.upload("logits_indices", np.array(sample_ends, dtype=np.int64) - 1)
        result = self.sampler(self.model.compute_logits(hidden[idx]), SamplingBatch.build(reqs, self.device))
        tokens = result.token_ids.tolist()
        for req, t in zip(reqs, tokens):
            out.sampled[req.request_id] = [t]
        if result.sampled_logprobs is not None:
            self._collect_logprobs(result, [[r] for r in reqs], out)

    def _verify(self, hidden, scheduled, sample_ends, out: RunnerOutput) -> None:
        """Rejection-sample each request's drafts against the target's logits at the verified positions."""
        reqs = [s.request for s in scheduled]
        num_drafts = [len(s.spec_token_ids) for s in scheduled]
        k = max(num_drafts)
        # Row j of request i is the target's prediction after its j-th draft (clamped for padding).
        index = np.array([[end - 1 - n + min(j, n) for j in range(k + 1)] for end, n in zip(sample_ends, num_drafts)])
        idx = torch.from_numpy(index.reshape(-1)).to(self.device)
        logits = self.model.compute_logits(hidden[idx]).view(len(reqs), k + 1, -1)
        batch = SamplingBatch.build(reqs, self.device)
        if batch.all_greedy:
            target_probs = logits
        else:
            expanded = SamplingBatch.build([r for r in reqs for _ in range(k + 1)], self.device)
            target_probs = filtered_probs(logits.flatten(0, 1), expanded).view_as(logits)
        drafts = torch.tensor([s.spec_token_ids + [-1] * (k - len(s.spec_token_ids)) for s in scheduled],
                              dtype=torch.int64, device=self.device)
        draft_probs = None
        if self.speculator.draft_probs is not None and not batch.all_greedy:
            rows = torch.tensor([self._row(r.request_id) for r in reqs], device=self.device)
            draft_probs = self.speculator.draft_probs[rows, :k]
        if batch.all_greedy and self.forced_acceptance_prob is None:
            # Greedy rows read no randomness: skip drawing [N, k+1, V] exponentials (an expanded view
            # of one value costs no memory).
            uniform = torch.zeros(len(reqs), k, device=self.device)
            noise = torch.ones(1, 1, 1, device=self.device).expand(len(reqs), k + 1, logits.shape[-1])
        else:
            uniform, noise = draw_randomness(len(reqs), k, logits.shape[-1], batch.generators, self.device,
                                             self.sampler.default_generator)
        tokens, accepted = rejection_sample(
            drafts, torch.tensor(num_drafts, device=self.device), draft_probs, target_probs, batch.greedy,
            logits.argmax(dim=-1), uniform, noise, self.forced_acceptance_prob)
        # One device-to-host copy for both (each copy is a host sync).
        packed = torch.cat((tokens, accepted.unsqueeze(1)), dim=1).tolist()
        tokens, accepted = [row[:-1] for row in packed], [row[-1] for row in packed]
        for req, row, a in zip(reqs, tokens, accepted):
            out.sampled[req.request_id] = row[:a + 1]
        if batch.max_logprobs is not None:
            emitted = [(i, j) for i, a in enumerate(accepted) for j in range(a + 1)]
            sel = torch.tensor(emitted, device=self.device)
            raw = logits[sel[:, 0], sel[:, 1]].log_softmax(dim=-1)
            chosen = torch.tensor([tokens[i][j] for i, j in emitted], device=self.device)
            per_req = [[reqs[i] for i, _ in emitted if i == r] for r in range(len(reqs))]
            self._collect_logprobs(token_logprobs(raw, chosen, batch.max_logprobs), per_req, out)

    def _propose(self, sched, sampling, sample_ends, input_ids, desc, target_out, metadata, out: RunnerOutput) -> None:
        """Draft the next tokens of every request that produced tokens this step."""
        spec = self.speculator
        drafting, last_idx, base, contexts, max_drafts = [], [], [], [], []
        next_ids = np.roll(input_ids, -1)
        for i, end in zip(sampling, sample_ends):
            s = sched.scheduled[i]
            req = s.request
            new = out.sampled[req.request_id]
            last = end - 1 - len(s.spec_token_ids) + (len(new) - 1)
            next_ids[last] = new[-1]
            # Penalties and min_tokens depend on every earlier token, so such requests decode one token at a time.
            if req.params.uses_penalties or req.num_output_tokens + len(new) < req.params.min_tokens:
                continue
            context = req.all_token_ids + new
            room = self.config.max_model_len - len(context)
            if room <= 0:
                continue
            drafting.append(req)
            last_idx.append(last)
            base.append(req.num_computed_tokens + s.num_new_tokens - len(s.spec_token_ids) - 1 + len(new) - 1)
            contexts.append(context)
            max_drafts.append(min(spec.num_speculative_tokens, room))
        # Positions whose next token is still a prompt token (prompt chunks) keep the rolled value;
        # a request's last position otherwise got its new token above.
        for i, s in enumerate(sched.scheduled):
            if not s.samples:
                end = int(metadata.query_start_loc_cpu[i + 1])
                req = s.request
                next_ids[end - 1] = req.all_token_ids[req.num_computed_tokens + s.num_new_tokens]
        if not drafting:
            return
        n = len(drafting)
        self.draft_base_positions[:n].copy_(torch.tensor(base))
        req_index = {id(s.request): i for i, s in enumerate(sched.scheduled)}
        table_rows = torch.tensor([req_index[id(r)] for r in drafting], device=self.device)
        self.draft_block_table[:n].copy_(metadata.block_table.index_select(0, table_rows))
        inp = DraftInput(
            next_ids=torch.from_numpy(next_ids).to(self.device),
            target_out=target_out,
            descriptor=desc,
            metadata=metadata,
            requests=drafting,
            contexts=contexts,
            last_token_indices=torch.tensor(last_idx, device=self.device),
            base_positions=self.draft_base_positions,
            base_positions_cpu=base,
            last_tokens=torch.tensor([c[-1] for c in contexts], device=self.device),
            block_table=self.draft_block_table,
            rows=torch.tensor([self._row(r.request_id) for r in drafting], device=self.device),
            sampling=SamplingBatch.build(drafting, self.device),
            max_drafts=max_drafts,
        )
        for req, d in zip(drafting, spec.propose(inp)):
            out.drafts[req.request_id] = d

    @staticmethod
    def _collect_logprobs(result, reqs_per_row: list[list], out: RunnerOutput) -> None:
        """result rows are emitted tokens in order; reqs_per_row[i] lists request i once per emitted token."""
        lp = result.sampled_logprobs.tolist()
        ranks = result.sampled_ranks.tolist()
        tokens = result.token_ids.tolist()
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        row = 0
        for reqs in reqs_per_row:
            for req in reqs:
                n = req.params.logprobs
                if n is not None:
                    entry = {tokens[row]: Logprob(lp[row], ranks[row])}
                    for r in range(n):
                        entry.setdefault(top_ids[row][r], Logprob(top_lp[row][r], r + 1))
                    out.logprobs.setdefault(req.request_id, []).append(entry)
                row += 1
