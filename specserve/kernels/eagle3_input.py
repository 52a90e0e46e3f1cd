"""The input of an EAGLE-3 head's attention in one Triton kernel: concat(norm(embed[ids]), norm(hidden)).

Unfused, a draft step spends four launches on it (the embedding gather, two
RMSNorms, the concatenation), each a microsecond or two of a step that is a
chain of such small kernels. One program per token row gathers its embedding
row, normalises it and the row's hidden state with their own weights, and
writes both halves of the [M, 2H] row the qkv projection reads. Rounding
follows models/layers.py RMSNorm (as kernels/rmsnorm.py): the normed row is
rounded to the input dtype before the weight multiplies it. Launches depend
on shapes only (CUDA-graph capturable).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_row(x, w_ptr, cols, mask, n, eps, out_ty):
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return ((x * rstd).to(out_ty).to(tl.float32) * w).to(out_ty)


@triton.jit
def _eagle3_input_kernel(ids_ptr, embed_ptr, hidden_ptr, rows_ptr, embed_norm_ptr, hidden_norm_ptr, out_ptr,
                         gathered_ptr, n, stride_e, stride_h, stride_o, eps, GATHER: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    token = tl.load(ids_ptr + row)
    source = tl.load(rows_ptr + row) if GATHER else row
    e = tl.load(embed_ptr + token * stride_e + cols, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(hidden_ptr + source * stride_h + cols, mask=mask, other=0.0)
    if GATHER:
        tl.store(gathered_ptr + row * n + cols, h, mask=mask)
    h = h.to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_o + cols, _norm_row(e, embed_norm_ptr, cols, mask, n, eps, out_ty), mask=mask)
    tl.store(out_ptr + row * stride_o + n + cols, _norm_row(h, hidden_norm_ptr, cols, mask, n, eps, out_ty),
             mask=mask)


def eagle3_layer_input(input_ids: torch.Tensor, embed_weight: torch.Tensor, hidden: torch.Tensor,
                       embed_norm_weight: torch.Tensor, hidden_norm_weight: torch.Tensor, eps: float,
                       hidden_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(concat(rms_norm(embed_weight[input_ids]), rms_norm(h)) as a new [M, 2H] tensor of hidden's dtype, h):
    h is hidden, or with hidden_rows its rows hidden[hidden_rows] as a new [M, H] tensor (a tree's drafts read
    their parents' states, tree_drafting.py), which the layer's MLP adds back as its residual.

    input_ids [M] int, embed_weight [V, H], hidden [M or more, H] (rows contiguous), norm weights [H],
    hidden_rows [M] int64; ids and rows must be in range (a graph's padded rows hold 0).
    """
    m = input_ids.shape[0] if input_ids.dim() == 1 else -1
    n = hidden.shape[1]
    rows_ok = hidden_rows.shape == (m,) if hidden_rows is not None else hidden.shape[0] == m
    if input_ids.dim() != 1 or not rows_ok or embed_weight.dim() != 2 or embed_weight.shape[1] != n:
        raise ValueError(f"input_ids [M], embed_weight [V, {n}] and hidden [M, {n}] (or hidden_rows [M]) expected, "
                         f"got {tuple(input_ids.shape)}, {tuple(embed_weight.shape)}, {tuple(hidden.shape)}"
                         + (f" and {tuple(hidden_rows.shape)}" if hidden_rows is not None else ""))
    if embed_weight.dtype != hidden.dtype or hidden.stride(1) != 1 or embed_weight.stride(1) != 1:
        raise ValueError("embed_weight and hidden must share a dtype and have contiguous rows")
    if any(w.shape != (n,) or w.stride(0) != 1 for w in (embed_norm_weight, hidden_norm_weight)):
        raise ValueError(f"norm weights must be contiguous [{n}] vectors")
    out = torch.empty((m, 2 * n), dtype=hidden.dtype, device=hidden.device)
    gathered = hidden if hidden_rows is None else hidden.new_empty(m, n)
    if m == 0:
        return out, gathered
    block = triton.next_power_of_2(n)
    _eagle3_input_kernel[(m,)](input_ids, embed_weight, hidden, hidden_rows if hidden_rows is not None else input_ids,
                               embed_norm_weight, hidden_norm_weight, out, gathered, n, embed_weight.stride(0),
                               hidden.stride(0), out.stride(0), eps, GATHER=hidden_rows is not None,
                               BLOCK=block, num_warps=min(max(block // 256, 1), 8))
    return out, gathered
