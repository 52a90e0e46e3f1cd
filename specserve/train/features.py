"""The target, run teacher-forced over whole sequences: the hidden states the head reads.

This is the engine's own model class (LlamaForCausalLM with aux_hidden_layers
set, as the runner sets it for an EAGLE-3 speculator) under plain causal
attention, so the head trains on the same layer inputs it is fed when serving.
"""
from __future__ import annotations

import torch

from specserve.models.loader import build_model, open_model_source
from specserve.train.attention import CausalAttention, DenseBatch
from specserve.train.batches import Batch


def plain_torch(model: torch.nn.Module) -> None:
    """Turn off the fused GPU kernels of model's blocks (on by themselves on CUDA): they have no backward
    pass, and the fused attention path writes a paged KV cache that training does not have."""
    for m in model.modules():
        if getattr(m, "fused", False):
            m.fused = False


class TargetFeatures:
    def __init__(self, target: str, aux_layers: tuple[int, ...], dtype: torch.dtype, device: str):
        self.model, self.arch = build_model(open_model_source(target), dtype, device, CausalAttention(), aux_layers)
        plain_torch(self.model)

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.model.model.embed_tokens

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        """[B * L, n_aux * hidden]: the auxiliary hidden states at every position of the batch."""
        b, n = batch.ids.shape
        positions = torch.arange(n, device=batch.ids.device).repeat(b)
        _, aux = self.model(batch.ids.flatten(), positions, [None] * self.arch.num_layers, DenseBatch(b, n))
        return torch.cat(aux, dim=-1)
