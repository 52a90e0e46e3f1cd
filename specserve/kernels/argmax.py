"""Row-wise argmax of large logits in two Triton launches.

torch's argmax reduces one row in one thread block: at batch 1 over Llama-3's
128,256 logits every other SM idles while one walks the row. Here each row's
columns split over many programs, each keeping the first
maximum of its chunk, and a second kernel picks the first chunk holding the
row's maximum: the index torch returns (the first maximal one), for any
logits without NaN.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.spec_decode.pick_scatter import PickScatter

# Below this vocabulary torch's argmax is kept outside CUDA graphs: a step that waits on the host (a small
# model's at batch 1) gains less from the split than its second launch costs the host (BENCHMARKS.md,
# 'Kernel choices').
MIN_VOCAB = 65536
_BLOCK = 1024
_CHUNK = 2048
# Inside a CUDA graph a launch costs the host nothing, so the split pays from a few chunks a row on.
CAPTURED_MIN_VOCAB = 4 * _CHUNK
_MAX_CHUNKS = 128


@triton.jit
def _chunk_argmax_kernel(x_ptr, stride_x, n_cols, val_ptr, idx_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = chunk * CHUNK + offs
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + offs
        v = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        # Strictly greater: each lane keeps its first maximum.
        better = v > best
        best = tl.where(better, v, best)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best, 0)
    out = row * tl.num_programs(1) + chunk
    tl.store(val_ptr + out, top)
    tl.store(idx_ptr + out, tl.min(tl.where(best == top, best_idx, n_cols), 0))


@triton.jit
def _pick_chunk_kernel(val_ptr, idx_ptr, map_ptr, out_ptr, num_chunks, dest_ptr, group, width, also_ptr, also_stride,
                       also_offset, MAP: tl.constexpr, CHUNKS: tl.constexpr, TOP: tl.constexpr, SCATTER: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNKS)
    valid = offs < num_chunks
    v = tl.load(val_ptr + row * num_chunks + offs, mask=valid, other=float("-inf"))
    i = tl.load(idx_ptr + row * num_chunks + offs, mask=valid, other=2**31 - 1)
    for rank in tl.static_range(TOP):
        best = tl.min(tl.where(v == tl.max(v, 0), i, 2**31 - 1), 0)
        # Taking the column out (all its copies: a program short of columns offers N more than once) leaves
        # the next best.
        taken = i == best
        v = tl.where(taken, float("-inf"), v)
        i = tl.where(taken, 2**31 - 1, i)
        best = best.to(tl.int64)
        if MAP:
            best = tl.load(map_ptr + best)
        if SCATTER:
            owner = row // group
            node = tl.load(dest_ptr + (row % group) * TOP + rank)
            tl.store(out_ptr + owner * width + node, best, mask=node >= 0)
            tl.store(also_ptr + owner * also_stride + also_offset + node, best, mask=node >= 0)
        else:
            tl.store(out_ptr + row * TOP + rank, best)


def pick_chunks(maxima: torch.Tensor, firsts: torch.Tensor, token_map: torch.Tensor | None = None,
                top: int = 1, scatter: PickScatter | None = None) -> torch.Tensor:
    """Each row's argmax from per-chunk (first maximum, its column) pairs [rows, chunks] (float32, int32), chunks
    in column order: the first chunk holding the row's maximum wins. token_map [columns] int64 maps the
    column to the id returned. int64 [rows]. With top > 1, the candidates are each chunk's top best columns
    (distinct columns) and the result [rows, top] is the row's best, best first, ties to the lower column.
    With scatter the picks go where it says, and its out is returned."""
    rows, chunks = maxima.shape
    s = scatter
    out = s.out if s is not None else torch.empty(rows, top, dtype=torch.int64, device=maxima.device)
    if rows:
        _pick_chunk_kernel[(rows,)](
            maxima, firsts, token_map if token_map is not None else out, out, chunks,
            *((s.dest, s.group, s.out.shape[1], s.also, s.also.stride(0), s.offset) if s else (out, 1, 0, out, 0, 0)),
            MAP=token_map is not None, CHUNKS=triton.next_power_of_2(chunks), TOP=top, SCATTER=s is not None)
    if s is not None:
        return out
    return out.view(rows) if top == 1 else out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a [rows, n] tensor (unit column stride), as int64 [rows]."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"argmax_rows takes [rows, n] with unit column stride, got {tuple(x.shape)}")
    rows, n = x.shape
    chunks = triton.cdiv(n, _CHUNK)
    if chunks > _MAX_CHUNKS:
        raise ValueError(f"argmax_rows handles up to {_MAX_CHUNKS * _CHUNK} columns, got {n}")
    vals = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    idxs = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    if rows:
        _chunk_argmax_kernel[(rows, chunks)](x, x.stride(0), n, vals, idxs, CHUNK=_CHUNK, BLOCK=_BLOCK)
    return pick_chunks(vals, idxs)


def splits(vocab: int, captured: bool) -> bool:
    """Whether argmax_rows pays over a CUDA row of vocab logits (see MIN_VOCAB); captured: the call is being
    recorded into a CUDA graph (a smaller vocabulary already pays)."""
    return (CAPTURED_MIN_VOCAB if captured else MIN_VOCAB) <= vocab <= _MAX_CHUNKS * _CHUNK
