"""The target, run teacher-forced over whole sequences: the hidden states the head reads, and what the
target itself would say next at every position.

This is the engine's own model class (LlamaForCausalLM with aux_hidden_layers
set, as the runner sets it for an EAGLE-3 speculator) under plain causal
attention, so the head trains on the same layer inputs it is fed when serving.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.models.llama import Attention
from specserve.models.loader import build_model, open_model_source
from specserve.train.attention import CausalAttention, DenseBatch
from specserve.train.batches import Batch

# Rows of target logits computed at once: the full-vocabulary logits of a whole batch would take gigabytes.
_LOGIT_ROWS = 4096


def plain_torch(model: torch.nn.Module) -> None:
    """Turn off the fused GPU kernels of model's blocks (on by themselves on CUDA): they have no backward
    pass, and the fused attention path writes a paged KV cache that training does not have."""
    for m in model.modules():
        if getattr(m, "fused", False):
            m.fused = False


def attention_in_torch(model: torch.nn.Module) -> None:
    """Turn off only the fused attention path, which writes a paged KV cache that training does not have. The
    target runs without gradients, so its norms and SiLU keep the serving kernels, one pass each where plain
    torch makes several elementwise passes."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.fused = False


@dataclass
class TargetStates:
    aux: torch.Tensor  # [B * L, n_aux * hidden]: the auxiliary hidden states the head reads
    final: torch.Tensor  # [B * L, hidden]: the target's last normed hidden states, what its lm_head reads


@dataclass
class NextTokens:
    """The target's own prediction of the token after each position."""
    greedy: torch.Tensor  # [N] int64: its argmax over the whole vocabulary
    draft_probs: torch.Tensor  # [N, draft vocab] float32: its distribution renormalised over the draft vocabulary


class TargetFeatures:
    def __init__(self, target: str, aux_layers: tuple[int, ...], dtype: torch.dtype, device: str):
        self.model, self.arch = build_model(open_model_source(target), dtype, device, CausalAttention(), aux_layers)
        attention_in_torch(self.model)

    @torch.no_grad()
    def __call__(self, batch: Batch) -> TargetStates:
        b, n = batch.ids.shape
        positions = torch.arange(n, device=batch.ids.device).repeat(b)
        final, aux = self.model(batch.ids.flatten(), positions, [None] * self.arch.num_layers, DenseBatch(b, n))
        return TargetStates(torch.cat(aux, dim=-1), final)

    @torch.no_grad()
    def next_tokens(self, final: torch.Tensor, draft_to_target: torch.Tensor) -> NextTokens:
        greedy, probs = [], []
        for chunk in final.split(_LOGIT_ROWS):
            logits = self.model.compute_logits(chunk)
            greedy.append(logits.argmax(dim=-1))
            probs.append(torch.softmax(logits[:, draft_to_target], dim=-1))
        return NextTokens(torch.cat(greedy), torch.cat(probs))
