"""The Triton kernel of spec_decode/sampled_tree.py's sampled_tree_targets: recursive rejection sampling of a
batch's trees, one program per request, in one launch, written as the table of target tokens that tree_verify's
walk follows.

Each program walks its request's tree from the root. At a node it tests the children in order against the
target's distribution p there and the head's q (spec_decode/sampled_tree.py's docstring): a refused child's
residual norm(max(p - q, 0)) is written, unnormalised, into the request's row of a float32 scratch buffer with
its normaliser kept apart, and q without the refused children is never written: it is q's kept row with those
tokens (at most a node's child count, held in registers) left out and its normaliser reduced by their mass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.spec_decode.tree_verify import TreeTables

BLOCK_V = 4096


@triton.jit
def _q_at(q_row, v, mask, tried, has_q):
    """q's kept values at v (float32), zero at the tried tokens and where the node keeps no q."""
    q = tl.load(q_row + v, mask=mask, other=0.0).to(tl.float32)
    left_out = tl.sum((v[:, None] == tried[None, :]).to(tl.int32), axis=1) > 0
    return tl.where(left_out | ~has_q, 0.0, q)


@triton.jit
def _sampled_tree_targets_kernel(
    p_ptr, p_stride_req, p_stride_node, argmax_ptr, argmax_stride, greedy_ptr, input_ids_ptr, index_ptr, index_stride,
    num_drafts_ptr, q_ptr, q_stride_row, q_stride_slot, rows_ptr, children_ptr, slots_ptr, uniform_ptr,
    uniform_stride, noise_ptr, noise_stride, scratch_ptr, table_ptr, table_stride, V, W,
    DEPTH: tl.constexpr, CHILDREN: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr, BLOCK_W: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    c = tl.arange(0, BLOCK_C)
    w = tl.arange(0, BLOCK_W)
    # The table starts as the argmax, a greedy request's whole table.
    tl.store(table_ptr + i * table_stride + w, tl.load(argmax_ptr + i * argmax_stride + w, mask=w < W), mask=w < W)
    num = tl.load(num_drafts_ptr + i)
    scratch_row = scratch_ptr + i * V
    q_request = q_ptr + tl.load(rows_ptr + i) * q_stride_row
    cur = num * 0
    walking = tl.load(greedy_ptr + i) == 0
    zero = num.to(tl.float32) * 0.0  # float32 scalars that branches carry start from it
    # A node of the last depth has no children: its round only draws the stop token.
    for d in tl.static_range(1, DEPTH + 2):
        if walking:
            src = p_ptr + i * p_stride_req + cur * p_stride_node
            scale = zero + 1.0
            slot = tl.load(slots_ptr + cur)
            has_q = slot >= 0
            # A leaf keeps no q (its slot is -1): slot 0's row is read in its place, and its mass is not counted.
            q_row = q_request + tl.maximum(slot, 0) * q_stride_slot
            acc = tl.zeros([BLOCK], tl.float32)
            for start in range(0, V, BLOCK):
                v = start + lanes
                acc += tl.load(q_row + v, mask=v < V, other=0.0).to(tl.float32)
            q_total = tl.where(has_q, tl.sum(acc, axis=0), 0.0)
            tried = tl.full([BLOCK_C], -1, tl.int64)
            tried_mass = zero
            found = num < 0
            chosen = cur
            for r in tl.static_range(CHILDREN):
                child = tl.load(children_ptr + cur * CHILDREN + r)
                # The verified columns end at the tree's cut: a child past it is read at column 0 and not tested.
                at = tl.where((child >= 0) & (child <= num), child, 0)
                x = tl.load(input_ids_ptr + tl.load(index_ptr + i * index_stride + at))
                q_left = q_total - tried_mass
                already = tl.sum((tried == x).to(tl.int32), axis=0) > 0
                qx_kept = tl.where(has_q, tl.load(q_row + x).to(tl.float32), 0.0)
                qx = tl.where(has_q & ~already & (q_left > 0), qx_kept / tl.where(q_left > 0, q_left, 1.0), 0.0)
                px = tl.load(src + x) * scale
                test = ~found & (child >= 0) & (child <= num) & (qx > 0)
                # u < min(1, p / q) without the division.
                taken = test & (tl.load(uniform_ptr + i * uniform_stride + at) * qx < px)
                found = found | taken
                chosen = tl.where(taken, child, chosen)
                if test & ~taken:
                    # The residual's mass first: where it has none (p equal to q but for rounding), p without x.
                    acc = tl.zeros([BLOCK], tl.float32)
                    for start in range(0, V, BLOCK):
                        v = start + lanes
                        m = v < V
                        p = tl.load(src + v, mask=m, other=0.0) * scale
                        acc += tl.maximum(p - _q_at(q_row, v, m, tried, has_q) / q_left, 0.0)
                    mass = tl.sum(acc, axis=0)
                    acc = tl.zeros([BLOCK], tl.float32)
                    for start in range(0, V, BLOCK):
                        v = start + lanes
                        m = v < V
                        p = tl.load(src + v, mask=m, other=0.0) * scale
                        residual = tl.maximum(p - _q_at(q_row, v, m, tried, has_q) / q_left, 0.0)
                        new = tl.where(mass > 0, residual, tl.where(v == x, 0.0, p))
                        tl.store(scratch_row + v, new, mask=m)
                        acc += new
                    kept = tl.sum(acc, axis=0)
                    src = scratch_row
                    scale = tl.where(kept > 0, 1.0 / kept, 0.0)
                    tried = tl.where(c == r, x, tried)
                    tried_mass += qx_kept
            # The round's token, the target's at the current node in the table: the accepted child's, or the stop
            # token, the argmax of p / Exponential(1) noise (a draw from p; scale > 0 does not move it).
            if found:
                tl.store(table_ptr + i * table_stride + cur,
                         tl.load(input_ids_ptr + tl.load(index_ptr + i * index_stride + chosen)))
                cur = chosen
            else:
                best = tl.full([BLOCK], -1.0, tl.float32)
                best_v = tl.zeros([BLOCK], tl.int32)
                for start in range(0, V, BLOCK):
                    v = start + lanes
                    m = v < V
                    score = tl.load(src + v, mask=m, other=0.0) / tl.load(noise_ptr + i * noise_stride + v, mask=m,
                                                                          other=1.0)
                    better = m & (score > best)
                    best = tl.where(better, score, best)
                    best_v = tl.where(better, v, best_v)
                top = tl.max(best, axis=0)
                drawn = tl.min(tl.where(best == top, best_v, V), axis=0).to(tl.int64)  # the first of equal scores
                tl.store(table_ptr + i * table_stride + cur, drawn)
                walking = num < 0


def sampled_tree_targets_triton(target_probs: torch.Tensor, argmax: torch.Tensor, greedy: torch.Tensor,
                                input_ids: torch.Tensor, index: torch.Tensor, num_drafts: torch.Tensor,
                                node_probs: torch.Tensor, rows: torch.Tensor, tables: TreeTables,
                                uniform: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """sampled_tree.sampled_tree_targets as one launch."""
    n, vocab = noise.shape
    width = argmax.shape[1]
    assert target_probs.stride(2) == 1 and node_probs.stride(2) == 1 and index.stride(1) == 1
    assert uniform.stride(1) == 1 and noise.stride(1) == 1 and argmax.stride(1) == 1
    table = torch.empty_like(argmax)
    if n:
        children = tables.children.shape[1]
        scratch = torch.empty(n, vocab, dtype=torch.float32, device=noise.device)
        _sampled_tree_targets_kernel[(n,)](
            target_probs, target_probs.stride(0), target_probs.stride(1), argmax, argmax.stride(0), greedy,
            input_ids, index, index.stride(0), num_drafts, node_probs, node_probs.stride(0), node_probs.stride(1),
            rows, tables.children, tables.prob_slots, uniform, uniform.stride(0), noise, noise.stride(0), scratch,
            table, table.stride(0), vocab, width,
            DEPTH=tables.tree.depth, CHILDREN=children, BLOCK_C=triton.next_power_of_2(children),
            BLOCK=min(BLOCK_V, triton.next_power_of_2(vocab)), BLOCK_W=triton.next_power_of_2(width), num_warps=8,
        )
    return table
