"""The Triton kernel of spec_decode/sampled_tree.py's walk: recursive rejection sampling of a batch's trees, one
program per request, in one launch.

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

BLOCK_V = 1024


@triton.jit
def _q_at(q_row, v, mask, tried, has_q):
    """q's kept values at v (float32), zero at the tried tokens and where the node keeps no q."""
    q = tl.load(q_row + v, mask=mask, other=0.0).to(tl.float32)
    left_out = tl.sum((v[:, None] == tried[None, :]).to(tl.int32), axis=1) > 0
    return tl.where(left_out | ~has_q, 0.0, q)


@triton.jit
def _walk_sampled_trees_kernel(
    p_ptr, p_stride_req, p_stride_node, tokens_in_ptr, tokens_in_stride, num_drafts_ptr, q_ptr, q_stride_req,
    q_stride_slot, children_ptr, slots_ptr, uniform_ptr, uniform_stride, noise_ptr, noise_stride, scratch_ptr,
    accepted_ptr, path_ptr, tokens_ptr, V,
    DEPTH: tl.constexpr, CHILDREN: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    c = tl.arange(0, BLOCK_C)
    num = tl.load(num_drafts_ptr + i)
    scratch_row = scratch_ptr + i * V
    cur = num * 0
    accepted = num * 0
    walking = num >= 0
    zero = num.to(tl.float32) * 0.0  # float32 scalars that loops and branches carry start from it
    tl.store(path_ptr + i * (DEPTH + 1), cur)
    # A node of the last depth has no children: its round only draws the stop token.
    for d in tl.static_range(1, DEPTH + 2):
        emitted = num * 0 - 1
        if walking:
            src = p_ptr + i * p_stride_req + cur * p_stride_node
            scale = zero + 1.0
            slot = tl.load(slots_ptr + cur)
            has_q = slot >= 0
            q_row = q_ptr + i * q_stride_req + tl.maximum(slot, 0) * q_stride_slot
            # A leaf keeps no q (its slot is -1): slot 0's row is read in its place, and its mass is not counted.
            q_total = zero
            for start in range(0, V, BLOCK):
                v = start + lanes
                q_total += tl.sum(tl.load(q_row + v, mask=v < V, other=0.0).to(tl.float32), axis=0)
            q_total = tl.where(has_q, q_total, 0.0)
            tried = tl.full([BLOCK_C], -1, tl.int64)
            tried_mass = zero
            found = num < 0
            chosen = cur
            for r in tl.static_range(CHILDREN):
                child = tl.load(children_ptr + cur * CHILDREN + r)
                at = tl.maximum(child, 0)
                x = tl.load(tokens_in_ptr + i * tokens_in_stride + at)
                q_left = q_total - tried_mass
                already = tl.sum((tried == x).to(tl.int32), axis=0) > 0
                qx_kept = tl.where(has_q, tl.load(q_row + x).to(tl.float32), 0.0)
                qx = tl.where(has_q & ~already & (q_left > 0), qx_kept / tl.where(q_left > 0, q_left, 1.0), 0.0)
                px = tl.load(src + x) * scale
                test = walking & ~found & (child >= 0) & (child <= num) & (qx > 0)
                # u < min(1, p / q) without the division.
                taken = test & (tl.load(uniform_ptr + i * uniform_stride + at) * qx < px)
                found = found | taken
                chosen = tl.where(taken, child, chosen)
                if test & ~taken:
                    # The residual's mass first: where it has none (p equal to q but for rounding), p without x.
                    mass = zero
                    for start in range(0, V, BLOCK):
                        v = start + lanes
                        m = v < V
                        p = tl.load(src + v, mask=m, other=0.0) * scale
                        mass += tl.sum(tl.maximum(p - _q_at(q_row, v, m, tried, has_q) / q_left, 0.0), axis=0)
                    kept = zero
                    for start in range(0, V, BLOCK):
                        v = start + lanes
                        m = v < V
                        p = tl.load(src + v, mask=m, other=0.0) * scale
                        residual = tl.maximum(p - _q_at(q_row, v, m, tried, has_q) / q_left, 0.0)
                        new = tl.where(mass > 0, residual, tl.where(v == x, 0.0, p))
                        tl.store(scratch_row + v, new, mask=m)
                        kept += tl.sum(new, axis=0)
                    src = scratch_row
                    scale = tl.where(kept > 0, 1.0 / kept, 0.0)
                    tried = tl.where(c == r, x, tried)
                    tried_mass += qx_kept
            if found:
                emitted = tl.load(tokens_in_ptr + i * tokens_in_stride + chosen)
                cur = chosen
                accepted += 1
            else:
                # The stop token: argmax of p / Exponential(1) noise, a draw from p (scale > 0 does not move it).
                best = zero - 1.0
                best_v = num * 0
                for start in range(0, V, BLOCK):
                    v = start + lanes
                    m = v < V
                    score = tl.load(src + v, mask=m, other=0.0) / tl.load(noise_ptr + i * noise_stride + v, mask=m,
                                                                          other=1.0)
                    score = tl.where(m, score, -1.0)
                    block_best = tl.max(score, axis=0)
                    block_v = tl.min(tl.where(score == block_best, v, V), axis=0).to(tl.int64)
                    better = block_best > best
                    best_v = tl.where(better, block_v, best_v)
                    best = tl.where(better, block_best, best)
                emitted = best_v
                walking = num < 0
        tl.store(tokens_ptr + i * (DEPTH + 1) + d - 1, emitted)
        if d <= DEPTH:
            tl.store(path_ptr + i * (DEPTH + 1) + d, tl.where(walking, cur, 0))
    tl.store(accepted_ptr + i, accepted)


def walk_sampled_trees_triton(target_probs: torch.Tensor, node_tokens: torch.Tensor, num_drafts: torch.Tensor,
                              node_probs: torch.Tensor, tables: TreeTables, uniform: torch.Tensor,
                              noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accepted, path, tokens) of sampled_tree.walk_sampled_trees, as one launch."""
    n, vocab = noise.shape
    depth, width = tables.tree.depth, tables.children.shape[1]
    assert target_probs.stride(2) == 1 and node_probs.stride(2) == 1 and node_tokens.stride(1) == 1
    assert uniform.stride(1) == 1 and noise.stride(1) == 1
    long = dict(dtype=torch.int64, device=noise.device)
    accepted, path, tokens = torch.empty(n, **long), torch.empty(n, depth + 1, **long), torch.empty(n, depth + 1, **long)
    if n:
        scratch = torch.empty(n, vocab, dtype=torch.float32, device=noise.device)
        _walk_sampled_trees_kernel[(n,)](
            target_probs, target_probs.stride(0), target_probs.stride(1), node_tokens, node_tokens.stride(0),
            num_drafts, node_probs, node_probs.stride(0), node_probs.stride(1), tables.children, tables.prob_slots,
            uniform, uniform.stride(0), noise, noise.stride(0), scratch, accepted, path, tokens, vocab,
            DEPTH=depth, CHILDREN=width, BLOCK_C=triton.next_power_of_2(width),
            BLOCK=min(BLOCK_V, triton.next_power_of_2(vocab)),
        )
    return accepted, path, tokens
