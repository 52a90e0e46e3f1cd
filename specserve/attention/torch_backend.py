"""Exact reference attention over the paged KV cache, in plain PyTorch.

Runs anywhere (CPU and GPU) and is the yardstick the Triton kernels are
tested against. It loops over requests on the host, so it is for
correctness, not speed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.attention.metadata import PAD_SLOT_ID, AttentionMetadata


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    valid = slot_mapping != PAD_SLOT_ID
    slots = slot_mapping[valid]
    flat[0, slots] = k[: slot_mapping.shape[0]][valid].to(flat.dtype)
    flat[1, slots] = v[: slot_mapping.shape[0]][valid].to(flat.dtype)


def gather_kv(kv_cache: torch.Tensor, block_row: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [seq_len, num_kv_heads, head_dim] of one request."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_row[:num_blocks].long()
    k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
    v = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    return k, v


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping)
        out = torch.zeros_like(q)
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        qsl = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        for i in range(metadata.num_reqs):
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            q_len = end - start
            if q_len == 0 or seq_len == 0:
                continue
            keys, values = gather_kv(kv_cache, metadata.block_table[i], seq_len)
            keys = keys.to(q.dtype).repeat_interleave(num_heads // num_kv_heads, dim=1)
            values = values.to(q.dtype).repeat_interleave(num_heads // num_kv_heads, dim=1)
            # Query j sits at position seq_len - q_len + j and sees keys 0..that position.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=mask, scale=scale,
            )
            out[start:end] = o.transpose(0, 1)
        return out
