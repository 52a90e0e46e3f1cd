"""The Triton kernel of spec_decode/tree_verify.py: the walk of verified trees of drafts, and the cache moves
it implies, in one launch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.spec_decode.tree_verify import TreeOutcome, TreeTables


@triton.jit
def _verify_tree_kernel(
    target_ptr, target_stride, input_ids_ptr, index_ptr, index_stride, num_drafts_ptr, children_ptr,
    slot_mapping_ptr, spare_slot, out_rows_ptr, accepted_out_ptr, accepted_out_stride, tokens_out_ptr,
    tokens_out_stride, accepted_ptr, tokens_ptr, path_ptr, source_ptr, dest_ptr,
    DEPTH: tl.constexpr, CHILDREN: tl.constexpr, BLOCK_C: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    num = tl.load(num_drafts_ptr + i)
    row = tl.load(out_rows_ptr + i)
    index_row = index_ptr + i * index_stride
    target_row = target_ptr + i * target_stride
    root_index = tl.load(index_row)
    root_slot = tl.load(slot_mapping_ptr + root_index)
    root_slot = tl.where(root_slot < 0, spare_slot, root_slot)
    tok = tl.load(target_row)
    tl.store(tokens_ptr + i * (DEPTH + 1), tok)
    tl.store(tokens_out_ptr + row * tokens_out_stride, tok)
    tl.store(path_ptr + i * (DEPTH + 1), root_index)
    cur = num * 0
    accepted = num * 0
    alive = num >= 0
    for d in tl.static_range(1, DEPTH + 1):
        kids = tl.load(children_ptr + cur * CHILDREN + c, mask=c < CHILDREN, other=-1)
        present = (kids >= 0) & (kids <= num)
        kid_token = tl.load(input_ids_ptr + tl.load(index_row + kids, mask=present, other=0), mask=present,
                            other=-1)
        # The first child (in tree order) carrying the target's token at the current node.
        nxt = tl.min(tl.where(present & (kid_token == tok), kids, 1 << 30), axis=0)
        alive = alive & (nxt < (1 << 30))
        cur = tl.where(alive, nxt, cur)
        accepted += alive.to(tl.int64)
        cur_index = tl.load(index_row + cur)
        tok = tl.load(target_row + cur)
        emitted = tl.where(alive, tok, -1)
        tl.store(tokens_ptr + i * (DEPTH + 1) + d, emitted)
        tl.store(tokens_out_ptr + row * tokens_out_stride + d, emitted)
        tl.store(path_ptr + i * (DEPTH + 1) + d, tl.where(alive, cur_index, root_index))
        # An accepted draft has tree index >= d, and index has columns up to num_drafts.
        source = tl.load(slot_mapping_ptr + cur_index)
        dest = tl.load(slot_mapping_ptr + tl.load(index_row + d, mask=alive, other=0))
        source = tl.where(alive, tl.where(source < 0, spare_slot, source), root_slot)
        dest = tl.where(alive, tl.where(dest < 0, spare_slot, dest), root_slot)
        tl.store(source_ptr + i * DEPTH + d - 1, source)
        tl.store(dest_ptr + i * DEPTH + d - 1, dest)
    tl.store(accepted_ptr + i, accepted)
    tl.store(accepted_out_ptr + row * accepted_out_stride, accepted)


def verify_tree_triton(target: torch.Tensor, input_ids: torch.Tensor, index: torch.Tensor, num_drafts: torch.Tensor,
                       tables: TreeTables, slot_mapping: torch.Tensor, spare_slot: int, out_rows: torch.Tensor,
                       accepted_out: torch.Tensor, tokens_out: torch.Tensor) -> TreeOutcome:
    """verify_tree (spec_decode/tree_verify.py) as one launch."""
    n, depth = index.shape[0], tables.tree.depth
    assert target.stride(1) == 1 and index.stride(1) == 1 and tokens_out.stride(1) == 1
    long = dict(dtype=torch.int64, device=target.device)
    outcome = TreeOutcome(torch.empty(n, **long), torch.empty(n, depth + 1, **long), torch.empty(n, depth + 1, **long),
                          (torch.empty(n * depth, **long), torch.empty(n * depth, **long)))
    if n:
        width = tables.children.shape[1]
        _verify_tree_kernel[(n,)](
            target, target.stride(0), input_ids, index, index.stride(0), num_drafts, tables.children,
            slot_mapping, spare_slot, out_rows, accepted_out, accepted_out.stride(0), tokens_out,
            tokens_out.stride(0), outcome.accepted, outcome.tokens, outcome.path_tokens, *outcome.moves,
            DEPTH=depth, CHILDREN=width, BLOCK_C=triton.next_power_of_2(width),
        )
    return outcome
