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

from dataclasses import dataclass

import torch

from specserve.attention.metadata import PAD_SLOT_ID, AttentionMetadata
from specserve.distributed.communication import broadcast_from_rank0
from specserve.spec_decode.pick_scatter import PickScatter
from specserve.spec_decode.sampled_tree import TreeSampling
from specserve.spec_decode.tree_verify import TreeTables
from specserve.structured_output.draft_masks import DraftMasks, mask_draft_logits


def tree_pass_metadata_torch(tables: TreeTables, d: int, n: int, base_positions: torch.Tensor,
                             block_table: torch.Tensor, block_size: int, max_position: int,
                             num_reqs: torch.Tensor | None) -> PassInputs:
    """tree_pass_metadata in torch ops (the CPU path and the kernel's reference)."""
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
    seq_lens = (base_positions[:n] + level.stop).to(torch.int32)
    if num_reqs is not None:
        real = torch.arange(n, device=dev) < num_reqs
        slots = torch.where(real[:, None], slots, PAD_SLOT_ID)
        seq_lens = torch.where(real, seq_lens, 0)
    parents = len(tables.tree.level(d - 1))
    parent_rows = torch.arange(n, device=dev)[:, None] * parents + tables.level_parents[level.start:level.stop]
    return PassInputs(positions, slots.flatten(), seq_lens,
                      torch.arange(0, n * m + 1, m, device=dev, dtype=torch.int32),
                      (tables.ancestor_bits[level.start:level.stop] >> 1).repeat(n), parent_rows.flatten())


@dataclass
class PassInputs:
    """What the pass over one depth's drafts reads besides their tokens and fed-back states."""

    positions: torch.Tensor  # [n * m] int64
    slot_mapping: torch.Tensor  # [n * m] int64
    seq_lens: torch.Tensor  # [n] int32
    query_start_loc: torch.Tensor  # [n + 1] int32
    tree_bits: torch.Tensor  # [n * m] int64
    # [n * m] int64: each draft's parent's row in the pass before (the prefill's last token for depth 1).
    parent_rows: torch.Tensor

    def metadata(self, tables: TreeTables, d: int, block_table: torch.Tensor, max_position: int) -> AttentionMetadata:
        level = tables.tree.level(d)
        n, m = self.seq_lens.shape[0], len(level)
        return AttentionMetadata(
            num_reqs=n, num_tokens=n * m, max_query_len=m, max_seq_len=max_position + level.stop,
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, block_table=block_table[:n],
            slot_mapping=self.slot_mapping, query_start_loc_cpu=self.query_start_loc, seq_lens_cpu=self.seq_lens,
            tree_bits=self.tree_bits, tree_offset=level.start - 1)


def tree_pass_metadata(tables: TreeTables, d: int, n: int, base_positions: torch.Tensor, block_table: torch.Tensor,
                       block_size: int, max_position: int, num_reqs: torch.Tensor | None,
                       *, use_triton: bool | None = None) -> tuple[AttentionMetadata, PassInputs]:
    """(metadata, inputs) of the pass over the m drafts of depth d for n requests; rows at or past
    num_reqs ([1] on the device; None: none) are a graph's padding: no keys, no cache writes. One Triton launch
    on CUDA, torch ops elsewhere (use_triton forces either; tests run the kernel under TRITON_INTERPRET=1)."""
    if use_triton is None:
        use_triton = base_positions.is_cuda
    if use_triton:
        from specserve.kernels.tree_drafting import tree_pass_inputs_triton

        inputs = tree_pass_inputs_triton(tables, d, n, base_positions, block_table, block_size, max_position, num_reqs)
    else:
        inputs = tree_pass_metadata_torch(tables, d, n, base_positions, block_table, block_size, max_position,
                                          num_reqs)
    return inputs.metadata(tables, d, block_table, max_position), inputs


def level_scatter(tables: TreeTables, d: int, n: int, drafts: torch.Tensor) -> PickScatter:
    """Where the guesses ranked for depth d go: the drafts of depth d, request-major, as the pass over them
    reads them, and their columns of drafts [n, N]."""
    level = tables.tree.level(d)
    parents = len(tables.tree.level(d - 1))
    return PickScatter(tables.guess_nodes[d], tables.guess_columns[d], parents,
                       torch.empty(n, len(level), dtype=torch.int64, device=drafts.device), drafts, level.start - 1)


def draft_tree(drafter, tables: TreeTables, first_hidden: torch.Tensor, first_feedback: torch.Tensor,
               base_positions: torch.Tensor, block_table: torch.Tensor, num_reqs: torch.Tensor | None = None,
               out: torch.Tensor | None = None, masks: DraftMasks | None = None,
               shared_picks: bool = False, sampling: TreeSampling | None = None) -> torch.Tensor:
    """The drafts in tree order, [n, N] (into out where given). first_hidden, first_feedback [n, H]: the
    prefill's hidden state for the logits and its fed-back state, at each request's last accepted token.
    drafter: a ModelDrafter (top_tokens, tree_pass). num_reqs: see tree_pass_metadata. masks: a grammar
    step's (draft_masks.py): each node's guesses are ranked on its logits masked with its path's grammar
    state, each depth's drafts read back for the next depth's masks. shared_picks: a sharded drafter's step
    whose guesses rank 0 alone ranks (it alone has the masks): each depth's are rank 0's, broadcast before
    they are placed, and every rank drafts on from them (DraftInput.shared_picks). sampling: a batch with a
    request that samples, whose children are drawn from the head (sampled_tree.py) instead of its top guesses.

    Each depth's drafts are one request-major tensor, and their fed-back states another; the next pass reads
    its parents' rows of them, so no tree-wide buffer is copied into."""
    tree = tables.tree
    n = first_hidden.shape[0]
    drafts = out if out is not None else torch.empty(n, tree.num_nodes, dtype=torch.int64, device=first_hidden.device)
    tokens = _guesses(drafter, first_hidden, tree.top_k(1), level_scatter(tables, 1, n, drafts), masks, tree.level(0),
                      shared_picks, sampling)
    fed_back = first_feedback
    for d in range(1, tree.depth):
        metadata, inputs = tree_pass_metadata(tables, d, n, base_positions, block_table, drafter.block_size,
                                              drafter.max_position, num_reqs)
        scatter = level_scatter(tables, d + 1, n, drafts)
        if masks is None and not shared_picks and sampling is None:
            tokens, fed_back = drafter.tree_pass(tokens.view(-1), fed_back, inputs.parent_rows, inputs.positions,
                                                 metadata, tree.top_k(d + 1), scatter)
            continue
        for_logits, fed_back = drafter.decode_hidden(tokens.view(-1), fed_back.index_select(0, inputs.parent_rows),
                                                     inputs.positions, metadata)
        tokens = _guesses(drafter, for_logits, tree.top_k(d + 1), scatter, masks, tree.level(d), shared_picks,
                          sampling)
    return drafts


def _guesses(drafter, hidden: torch.Tensor, k: int, scatter: PickScatter, masks: DraftMasks | None,
             nodes: range, shared_picks: bool, sampling: TreeSampling | None) -> torch.Tensor:
    """The k likeliest guesses after each of the nodes whose states hidden holds (with sampling, a sampling
    request's k draws), sent where scatter says; with masks, among the tokens the grammar allows after each
    node, and read back for the next masks; with shared_picks, rank 0's guesses."""
    if masks is None and not shared_picks and sampling is None:
        return drafter.top_tokens(hidden, k, scatter)
    logits = drafter.compute_logits(hidden)
    if masks is not None:
        logits = mask_draft_logits(logits, masks.masks(nodes))
    top = logits.topk(k, dim=-1).indices if sampling is None else sampling.guesses(logits, k, nodes)
    tokens = scatter.apply(broadcast_from_rank0(top) if shared_picks else top)
    if masks is not None:
        masks.follow(tokens)
    return tokens
