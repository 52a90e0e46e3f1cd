"""Verification of trees of drafts, and the cache moves that follow it.

The target ran every node of each request's tree (tree.py); `target[i, j]` is
its token at tree index j of request i. From the root, the walk moves to the
child that carries the target's token, while there is one. For a greedy request
the token is the argmax, so output is exactly what the target alone would
produce; for a sampling request it is the token recursive rejection sampling
emits after the node (sampled_tree.walked_targets), so the walk takes that
sampling's path.

The accepted nodes' keys and values sit at their tree slots (root slot + tree
index); the next step expects them at root slot + depth. `kv_moves` says which
slots to copy where, and `move_kv` copies them for all layers at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.spec_decode.tree import DraftTree


@dataclass
class TreeTables:
    """A DraftTree's index tables on the device."""

    tree: DraftTree
    children: torch.Tensor  # [N + 1, C] int64: tree indices of each index's children, -1 past them
    ancestor_bits: torch.Tensor  # [N + 1] int64
    depths: torch.Tensor  # [N + 1] int64: each index's depth (the root's 0)
    # Per depth d >= 1 (entry 0 unused): over the nodes of depth d, each one's column among the guesses drafted
    # at depth d - 1 ([nodes of depth d - 1, top_k(d)], flattened); over those guesses, the node of depth d
    # each one is (its index in the depth), -1 for a guess the tree leaves out.
    guess_columns: tuple[torch.Tensor | None, ...]
    guess_nodes: tuple[torch.Tensor | None, ...]
    # [N + 1] int64: each node's parent's index among the nodes of the parent's depth (0 for the root).
    level_parents: torch.Tensor
    # [N + 1] int64: each index's row among the nodes that have children, -1 for a leaf: where a sampling
    # request's drafter keeps the distribution its children were drawn from (sampled_tree.py).
    prob_slots: torch.Tensor
    num_prob_slots: int
    # Per depth d: the nodes of depth d that have children, as their columns among the depth's nodes and their
    # rows among prob_slots (None past the last depth with children).
    level_prob_slots: tuple[LevelProbSlots | None, ...]

    @classmethod
    def build(cls, tree: DraftTree, device: torch.device) -> TreeTables:
        kids = [[i for i in range(1, tree.num_nodes + 1) if tree.parents[i] == p] for p in range(tree.num_nodes + 1)]
        width = max(map(len, kids))
        children = torch.tensor([k + [-1] * (width - len(k)) for k in kids], dtype=torch.int64, device=device)

        def table(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        levels = [tree.level(d) for d in range(tree.depth + 1)]
        guess_columns = [None] + [
            table([(tree.parents[i] - levels[d - 1].start) * tree.top_k(d) + tree.ranks[i] for i in levels[d]])
            for d in range(1, tree.depth + 1)]
        guess_nodes = [None]
        for d in range(1, tree.depth + 1):
            nodes = [-1] * (len(levels[d - 1]) * tree.top_k(d))
            for j, column in enumerate(guess_columns[d].tolist()):
                nodes[column] = j
            guess_nodes.append(table(nodes))
        level_parents = [0] + [tree.parents[i] - levels[tree.depths[i] - 1].start for i in range(1, tree.num_nodes + 1)]
        with_children = sorted(set(tree.parents[1:]))
        level_prob_slots = tuple(
            LevelProbSlots(table([i - level.start for i in kept]), table([with_children.index(i) for i in kept]))
            if (kept := [i for i in level if i in with_children]) else None for level in levels)
        prob_slots = [with_children.index(i) if i in with_children else -1 for i in range(tree.num_nodes + 1)]
        return cls(tree, children, table(tree.ancestor_bits), table(tree.depths), tuple(guess_columns),
                   tuple(guess_nodes), table(level_parents), table(prob_slots), len(with_children), level_prob_slots)


@dataclass(frozen=True)
class LevelProbSlots:
    """The nodes of one depth that have children: where their distributions are kept (TreeTables.prob_slots)."""

    columns: torch.Tensor  # [m'] int64: each one's index among the depth's nodes
    slots: torch.Tensor  # [m'] int64: its row among the kept distributions


def walk_tree(target: torch.Tensor, node_tokens: torch.Tensor, num_drafts: torch.Tensor,
              tables: TreeTables) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [n], path [n, D + 1]): the drafts each request accepts, and the tree indices of the root and
    of each accepted draft, 0 (the root) past them. target, node_tokens: [n, N + 1] (node_tokens[:, 0] is not
    read); num_drafts [n]: a request whose tree was cut to its first num_drafts drafts sees no later index."""
    n, depth = target.shape[0], tables.tree.depth
    path = torch.zeros(n, depth + 1, dtype=torch.int64, device=target.device)
    accepted = torch.zeros(n, dtype=torch.int64, device=target.device)
    current = path[:, 0].clone()
    alive = torch.ones(n, dtype=torch.bool, device=target.device)
    for d in range(1, depth + 1):
        kids = tables.children[current]
        present = (kids >= 0) & (kids <= num_drafts[:, None])
        wanted = target.gather(1, current[:, None])
        match = present & (node_tokens.gather(1, kids.clamp(min=0)) == wanted)
        alive &= match.any(dim=1)
        current = torch.where(alive, kids.gather(1, match.long().argmax(dim=1, keepdim=True)).squeeze(1), current)
        path[:, d] = torch.where(alive, current, 0)
        accepted += alive.long()
    return accepted, path


def emitted_tokens(target: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """[n, D + 1]: the target's token at the root and at each accepted node (the accepted drafts, then the
    bonus token), -1 past them."""
    depth = torch.arange(path.shape[1], device=path.device)
    return torch.where(depth[None, :] <= accepted[:, None], target.gather(1, path), -1)


def kv_moves(index: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor, slot_mapping: torch.Tensor,
             spare_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(source slots, destination slots) [n * D]: accepted node of depth d moves from its tree slot to the
    slot of tree index d. index [n, N + 1]: each request's token indices by tree index (verify_index);
    entries past a request's accepted drafts copy its root's slot onto itself, which no move writes.
    Padded rows of a graph (slot PAD_SLOT_ID) copy spare_slot, a slot no request owns, onto itself."""
    depth = torch.arange(1, path.shape[1], device=path.device)
    moved = depth[None, :] <= accepted[:, None]
    root = index[:, :1]
    source = torch.where(moved, index.gather(1, path[:, 1:]), root)
    dest = torch.where(moved, index[:, 1:path.shape[1]], root)
    source, dest = slot_mapping[source.flatten()], slot_mapping[dest.flatten()]
    return torch.where(source < 0, spare_slot, source), torch.where(dest < 0, spare_slot, dest)


@dataclass
class TreeOutcome:
    """What a verified tree yields, [n, ...] each."""

    accepted: torch.Tensor  # [n] int64: drafts accepted
    tokens: torch.Tensor  # [n, D + 1] int64: emitted_tokens
    path_tokens: torch.Tensor  # [n, D + 1] int64: token indices of the root and each accepted draft, the root past them
    moves: tuple[torch.Tensor, torch.Tensor]  # kv_moves: (source slots, destination slots) [n * D]


def verify_tree_torch(target: torch.Tensor, input_ids: torch.Tensor, index: torch.Tensor, num_drafts: torch.Tensor,
                      tables: TreeTables, slot_mapping: torch.Tensor, spare_slot: int) -> TreeOutcome:
    """verify_tree in torch ops (the CPU path and the kernel's reference), without the output rows."""
    n, width = index.shape
    full_width = tables.tree.num_nodes + 1
    # A tree cut to its first num_drafts drafts has columns for those only; the walk reads every column.
    full, nodes = target.new_zeros(n, full_width), target.new_zeros(n, full_width)
    full[:, :width] = target
    nodes[:, :width] = input_ids[index]
    padded_index = torch.cat([index, index[:, -1:].expand(n, full_width - width)], dim=1)
    accepted, path = walk_tree(full, nodes, num_drafts, tables)
    moves = kv_moves(padded_index, path, accepted, slot_mapping, spare_slot)
    return TreeOutcome(accepted, emitted_tokens(full, path, accepted), padded_index.gather(1, path), moves)


def verify_tree(target: torch.Tensor, input_ids: torch.Tensor, index: torch.Tensor, num_drafts: torch.Tensor,
                tables: TreeTables, slot_mapping: torch.Tensor, spare_slot: int, out_rows: torch.Tensor,
                accepted_out: torch.Tensor, tokens_out: torch.Tensor, *, use_triton: bool | None = None) -> TreeOutcome:
    """Walk n verified trees, and write each request's accepted count and emitted tokens to
    accepted_out[out_rows[i]] and tokens_out[out_rows[i], :D + 1].

    target [n, W]: the target's token at each tree index; index [n, W]: the token index of each tree index
    (input_ids holds the drafts there); W > num_drafts [n] (a tree cut to its first drafts may have W <= N).
    Padded rows of a graph (slot PAD_SLOT_ID) move spare_slot onto itself. One Triton launch on CUDA, torch
    ops elsewhere (use_triton forces either; tests run the kernel under TRITON_INTERPRET=1)."""
    if use_triton is None:
        use_triton = target.is_cuda
    if use_triton:
        from specserve.kernels.tree_verify import verify_tree_triton

        return verify_tree_triton(target, input_ids, index, num_drafts, tables, slot_mapping, spare_slot, out_rows,
                                  accepted_out, tokens_out)
    outcome = verify_tree_torch(target, input_ids, index, num_drafts, tables, slot_mapping, spare_slot)
    accepted_out.index_copy_(0, out_rows, outcome.accepted)
    tokens_out[:, :outcome.tokens.shape[1]].index_copy_(0, out_rows, outcome.tokens)
    return outcome


def retrace_tree(input_ids: torch.Tensor, index: torch.Tensor, num_drafts: torch.Tensor, tables: TreeTables,
                 slot_mapping: torch.Tensor, spare_slot: int, out_rows: torch.Tensor, accepted_out: torch.Tensor,
                 tokens_out: torch.Tensor, *, use_triton: bool | None = None) -> TreeOutcome:
    """verify_tree's outcome again from the tokens it wrote (tokens_out[out_rows]) instead of the target's tokens,
    writing the same outputs again. Each move of the walk reads the target's token at the node it stands on, a
    node of its path, and there that token is the emitted token of the node's depth: so a target holding at
    every index the emitted token of its depth walks the same path, accepts as many drafts and moves the same
    slots. A rank that has the step's outputs but not the target's tokens follows the verification so
    (docs/design.md, 'Tensor parallelism')."""
    emitted = tokens_out.index_select(0, out_rows)[:, :tables.tree.depth + 1]
    target = emitted[:, tables.depths[:index.shape[1]]]
    return verify_tree(target, input_ids, index, num_drafts, tables, slot_mapping, spare_slot, out_rows,
                       accepted_out, tokens_out, use_triton=use_triton)


def move_kv(caches: torch.Tensor, source: torch.Tensor, dest: torch.Tensor) -> None:
    """Copy keys and values at slots `source` to slots `dest` in every layer of caches [L, 2, blocks,
    block_size, ...]. All are read before any is written: a destination may be another move's source. A move
    copies bits, so a cache of one-byte elements (FP8) moves as bytes, which every device's index_copy_ takes."""
    if caches.element_size() == 1:
        caches = caches.view(torch.uint8)
    flat = caches.flatten(2, 3)
    flat.index_copy_(2, dest, flat.index_select(2, source))
