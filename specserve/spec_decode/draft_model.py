"""Speculation with a smaller language model that shares the target's tokenizer.

Its prefill runs the tokens the target just ran (filling its own KV cache in
the same blocks); each decode step then feeds the newest token and drafts one.
"""
from __future__ import annotations

import torch

from specserve.models.arch_config import ArchConfig
from specserve.spec_decode.model_drafter import ModelDrafter
from specserve.worker.kv_layout import KVCacheLayout


class DraftModelSpeculator(ModelDrafter):
    first_draft_from_prefill = False

    def __init__(self, model: torch.nn.Module, arch: ArchConfig, **kw):
        super().__init__(**kw)
        self.model = model
        self.kv_layout = KVCacheLayout.of(arch)
        self.kv_caches: list[torch.Tensor] = []

    def bind_kv_cache(self, stack: torch.Tensor | None) -> None:
        self.kv_caches = [] if stack is None else list(stack.unbind(0))

    def models(self) -> list[torch.nn.Module]:
        return [self.model]

    def prefill_forward(self, num_tokens, target_out, metadata):
        self.model(self.target_input_ids[:num_tokens], self.target_positions[:num_tokens], self.kv_caches, metadata)
        return None, None

    def decode_hidden(self, tokens, feedback, positions, metadata):
        hidden, _ = self.model(tokens, positions, self.kv_caches, metadata)
        return hidden, None

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)

    def greedy_tokens(self, hidden, captured=False):
        return self.model.greedy_tokens(hidden, captured)
