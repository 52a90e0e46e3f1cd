"""Attention metadata: what a paged attention backend reads for one forward.

All tensors live on the model's device and are views of the runner's
persistent buffers. Layout of the paged cache of one layer:
kv_cache[0] = keys, kv_cache[1] = values, each [num_blocks, block_size,
num_kv_heads, head_dim]; token slot s lives at block s // block_size,
offset s % block_size.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# A slot_mapping entry with this value writes nothing (padded tokens).
PAD_SLOT_ID = -1


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    # [num_reqs + 1] int32: request i owns query tokens query_start_loc[i]:query_start_loc[i+1]
    query_start_loc: torch.Tensor
    # [num_reqs] int32: tokens in the cache for request i after this step's writes
    seq_lens: torch.Tensor
    # [num_reqs, max_blocks_per_req] int32
    block_table: torch.Tensor
    # [num_tokens] int64: cache slot of each query token, PAD_SLOT_ID for padding
    slot_mapping: torch.Tensor
    # Host copies, for the reference backend's per-request loop.
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    # What a backend derives from this metadata once per step and reuses in every layer.
    backend_state: dict = field(default_factory=dict)
    # Trees of drafts (spec_decode/tree.py): [num_tokens] int64, or None without trees. Request i's tree starts
    # at key tree_start = seq_len - q_len - tree_offset; query token t sees a key s >= tree_start only if bit
    # s - tree_start of tree_bits[t] is set (causality still holds). -1 (every bit) for tokens outside trees.
    tree_bits: torch.Tensor | None = None
    tree_offset: int = 0
