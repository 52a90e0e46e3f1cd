"""The EAGLE speculator (EAGLE-1 and EAGLE-3 heads).

Draft prefill: at every position the target just ran, the head reads the
target's hidden state there and the token that follows it, with the target's
attention metadata; its output at each request's last accepted position is
draft 1. Draft decode steps then feed back the head's own hidden state.
"""
from __future__ import annotations

import torch

from specserve.spec_decode.model_drafter import ModelDrafter
from specserve.spec_decode.tree_verify import move_kv
from specserve.worker.kv_layout import KVCacheLayout


class EagleSpeculator(ModelDrafter):
    uses_hidden_states = True

    def __init__(self, head: torch.nn.Module, **kw):
        super().__init__(feedback_size=head.cfg.hidden_size, **kw)
        self.head = head
        self.kv_layout = KVCacheLayout.of(head.cfg, num_layers=1)
        self.kv_cache: torch.Tensor | None = None
        self.aux_hidden_layers = head.aux_hidden_layers

    def bind_kv_cache(self, stack: torch.Tensor | None) -> None:
        self.kv_cache = None if stack is None else stack[0]

    def models(self) -> list[torch.nn.Module]:
        return [self.head]

    def prefill_forward(self, num_tokens, target_out, metadata):
        hidden, aux = target_out
        # EAGLE-3 reads the concatenated auxiliary layers; EAGLE-1 the final hidden state.
        target_hidden = torch.cat(aux, dim=-1) if self.aux_hidden_layers else hidden
        fed_back, for_logits = self.head(self.next_ids[:num_tokens], self.target_positions[:num_tokens],
                                         target_hidden[:num_tokens], self.kv_cache, metadata)
        return for_logits, fed_back

    def decode_hidden(self, tokens, feedback, positions, metadata):
        fed_back, for_logits = self.head(tokens, positions, feedback, self.kv_cache, metadata)
        return for_logits, fed_back

    def compute_logits(self, hidden):
        return self.head.compute_logits(hidden)

    def top_tokens(self, hidden, k, scatter=None):
        top = getattr(self.head, "top_tokens", None)
        return top(hidden, k, scatter) if top is not None else super().top_tokens(hidden, k, scatter)

    def tree_pass(self, tokens, feedback, parent_rows, positions, metadata, k, scatter):
        step = getattr(self.head, "tree_step", None)
        if step is None:
            return super().tree_pass(tokens, feedback, parent_rows, positions, metadata, k, scatter)
        fed_back, guesses = step(tokens, positions, feedback, parent_rows, self.kv_cache, metadata, k, scatter)
        return guesses, fed_back

    def move_kv(self, source, dest):
        move_kv(self.kv_cache.unsqueeze(0), source, dest)

    def greedy_tokens(self, hidden, captured=False):
        greedy = getattr(self.head, "greedy_tokens", None)
        return greedy(hidden, captured) if greedy is not None else super().greedy_tokens(hidden, captured)

    def greedy_decode_step(self, tokens, feedback, positions, metadata):
        step = getattr(self.head, "greedy_step", None)
        if step is None:
            return super().greedy_decode_step(tokens, feedback, positions, metadata)
        fed_back, drafts = step(tokens, positions, feedback, self.kv_cache, metadata, captured=True)
        return drafts, fed_back
