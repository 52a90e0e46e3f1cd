"""Attention for training, over right-padded batches of whole sequences instead of a paged cache.

Both classes are attention backends (attention/backend.py), so training runs
the very modules the engine serves with: the target (LlamaForCausalLM) under
CausalAttention, the head (Eagle3Head) under UnrolledAttention.

Training-time test (EAGLE-3). At inference (spec_decode/model_drafter.py) the
drafter, for a request whose last accepted token sits at position p, runs
draft step 0 (the prefill, fed the target's hidden states) at every position
up to p, then draft step j at position p + j, fed back its own hidden state
of step j - 1. Step j's query attends to the step-0 keys of positions 0..p
and to the keys its own steps 1..j wrote at positions p+1..p+j: rejected
drafts are overwritten, so nothing else is ever in the head's cache.

Training unrolls every position i of a sequence as such a p at once: row i
of step j is step j of the chain that starts at i (position i + j). Its
query sees the step-0 keys of rows 0..i (causal) and, of each step 1..j, the
key of row i itself: exactly the keys of that chain at inference, at the
same positions, so the head trains on the attention pattern it drafts with.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class DenseBatch:
    """Passed where a backend expects metadata: the [batch, length] shape the flat token rows come from."""

    batch: int
    length: int


@dataclass
class UnrolledKV:
    """Passed where a backend expects the KV cache: each unrolled step's keys and values, [B, kv_heads, L, D]."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)


def _heads_first(x: torch.Tensor, shape: DenseBatch) -> torch.Tensor:
    return x.view(shape.batch, shape.length, x.shape[1], x.shape[2]).transpose(1, 2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **mask) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), scale=scale, **mask)
    return o.transpose(1, 2).flatten(0, 1)


class CausalAttention:
    """Plain causal attention within each row of the batch (the target, teacher-forced)."""

    name = "causal"

    def forward(self, q, k, v, kv_cache, metadata: DenseBatch, scale: float) -> torch.Tensor:
        return _attend(_heads_first(q, metadata), _heads_first(k, metadata), _heads_first(v, metadata), scale,
                       is_causal=True)


class UnrolledAttention:
    """The head's attention in unrolled step j = len(kv_cache.keys) (see the module docstring)."""

    name = "unrolled"

    def forward(self, q, k, v, kv_cache: UnrolledKV, metadata: DenseBatch, scale: float) -> torch.Tensor:
        q = _heads_first(q, metadata)
        kv_cache.keys.append(_heads_first(k, metadata))
        kv_cache.values.append(_heads_first(v, metadata))
        step = len(kv_cache.keys) - 1
        if step == 0:
            return _attend(q, kv_cache.keys[0], kv_cache.values[0], scale, is_causal=True)
        n = metadata.length
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        own = torch.eye(n, dtype=torch.bool, device=q.device).repeat(1, step)
        keys, values = torch.cat(kv_cache.keys, dim=2), torch.cat(kv_cache.values, dim=2)
        return _attend(q, keys, values, scale, attn_mask=torch.cat((causal, own), dim=1))
