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

Step j > 0 is computed as two parts merged by their log-sum-exps: causal
flash attention over the step-0 keys, and the j per-row scores of the row's
own keys. A dense [L, (j + 1) L] mask over all steps' keys gives the same
result but leaves flash for the masked kernel and computes every masked
score, a large share of a small model's training step.
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


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query keys or values [B, kv_heads, L, D] repeated to the query's heads."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **mask) -> torch.Tensor:
    k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
    o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), scale=scale, **mask)
    return o.transpose(1, 2).flatten(0, 1)


# Columns added to the head dimension in CausalAttentionWithLse; flash kernels take multiples of 8.
_LSE_PAD = 8


class CausalAttentionWithLse(torch.autograd.Function):
    """Causal attention [B, H, L, D] that also returns its log-sum-exp [B, H, L] (float32), with gradients
    through both. Flash attention's backward takes the row term D = rowsum(grad_out * out) in
    dS = P * (dP - D); since d lse / dS = P, lse's gradient g enters as D - g. The inputs get zero
    columns, which change no score and no output, and backward sets one output column to 1 against a
    grad_out column of -g so flash itself computes D - g."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float):
        q, k, v = (F.pad(x, (0, _LSE_PAD)) for x in (q, k, v))
        if q.is_cuda:
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, True, False, scale=scale)
            ctx.flash_state = (cum_q, cum_k, max_q, max_k, seed, offset)
        else:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out[..., :-_LSE_PAD], lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        d = out.shape[-1] - _LSE_PAD
        grad = F.pad(grad_out, (0, _LSE_PAD))
        if grad_lse is not None:
            out = out.clone()
            out[..., d] = 1
            grad[..., d] = -grad_lse.to(grad.dtype)
        if q.is_cuda:
            cum_q, cum_k, max_q, max_k, seed, offset = ctx.flash_state
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=ctx.scale)
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad, q, k, v, out, lse, 0.0, True, scale=ctx.scale)
        return dq[..., :d], dk[..., :d], dv[..., :d], None


def unrolled_step_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                            scale: float) -> torch.Tensor:
    """Step j = len(keys) - 1 > 0: each row i attends to keys[0] at rows 0..i and to row i of keys[1..j].
    q: [B, H, L, D]; keys, values: [B, kv_heads, L, D]. Returns [B * L, H, D]."""
    b, heads, n, d = q.shape
    kv_heads = keys[0].shape[1]
    k0, v0 = (_expand_heads(x[0], heads).to(q.dtype) for x in (keys, values))
    causal, lse = CausalAttentionWithLse.apply(q, k0, v0, scale)
    # The row's own keys as elementwise products, grouped query heads broadcast over their key head: batched
    # [j, D] x [D, 1] products run as many tiny matrix multiplies, far slower. The merge runs in float32 at
    # least: the weights of a bf16 query's parts would round visibly.
    acc = torch.promote_types(q.dtype, torch.float32)
    grouped = q.view(b, kv_heads, heads // kv_heads, n, d).to(acc)
    own_scores = [scale * (grouped * k.unsqueeze(2).to(acc)).sum(-1).view(b, heads, n) for k in keys[1:]]
    weights = torch.softmax(torch.stack([lse.to(acc), *own_scores], dim=-1), dim=-1)  # [B, H, L, j + 1]
    out = weights[..., 0, None] * causal.to(acc)
    grouped_weights = weights.view(b, kv_heads, heads // kv_heads, n, -1)
    for step, v in enumerate(values[1:], start=1):
        out = out + (grouped_weights[..., step, None] * v.unsqueeze(2).to(acc)).view(b, heads, n, d)
    return out.to(q.dtype).transpose(1, 2).flatten(0, 1)


class CausalAttention:
    """Plain causal attention within each row of the batch (the target, teacher-forced)."""

    name = "causal"

    def forward(self, q, k, v, kv_cache, metadata: DenseBatch, scale: float, kv_scales=None) -> torch.Tensor:
        # No cache is kept, so nothing is quantized: kv_scales (the layer's) are unused.
        return _attend(_heads_first(q, metadata), _heads_first(k, metadata), _heads_first(v, metadata), scale,
                       is_causal=True)


class UnrolledAttention:
    """The head's attention in unrolled step j = len(kv_cache.keys) (see the module docstring)."""

    name = "unrolled"

    def forward(self, q, k, v, kv_cache: UnrolledKV, metadata: DenseBatch, scale: float,
                kv_scales=None) -> torch.Tensor:
        # Training keeps the head's keys and values in the model's dtype: kv_scales (the layer's) are unused.
        q = _heads_first(q, metadata)
        kv_cache.keys.append(_heads_first(k, metadata))
        kv_cache.values.append(_heads_first(v, metadata))
        if len(kv_cache.keys) == 1:
            return _attend(q, kv_cache.keys[0], kv_cache.values[0], scale, is_causal=True)
        return unrolled_step_attention(q, kv_cache.keys, kv_cache.values, scale)
