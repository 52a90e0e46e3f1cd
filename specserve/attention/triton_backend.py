"""Paged attention in Triton: one kernel for prefill, decode and verify alike.

Every request is treated the same way: its q_len query tokens are the last
q_len positions of its seq_len cached tokens, so prefill (with or without a
cached prefix), decode (q_len 1) and draft verification (q_len 1 + k) mix
freely in one batch.

Grid: (num_reqs, num_kv_heads, query tiles). A program owns one request, one
KV head and a tile of that request's query tokens; the rows of its tile are
(token, query head) pairs of all query heads sharing the KV head, so each
key/value block is loaded once per group instead of once per query head, and
decode batches still fill the 16-row minimum of tl.dot. The grid comes from
tensor shapes, num_reqs and max_query_len only; per-request lengths are read
on the device, so the launch never syncs and can be captured in a CUDA graph.
Padded request rows (q_len 0, seq_len 0) loop over no keys and store nothing.
One extra request row of programs stores zeros for the query tokens past the
last request's end (graph padding), so the output needs no separate fill
and padded rows stay exactly zero, as a graph-vs-eager check compares them.

Decode and verification batches too small to occupy the GPU (one query tile
per request, fewer programs than SMs) split each request's keys over up to
NUM_SPLITS programs (flash-decoding): at batch 1 Llama-3-8B has 8 KV heads,
so 8 programs on 132 SMs would each walk the whole context alone. A context
of at most MIN_CHUNK keys stays in one part, which writes the output as an
unsplit program does. Otherwise each part stores its unnormalised output
with its running max and sum, counts itself in with an atomic, and the last
part to finish merges all parts in part order (so the result does not depend
on which finished last) and resets the count: one launch, no second kernel.
The split count follows from shapes only, so a captured graph keeps it for
any context length; the counters assume one stream runs the attention.

An FP8 cache (docs/design.md, 'FP8 KV cache') is read as stored: e4m3 converts exactly to the dot's
type, the layer's k_scale joins the softmax scale and v_scale multiplies the output once, which equals
dequantizing every key and value first.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from specserve.attention.kv_quant import KVScales
from specserve.attention.metadata import AttentionMetadata
from specserve.kernels.fp8_kv import cache_scales
from specserve.kernels.pdl import pdl_args, wait_for_previous
from specserve.kernels.reshape_and_cache import write_kv_cache_triton


@triton.jit
def _zero_padding(out_ptr, last_end_ptr, num_tokens, kv_head, first, step, stride_ot, stride_oh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr):
    """Zeros for this KV head's query heads of the tokens last_end..num_tokens, BLOCK_Q tokens every step."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + offs_m % GROUP
    zeros = tl.zeros([BLOCK_M, HEAD_DIM], dtype=out_ptr.dtype.element_ty)
    for start in range(tl.load(last_end_ptr) + first, num_tokens, step):
        tok = start + offs_m // GROUP
        valid = (offs_m < BLOCK_Q * GROUP) & (tok < num_tokens)
        o_off = tok.to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_ptr + o_off[:, None] + offs_d[None, :], zeros, mask=valid[:, None])


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    qk_scale,  # softmax scale times log2(e): the kernel works in base 2
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,  # the key and value caches share one layout
    stride_bt, block_size, num_reqs, num_tokens,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows of a tile: BLOCK_Q tokens x GROUP heads, padded to a power of two
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,  # multiply in float32 whatever the input dtype
    NUM_SPLITS: tl.constexpr,  # parts a tile's keys may split into (1: never)
    MIN_CHUNK: tl.constexpr,  # fewest keys a part holds: shorter contexts stay whole
    part_acc_ptr, part_max_ptr, part_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS(, HEAD_DIM)] float32
    counter_ptr,  # int32 per (request, KV head, tile), zero between launches
    tree_bits_ptr, tree_offset,  # trees of drafts (AttentionMetadata.tree_bits), read when TREE
    TREE: tl.constexpr,
    k_scale_ptr, v_scale_ptr,  # an FP8 cache's scales, read when FP8
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2) % NUM_SPLITS
    tile = tl.program_id(2) // NUM_SPLITS
    tile_start = tile * BLOCK_Q
    if req == num_reqs:
        if split == 0:
            _zero_padding(out_ptr, query_start_loc_ptr + num_reqs, num_tokens, kv_head, tile_start,
                          tl.num_programs(2) // NUM_SPLITS * BLOCK_Q, stride_ot, stride_oh, GROUP, HEAD_DIM,
                          BLOCK_M, BLOCK_Q)
        return

    if FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = tile_start + offs_m // GROUP  # query index within the request
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = seq_len - q_len + tok
    if TREE:
        tree_start = seq_len - q_len - tree_offset
        tree_bits = tl.load(tree_bits_ptr + q_start + tok, mask=row_valid, other=-1)

    q_off = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    dot_ty = tl.float32 if DOT_FP32 else q_ptr.dtype.element_ty
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_valid[:, None], other=0.0).to(dot_ty)

    # Keys past this tile's last query position are invisible to all its rows.
    # A tile past the request's queries (or a padded request) reads no keys.
    tile_end = tl.minimum(q_len, tile_start + BLOCK_Q)
    kv_total = tl.where(tile_start < q_len, seq_len - q_len + tile_end, 0)
    # This program's part of the keys: whole BLOCK_N tiles; parts past the keys have nothing to do.
    chunk = tl.maximum(tl.cdiv(tl.cdiv(kv_total, NUM_SPLITS), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    parts = tl.cdiv(kv_total, chunk)
    if (split > 0) & (split >= parts):
        return
    kv_start = split * chunk
    kv_end = tl.minimum(kv_total, kv_start + chunk)

    # A finite initial max keeps exp2(m_i - m_new) free of inf - inf in a row
    # that sees no key (only possible if q_len > seq_len, i.e. bad metadata).
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(kv_start, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_end
        # Positions map to cache slots through the block table; masked-off
        # positions read neither the table nor the cache.
        phys = tl.load(block_table_ptr + req * stride_bt + offs_n // block_size, mask=n_valid, other=0)
        kv_off = phys.to(tl.int64) * stride_cb + (offs_n % block_size) * stride_cs + kv_head * stride_ch

        k = tl.load(k_cache_ptr + kv_off[None, :] + offs_d[:, None], mask=n_valid[None, :], other=0.0)
        # IEEE: float32 operands must not silently drop to tf32.
        qk = tl.dot(q, k.to(dot_ty), input_precision="ieee") * qk_scale
        visible = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if TREE:
            rel = offs_n - tree_start
            seen = (tree_bits[:, None] >> tl.minimum(tl.maximum(rel, 0), 31)[None, :]) & 1
            visible = visible & ((rel < 0)[None, :] | (seen != 0))
        qk = tl.where(visible, qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # Masked values load as zero: a stale NaN in the cache must not leak through 0 * NaN.
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_ty), v.to(dot_ty), input_precision="ieee")
        m_i = m_new

    if NUM_SPLITS > 1:
        if parts > 1:
            part = ((q_start + tok).to(tl.int64) * tl.num_programs(1) * GROUP + head) * NUM_SPLITS + split
            tl.store(part_max_ptr + part, m_i, mask=row_valid)
            tl.store(part_sum_ptr + part, l_i, mask=row_valid)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_valid[:, None])
            # Every thread's stores are done before the count (released at GPU scope) says so.
            tl.debug_barrier()
            slot = (req * tl.num_programs(1) + kv_head) * (tl.num_programs(2) // NUM_SPLITS) + tile
            if tl.atomic_add(counter_ptr + slot, 1, sem="acq_rel") != parts - 1:
                return
            tl.atomic_xchg(counter_ptr + slot, 0)
            m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            first = part - split
            for s in range(0, parts):
                # From L2: other SMs wrote these.
                m_s = tl.load(part_max_ptr + first + s, mask=row_valid, other=-1.0e30, cache_modifier=".cg")
                l_s = tl.load(part_sum_ptr + first + s, mask=row_valid, other=0.0, cache_modifier=".cg")
                acc_s = tl.load(part_acc_ptr + (first + s)[:, None] * HEAD_DIM + offs_d[None, :],
                                mask=row_valid[:, None], other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m_i, m_s)
                alpha, beta = tl.exp2(m_i - m_new), tl.exp2(m_s - m_new)
                l_i = l_i * alpha + l_s * beta
                acc = acc * alpha[:, None] + acc_s * beta[:, None]
                m_i = m_new
    if FP8:
        acc = acc * tl.load(v_scale_ptr)
    # A row that saw no key outputs zero rather than NaN.
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_off = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :], acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


# Programs a split decode batch aims for: about one per SM of an H100 (132). Under the CPU interpreter every
# program costs Python time, and the tests set their own.
SPLIT_TARGET_PROGRAMS = 128
MAX_SPLITS = 32
# Contexts up to this many keys stay in one part: below it, writing and merging the parts costs more than
# walking the keys in parallel saves (BENCHMARKS.md, 'Kernel choices').
MIN_CHUNK = 512


def num_kv_splits(num_reqs: int, num_kv_heads: int, query_tiles: int, on_cpu: bool) -> int:
    """Parts each request's keys split into: a power of two filling SPLIT_TARGET_PROGRAMS programs, for
    batches of few query tiles (decode, verification, a short chunk at batch 1); 1 otherwise and on the CPU."""
    programs = num_reqs * num_kv_heads * query_tiles
    if on_cpu or 2 * programs > SPLIT_TARGET_PROGRAMS:
        return 1
    return min(MAX_SPLITS, 1 << (SPLIT_TARGET_PROGRAMS // programs).bit_length() - 1)


# Keys per loop step of a 16-row tile (decode, short verification) with heads of <= 64: a small model's
# decode attention is a chain of dependent loads (block table, keys, values) per step, so fewer, wider
# steps finish sooner; past 128 keys a step they gain nothing (BENCHMARKS.md, 'Kernel choices').
NARROW_HEAD_DECODE_BLOCK_N = 128


# Queries of at most this many tokens a request (verifying a tree of drafts) take 16-row tiles when the batch
# is small: in 64-row tiles SmolLM2 verifying 17 tokens at batch 1 gets 3 programs, each walking the keys in
# the narrow steps of a prefill; 16-row tiles give it 12, each with the wide key steps of a decode
# (BENCHMARKS.md, 'Kernel choices').
MAX_NARROW_TILE_QUERY_LEN = 32


def _pow2_at_least(n: int) -> int:
    """triton.next_power_of_2 for n >= 1, as plain integer arithmetic: the warm-up's plan asks attention_launch
    about every (batch, query length), where Triton's constexpr-function wrapper costs microseconds a call."""
    return 1 << (n - 1).bit_length()


def _tile_sizes(group: int, max_query_len: int, head_dim: int, on_cpu: bool, programs_a_tile: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): small tiles under the CPU interpreter, where every
    tile costs Python time; on the GPU, rows just cover a decode/verify batch
    and are capped at 64 for prefill so the fp32 accumulator stays in registers.
    programs_a_tile: the programs of one query tile per request (requests x KV heads)."""
    min_rows = max(16, _pow2_at_least(group))  # tl.dot needs 16 rows; a tile holds a whole group
    block_m = max(min_rows, min(_pow2_at_least(group * max_query_len), 16 if on_cpu else 64))
    if (min_rows == 16 and max_query_len <= MAX_NARROW_TILE_QUERY_LEN
            and programs_a_tile * -(-max_query_len // (16 // group)) <= SPLIT_TARGET_PROGRAMS):
        block_m = 16
    if on_cpu:
        return block_m, 16
    if block_m == 16 and head_dim <= 64:
        return block_m, NARROW_HEAD_DECODE_BLOCK_N
    return block_m, 64 if head_dim <= 128 else 32


class AttentionLaunch(NamedTuple):
    """The compile-time sizes of one attention launch: each distinct one is a kernel Triton compiles."""

    block_m: int
    block_n: int
    block_q: int
    splits: int


def attention_launch(num_reqs: int, max_query_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                     on_cpu: bool) -> AttentionLaunch:
    """The tiles and key splits of a batch of num_reqs requests, the longest query max_query_len tokens (the one
    place that decides them, for attend() and the start-up warm-up)."""
    group = num_heads // num_kv_heads
    block_m, block_n = _tile_sizes(group, max_query_len, head_dim, on_cpu, num_reqs * num_kv_heads)
    block_q = block_m // group
    splits = num_kv_splits(num_reqs, num_kv_heads, -(-max_query_len // block_q), on_cpu)
    return AttentionLaunch(block_m, block_n, block_q, splits)


class TritonAttentionBackend:
    name = "triton"

    def __init__(self):
        self._split_counters: dict[torch.device, torch.Tensor] = {}

    launch_variant = staticmethod(attention_launch)

    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata, scale: float,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        write_kv_cache_triton(k, v, kv_cache, metadata.slot_mapping, kv_scales)
        return self.attend(q, kv_cache, metadata, scale, kv_scales)

    def attend(self, q, kv_cache, metadata: AttentionMetadata, scale: float,
               kv_scales: KVScales | None = None) -> torch.Tensor:
        if metadata.num_reqs == 0 or metadata.max_query_len == 0:
            return torch.zeros_like(q)
        # The kernel writes every row, graph padding included (as zeros).
        out = torch.empty_like(q)
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = kv_cache.shape[3]
        assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        assert head_dim >= 16 and head_dim == triton.next_power_of_2(head_dim), "head_dim must be a power of two >= 16"
        assert q.stride(2) == 1 and out.stride(2) == 1 and kv_cache.stride(4) == 1

        group = num_heads // num_kv_heads
        on_cpu = q.device.type == "cpu"  # only the interpreter runs Triton on CPU tensors
        block_m, block_n, block_q, splits = attention_launch(metadata.num_reqs, metadata.max_query_len, num_heads,
                                                             num_kv_heads, head_dim, on_cpu)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_scale, v_scale, fp8 = cache_scales(kv_cache, kv_scales)
        query_tiles = triton.cdiv(metadata.max_query_len, block_q)
        parts, counters = [out] * 3, out
        if splits > 1:
            part = q.shape[0] * num_heads * splits
            parts = [torch.empty(part * head_dim, device=q.device), torch.empty(part, device=q.device),
                     torch.empty(part, device=q.device)]
            counters = self._counters(q.device)
        # One more request row than requests: its programs zero the padding tokens.
        grid = (metadata.num_reqs + 1, num_kv_heads, query_tiles * splits)
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out,
            metadata.query_start_loc, metadata.seq_lens, metadata.block_table,
            scale * math.log2(math.e),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            metadata.block_table.stride(0), kv_cache.shape[2], metadata.num_reqs, q.shape[0],
            GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
            # The interpreter multiplies bfloat16 dot operands as raw integer bits.
            DOT_FP32=on_cpu and q.dtype == torch.bfloat16,
            NUM_SPLITS=splits, MIN_CHUNK=MIN_CHUNK, part_acc_ptr=parts[0], part_max_ptr=parts[1],
            part_sum_ptr=parts[2], counter_ptr=counters,
            tree_bits_ptr=out if metadata.tree_bits is None else metadata.tree_bits, tree_offset=metadata.tree_offset,
            TREE=metadata.tree_bits is not None, k_scale_ptr=k_scale, v_scale_ptr=v_scale, FP8=fp8,
            **pdl_args(q.device),
        )
        return out

    def _counters(self, device: torch.device) -> torch.Tensor:
        """The split counts' persistent zeros on device, one per (request, KV head) a split batch can have."""
        if device not in self._split_counters:
            self._split_counters[device] = torch.zeros(SPLIT_TARGET_PROGRAMS, dtype=torch.int32, device=device)
        return self._split_counters[device]
