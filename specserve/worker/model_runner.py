"""Runs one scheduled step: inputs into persistent buffers, target forward, sampling."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.config import EngineConfig
from specserve.engine.scheduler import SchedulerOutput
from specserve.models.arch_config import ArchConfig
from specserve.outputs import Logprob
from specserve.sample.sampler import Sampler, SamplingBatch
from specserve.worker.input_buffers import InputBuffers

logger = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    # request id -> tokens produced this step (one, or accepted drafts + one)
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # request id -> one logprob dict per produced token
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)


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
        shape = (2, self.num_blocks, self.block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(arch.num_layers)]
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", self.num_blocks, self.block_size,
                    self.num_blocks * kv_block_bytes(arch, self.block_size, self.dtype) / 2**30)
        max_blocks_per_req = -(-(config.max_model_len + self.block_size) // self.block_size)
        self.buffers = InputBuffers(config.max_num_seqs, config.max_num_batched_tokens, max_blocks_per_req, self.device)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(generator)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> RunnerOutput:
        ids, pos, qlens, slens, rows, sample_rows, sampling_reqs = [], [], [], [], [], [], []
        offset = 0
        for s in sched.scheduled:
            req = s.request
            start = req.num_computed_tokens
            tokens = (req.all_token_ids + s.spec_token_ids)[start:start + s.num_new_tokens]
            ids.append(tokens)
            pos.append(np.arange(start, start + s.num_new_tokens))
            qlens.append(s.num_new_tokens)
            slens.append(start + s.num_new_tokens)
            rows.append(s.block_ids)
            offset += s.num_new_tokens
            if s.samples:
                sample_rows.append(offset - 1)
                sampling_reqs.append(req)
        metadata = self.buffers.prepare(
            np.fromiter((t for chunk in ids for t in chunk), dtype=np.int64, count=offset),
            np.concatenate(pos).astype(np.int64),
            np.array(qlens, dtype=np.int64),
            np.array(slens, dtype=np.int64),
            rows,
            self.block_size,
        )
        hidden, _ = self.model(self.buffers.input_ids[:offset], self.buffers.positions[:offset], self.kv_caches, metadata)
        out = RunnerOutput()
        if not sampling_reqs:
            return out
        idx = self.buffers.upload("logits_indices", np.array(sample_rows, dtype=np.int64))
        logits = self.model.compute_logits(hidden[idx])
        result = self.sampler(logits, SamplingBatch.build(sampling_reqs, self.device))
        tokens = result.token_ids.tolist()
        for i, req in enumerate(sampling_reqs):
            out.sampled[req.request_id] = [tokens[i]]
        if result.sampled_logprobs is not None:
            self._collect_logprobs(result, sampling_reqs, tokens, out)
        return out

    @staticmethod
    def _collect_logprobs(result, reqs, tokens, out: RunnerOutput) -> None:
        lp = result.sampled_logprobs.tolist()
        ranks = result.sampled_ranks.tolist()
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        for i, req in enumerate(reqs):
            n = req.params.logprobs
            if n is None:
                continue
            entry = {tokens[i]: Logprob(lp[i], ranks[i])}
            for r in range(n):
                entry.setdefault(top_ids[i][r], Logprob(top_lp[i][r], r + 1))
            out.logprobs[req.request_id] = [entry]
