"""Speculation with a smaller language model that shares the target's tokenizer.

Its prefill runs the tokens the target just ran (filling its own KV cache in
the same blocks); each decode step then feeds the newest token and drafts one.
"""
from __future__ import annotations

import torch

from specserve.spec_decode.model_drafter import ModelDrafter
from specserve.spec_decode.speculator import DraftInput


class DraftModelSpeculator(ModelDrafter):
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], **kw):
        super().__init__(**kw)
        self.model = model
        self.kv_caches = kv_caches

    def prefill(self, inp: DraftInput):
        self.model(inp.input_ids, inp.positions, self.kv_caches, inp.metadata)
        return None, None

    def decode(self, tokens, feedback, positions, metadata):
        hidden, _ = self.model(tokens, positions, self.kv_caches, metadata)
        return self.model.compute_logits(hidden), None
