"""The EAGLE speculator (EAGLE-1 and EAGLE-3 heads).

Draft prefill: at every position the target just ran, the head reads the
target's hidden state there and the token that follows it, with the target's
attention metadata; its output at each request's last accepted position is
draft 1. Draft decode steps then feed back the head's own hidden state.
"""
from __future__ import annotations

import torch

from specserve.spec_decode.model_drafter import ModelDrafter
from specserve.spec_decode.speculator import DraftInput


class EagleSpeculator(ModelDrafter):
    uses_hidden_states = True

    def __init__(self, head: torch.nn.Module, kv_cache: torch.Tensor, **kw):
        super().__init__(**kw)
        self.head = head
        self.kv_cache = kv_cache
        self.aux_hidden_layers = head.aux_hidden_layers

    def prefill(self, inp: DraftInput):
        fed_back, for_logits = self.head(inp.next_ids, inp.positions, inp.hidden, self.kv_cache, inp.metadata)
        last = inp.last_token_indices
        return self.head.compute_logits(for_logits[last]), fed_back[last]

    def decode(self, tokens, feedback, positions, metadata):
        fed_back, for_logits = self.head(tokens, positions, feedback, self.kv_cache, metadata)
        return self.head.compute_logits(for_logits), fed_back
