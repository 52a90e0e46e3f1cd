"""Drafting a tree (tree.py) with an EAGLE head, one pass per depth.

After the draft prefill, each request's last accepted token sits at position P
and the prefill's output there ranks the guesses for depth 1. The pass for
depth d (1 <= d < D) runs every draft of depth d as a query, all n requests at
once: a draft's input is its token and its parent's fed-back hidden state, at
position P + d, its keys written to slot P + (its tree index). Its output ranks
the guesses for its children. In the drafter's cache the tree starts at slot
P + 1 (the root is the prefill's last token, part of the context), so a draft
sees the context, its ancestors and itself: the tree bits shifted past the root.

The drafts of depth d are the last keys written when their pass runs
(breadth-first order), which is the layout the attention kernels expect of a
query: seq_len = P + (end of depth d), and the tree starts tree_offset = (first
index of depth d) - 1 keys before the queries.
"""
from __future__ import annotations

import torch

from specserve.attention.metadata import PAD_SLOT_ID, AttentionMetadata
from specserve.spec_decode.tree_verify import TreeTables


def tree_pass_metadata(tables: TreeTables, d: int, n: int, base_positions: torch.Tensor, block_table: torch.Tensor,
                       block_size: int, max_position: int,
                       num_reqs: torch.Tensor | None) -> tuple[AttentionMetadata, torch.Tensor]:
    """(metadata, positions [n * m]) of the pass over the m drafts of depth d for n requests; rows at or past
    num_reqs ([1] on the device; None: none) are a graph's padding: no keys, no cache writes."""
    level = tables.tree.level(d)
    m, dev = len(level), base_positions.device
    base = base_positions[:n, None]
    index = torch.arange(level.start, level.stop, device=dev)
    # The clamp keeps the rotary table in range at the end of the context; drafts there are never accepted.
    # contiguous: a kernel reads the positions with unit stride, and at n = 1 flatten() keeps expand's stride 0.
    positions = (base + d).clamp(max=max_position - 1).expand(n, m).contiguous().flatten()
    slot_pos = (base + index[None, :]).clamp(max=block_table.shape[1] * block_size - 1)
    blocks = block_table[:n].gather(1, slot_pos // block_size).to(torch.int64)
    slots = blocks * block_size + slot_pos % block_size
    query_start_loc = torch.arange(0, n * m + 1, m, device=dev, dtype=torch.int32)
    seq_lens = (base_positions[:n] + level.stop).to(torch.int32)
    if num_reqs is not None:
        real = torch.arange(n, device=dev) < num_reqs
        slots = torch.where(real[:, None], slots, PAD_SLOT_ID)
        seq_lens = torch.where(real, seq_lens, 0)
    metadata = AttentionMetadata(
        num_reqs=n, num_tokens=n * m, max_query_len=m, max_seq_len=max_position + level.stop,
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table[:n],
        slot_mapping=slots.flatten(),
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens,
        tree_bits=(tables.ancestor_bits[level.start:level.stop] >> 1).repeat(n), tree_offset=level.start - 1)
    return metadata, positions


def draft_tree(drafter, tables: TreeTables, first_hidden: torch.Tensor, first_feedback: torch.Tensor,
               base_positions: torch.Tensor, block_table: torch.Tensor,
               num_reqs: torch.Tensor | None = None) -> torch.Tensor:
    """[n, N] drafts in tree order. first_hidden, first_feedback [n, H]: the prefill's hidden state for the
    logits and its fed-back state, at each request's last accepted token. drafter: a ModelDrafter with
    decode_hidden (the head over several tokens a request) and top_tokens. num_reqs: see tree_pass_metadata."""
    tree = tables.tree
    n = first_hidden.shape[0]
    tokens = torch.zeros(n, tree.num_nodes + 1, dtype=torch.int64, device=first_hidden.device)
    fed_back = first_feedback.new_zeros(n, tree.num_nodes + 1, first_feedback.shape[-1])
    fed_back[:, 0] = first_feedback
    for_logits = first_hidden[:, None]
    parent_level = range(0, 1)
    for d in range(1, tree.depth + 1):
        level = tree.level(d)
        guesses = drafter.top_tokens(for_logits.flatten(0, 1), tree.top_k(d)).view(n, len(parent_level), -1)
        parent = tables.parents[level.start:level.stop] - parent_level.start
        tokens[:, level.start:level.stop] = guesses[:, parent, tables.ranks[level.start:level.stop]]
        if d == tree.depth:
            break
        metadata, positions = tree_pass_metadata(tables, d, n, base_positions, block_table, drafter.block_size,
                                                 drafter.max_position, num_reqs)
        hidden, back = drafter.decode_hidden(tokens[:, level.start:level.stop].flatten(),
                                             fed_back[:, tables.parents[level.start:level.stop]].flatten(0, 1),
                                             positions, metadata)
        fed_back[:, level.start:level.stop] = back.view(n, len(level), -1)
        for_logits = hidden.view(n, len(level), -1)
        parent_level = level
    return tokens[:, 1:]
