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


# Requests with at most this many query tokens (decodes, draft verification) are batched into
# one padded attention call; longer ones (prefill chunks) run one by one.
_BATCHED_MAX_QUERY = 16


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping)
        out = torch.zeros_like(q)
        qsl = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        short, long = [], []
        for i in range(metadata.num_reqs):
            q_len = qsl[i + 1] - qsl[i]
            if q_len > 0 and seq_lens[i] > 0:
                (short if q_len <= _BATCHED_MAX_QUERY else long).append(i)
        for i in long:
            out[qsl[i]:qsl[i + 1]] = _attend(q[qsl[i]:qsl[i + 1]], *gather_kv(kv_cache, metadata.block_table[i],
                                                                              seq_lens[i]), scale)
        if short:
            _attend_batched(q, out, kv_cache, metadata.block_table, short, qsl, seq_lens, scale)
        return out


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one request's q_len queries, the last tokens of its seq_len keys."""
    q_len, seq_len = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    keys = keys.to(q.dtype).repeat_interleave(group, dim=1)
    values = values.to(q.dtype).repeat_interleave(group, dim=1)
    # Query j sits at position seq_len - q_len + j and sees keys 0..that position.
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                       attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def _attend_batched(q, out, kv_cache, block_table, reqs: list[int], qsl: list[int], seq_lens: list[int],
                    scale: float) -> None:
    """The same attention for several short-query requests at once, padded to the longest."""
    dev = q.device
    block_size = kv_cache.shape[2]
    q_lens = torch.tensor([qsl[i + 1] - qsl[i] for i in reqs], device=dev)
    lens = torch.tensor([seq_lens[i] for i in reqs], device=dev)
    max_q, max_s = int(q_lens.max()), int(lens.max())
    num_blocks = -(-max_s // block_size)
    blocks = block_table[torch.tensor(reqs, device=dev)][:, :num_blocks].long()
    key_pos = torch.arange(max_s, device=dev)
    live = (key_pos[None, :] < lens[:, None])[:, :, None, None]
    # Cache slots past a request's length may hold anything (even NaN): zero them, then mask them.
    keys = torch.where(live, kv_cache[0][blocks].flatten(1, 2)[:, :max_s], 0).to(q.dtype)
    values = torch.where(live, kv_cache[1][blocks].flatten(1, 2)[:, :max_s], 0).to(q.dtype)
    group = q.shape[1] // keys.shape[2]
    keys, values = keys.repeat_interleave(group, dim=2), values.repeat_interleave(group, dim=2)
    t = torch.arange(max_q, device=dev)
    token = torch.tensor([qsl[i] for i in reqs], device=dev)[:, None] + t[None, :]
    real = t[None, :] < q_lens[:, None]
    token = torch.where(real, token, 0)
    q_pos = lens[:, None] - q_lens[:, None] + t[None, :]
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < lens[:, None, None])
    o = F.scaled_dot_product_attention(q[token].transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                       attn_mask=mask[:, None], scale=scale).transpose(1, 2)
    out[token[real]] = o[real]
