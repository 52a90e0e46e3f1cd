"""The reference for the trainer's unrolled step attention (specserve/train/attention.py): step j as one
softmax over every step's keys under the dense mask, the row's causal step-0 keys and its own keys of steps
1..j, as the trainer computed it before flash."""
from __future__ import annotations

import torch


def dense_step_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                         scale: float) -> torch.Tensor:
    """q: [B, H, L, D]; keys, values: [B, kv_heads, L, D] for steps 0..j; [B * L, H, D], in float32 at least."""
    acc = torch.promote_types(q.dtype, torch.float32)
    heads, n, j = q.shape[1], q.shape[2], len(keys) - 1
    group = heads // keys[0].shape[1]
    k = torch.cat(keys, dim=2).to(acc).repeat_interleave(group, dim=1)
    v = torch.cat(values, dim=2).to(acc).repeat_interleave(group, dim=1)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    own = torch.eye(n, dtype=torch.bool, device=q.device).repeat(1, j)
    scores = (q.to(acc) @ k.transpose(-1, -2) * scale).masked_fill(~torch.cat((causal, own), dim=1), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).flatten(0, 1)


def output_and_gradients(attend, q, keys, values, grad) -> list[torch.Tensor]:
    """attend()'s output, then the gradients of <output, grad> for q, every key and every value."""
    out = attend()
    return [out, *torch.autograd.grad(out, [q, *keys, *values], grad.to(out.dtype))]
