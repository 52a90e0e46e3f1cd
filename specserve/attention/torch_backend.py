"""Exact reference attention over the paged KV cache, in plain PyTorch.

Runs anywhere (CPU and GPU) and is the yardstick the Triton kernels are
tested against. Prefill chunks attend one request at a time; short queries
(decodes, draft verification) are batched into one padded call whose layout
is built once per step and shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.attention.kv_quant import KVScales, load_kv, store_kv
from specserve.attention.metadata import PAD_SLOT_ID, AttentionMetadata


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   scales: KVScales | None = None) -> None:
    """Write k, v at slot_mapping (PAD_SLOT_ID writes nothing); an FP8 cache stores them quantized with scales."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    valid = slot_mapping != PAD_SLOT_ID
    slots = slot_mapping[valid]
    k_scale, v_scale = (None, None) if scales is None else (scales.k_scale, scales.v_scale)
    flat[0, slots] = store_kv(k[: slot_mapping.shape[0]][valid], flat, k_scale)
    flat[1, slots] = store_kv(v[: slot_mapping.shape[0]][valid], flat, v_scale)


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


@dataclass
class _StepLayout:
    """How this step's requests split into per-request (long) and batched (short) attention."""

    qsl: list[int]
    seq_lens: list[int]
    long: list[int]
    batched: "_BatchedLayout | None"


@dataclass
class _BatchedLayout:
    blocks: torch.Tensor  # [r, num_blocks] cache blocks of each batched request
    live: torch.Tensor  # [r, max_s, 1, 1] key slots inside the request's length
    token: torch.Tensor  # [r, max_q] query token index (0 for padding)
    real: torch.Tensor  # [r, max_q] real query tokens
    mask: torch.Tensor  # [r, 1, max_q, max_s] causal and length mask
    max_s: int


class TorchAttentionBackend:
    name = "torch"

    def launch_variant(self, *args) -> None:
        return None  # torch operators only: nothing compiles

    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata, scale: float,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping, kv_scales)
        return self.attend(q, kv_cache, metadata, scale, kv_scales)

    def attend(self, q, kv_cache, metadata: AttentionMetadata, scale: float,
               kv_scales: KVScales | None = None) -> torch.Tensor:
        layout = metadata.backend_state.get("torch")
        if layout is None:
            layout = metadata.backend_state["torch"] = _step_layout(metadata, kv_cache.shape[2], q.device)
        out = torch.zeros_like(q)
        k_scale, v_scale = (None, None) if kv_scales is None else (kv_scales.k_scale, kv_scales.v_scale)
        qsl, seq_lens = layout.qsl, layout.seq_lens
        for i in layout.long:
            bits = None if metadata.tree_bits is None else metadata.tree_bits[qsl[i]:qsl[i + 1]]
            keys, values = gather_kv(kv_cache, metadata.block_table[i], seq_lens[i])
            out[qsl[i]:qsl[i + 1]] = _attend(q[qsl[i]:qsl[i + 1]], load_kv(keys, k_scale, q.dtype),
                                             load_kv(values, v_scale, q.dtype), scale, bits, metadata.tree_offset)
        if layout.batched is not None:
            _attend_batched(q, out, kv_cache, layout.batched, scale, k_scale, v_scale)
        return out


def _step_layout(metadata: AttentionMetadata, block_size: int, dev) -> _StepLayout:
    qsl = metadata.query_start_loc_cpu.tolist()
    seq_lens = metadata.seq_lens_cpu.tolist()
    short, long = [], []
    for i in range(metadata.num_reqs):
        q_len = qsl[i + 1] - qsl[i]
        if q_len > 0 and seq_lens[i] > 0:
            (short if q_len <= _BATCHED_MAX_QUERY else long).append(i)
    if not short:
        return _StepLayout(qsl, seq_lens, long, None)
    q_lens = torch.tensor([qsl[i + 1] - qsl[i] for i in short], device=dev)
    lens = torch.tensor([seq_lens[i] for i in short], device=dev)
    max_q, max_s = int(q_lens.max()), int(lens.max())
    blocks = metadata.block_table[torch.tensor(short, device=dev)][:, : -(-max_s // block_size)].long()
    key_pos = torch.arange(max_s, device=dev)
    t = torch.arange(max_q, device=dev)
    real = t[None, :] < q_lens[:, None]
    token = torch.where(real, torch.tensor([qsl[i] for i in short], device=dev)[:, None] + t[None, :], 0)
    q_pos = lens[:, None] - q_lens[:, None] + t[None, :]
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < lens[:, None, None])
    if metadata.tree_bits is not None:
        tree_start = (lens - q_lens - metadata.tree_offset)[:, None]
        mask &= tree_visible(metadata.tree_bits[token], (key_pos[None, :] - tree_start)[:, None, :])
    live = (key_pos[None, :] < lens[:, None])[:, :, None, None]
    return _StepLayout(qsl, seq_lens, long, _BatchedLayout(blocks, live, token, real, mask[:, None], max_s))


def tree_visible(bits: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
    """Whether a key rel places past its request's tree start is visible to a query with these tree bits
    (broadcast together; see AttentionMetadata.tree_bits)."""
    return (rel < 0) | ((bits[..., None] >> rel.clamp(0, 31)) & 1).bool()


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
            tree_bits: torch.Tensor | None = None, tree_offset: int = 0) -> torch.Tensor:
    """Causal attention of one request's q_len queries, the last tokens of its seq_len keys (in q's dtype)."""
    q_len, seq_len = q.shape[0], keys.shape[0]
    # Query j sits at position seq_len - q_len + j and sees keys 0..that position.
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    key_pos = torch.arange(seq_len, device=q.device)
    mask = key_pos[None, :] <= q_pos[:, None]
    if tree_bits is not None:
        mask &= tree_visible(tree_bits, key_pos - (seq_len - q_len - tree_offset))
    # enable_gqa: each KV head serves its group of query heads without copying it per query head.
    o = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def _attend_batched(q, out, kv_cache, b: _BatchedLayout, scale: float, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> None:
    """The same attention for several short-query requests at once, padded to the longest."""
    # Cache slots past a request's length may hold anything (even NaN): zero them, then mask them.
    keys = torch.where(b.live, load_kv(kv_cache[0][b.blocks].flatten(1, 2)[:, : b.max_s], k_scale, q.dtype), 0)
    values = torch.where(b.live, load_kv(kv_cache[1][b.blocks].flatten(1, 2)[:, : b.max_s], v_scale, q.dtype), 0)
    o = F.scaled_dot_product_attention(q[b.token].transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                       attn_mask=b.mask, scale=scale, enable_gqa=True).transpose(1, 2)
    out[b.token[b.real]] = o[b.real]
