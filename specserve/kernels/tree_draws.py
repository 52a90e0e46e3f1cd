"""The Triton kernels of spec_decode/sampled_tree.py's TreeSampling.guesses: a node's children drawn from the
head's logits in three launches a depth, with no [rows, V] tensor between them.

For each row (one node of one request) the head's distribution q = softmax(logits / temperature) is rounded to
NODE_PROBS_DTYPE, kept where the node has children, and its k children are the top k of q / Exponential(1) noise
(Gumbel-top-k: k draws without replacement), or of q itself for a greedy request. The noise comes from Philox
(tl.rand) under a seed drawn from the caller's torch generator on the device, so that a CUDA graph replaying
the launches draws new numbers each replay, as the torch ops they replace did.

1. _block_sums: over each block of BLOCK tokens of a row, the logits' maximum and the sum of exp(x - maximum).
2. _block_draws: each block combines its row's block sums into softmax's normaliser, writes q (rounded) where
   the row keeps it, and leaves its own k best scores and their tokens.
3. _row_draws: each row's k best of its blocks' candidates; a draw past q's support (score 0) repeats the
   first, as the torch ops do (verification skips it).

Ties go to the lower token id. The rows' scores are those of the torch ops up to float rounding in softmax's
normaliser, so q may differ from theirs in its last bit; what must hold, that the children are drawn from the
q that is kept, holds within the kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens a program reads: the default model's vocabulary of 49,152 in 12 blocks.
BLOCK = 4096


@triton.jit
def _block_sums(logits_ptr, logits_stride, temperature_ptr, sums_ptr, V, M, NB, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    v = b * BLOCK + tl.arange(0, BLOCK)
    t = tl.load(temperature_ptr + r // M)
    x = tl.load(logits_ptr + r * logits_stride + v, mask=v < V, other=float("-inf")).to(tl.float32) / t
    top = tl.max(x, axis=0)
    # A block the logits rule out entirely (a grammar's mask) adds nothing.
    safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp(x - safe), axis=0)
    tl.store(sums_ptr + (r * NB + b) * 2, top)
    tl.store(sums_ptr + (r * NB + b) * 2 + 1, total)


@triton.jit
def _block_draws(logits_ptr, logits_stride, temperature_ptr, greedy_ptr, sums_ptr, dest_ptr, q_ptr, seed_ptr,
                 scores_ptr, tokens_ptr, V, M, NB, K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_NB: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    v = b * BLOCK + lanes
    inside = v < V
    t = tl.load(temperature_ptr + r // M)
    greedy = tl.load(greedy_ptr + r // M) != 0
    blocks = tl.arange(0, BLOCK_NB)
    tops = tl.load(sums_ptr + (r * NB + blocks) * 2, mask=blocks < NB, other=float("-inf"))
    totals = tl.load(sums_ptr + (r * NB + blocks) * 2 + 1, mask=blocks < NB, other=0.0)
    top = tl.max(tops, axis=0)
    norm = tl.sum(tl.where(tops == float("-inf"), 0.0, totals * tl.exp(tops - top)), axis=0)
    x = tl.load(logits_ptr + r * logits_stride + v, mask=inside, other=float("-inf")).to(tl.float32) / t
    q = tl.exp(x - top) / norm
    # q rounded to bfloat16, to nearest even, by its bits (Triton's interpreter truncates a cast): exact in both.
    bits = q.to(tl.uint32, bitcast=True)
    kept = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
    dest = tl.load(dest_ptr + r)
    tl.store(q_ptr + dest * V + v, kept.to(tl.bfloat16), mask=inside & (dest + v * 0 >= 0))
    u = tl.rand(tl.load(seed_ptr), r * V + v)
    # Exponential(1) noise; u = 0 gives infinite noise, a score of 0: that token is not drawn.
    drawn = kept / -tl.log(u)
    score = tl.where(inside, tl.where(greedy, q, drawn), -1.0)
    out = (r * NB + b) * K
    for j in tl.static_range(K):
        best = tl.max(score, axis=0)
        at = tl.argmax(score, axis=0, tie_break_left=True)
        tl.store(scores_ptr + out + j, best)
        tl.store(tokens_ptr + out + j, b * BLOCK + at)
        score = tl.where(lanes == at, -2.0, score)


@triton.jit
def _row_draws(scores_ptr, tokens_ptr, top_ptr, NB, K: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    score = tl.load(scores_ptr + r * NB * K + c, mask=c < NB * K, other=-2.0)
    token = tl.load(tokens_ptr + r * NB * K + c, mask=c < NB * K, other=0)
    first = token.to(tl.int64) * 0
    for j in tl.static_range(K):
        best = tl.max(score, axis=0)
        # Candidates of the lower token first among equal scores (blocks are in token order).
        at = tl.argmax(score, axis=0, tie_break_left=True)
        chosen = tl.sum(tl.where(c == at, token, 0), axis=0).to(tl.int64)
        if j == 0:
            first = chosen
        # Past q's support a draw scores 0: it repeats the first draw, which verification then skips.
        tl.store(top_ptr + r * K + j, tl.where(best > 0, chosen, first))
        score = tl.where(c == at, -3.0, score)


def draw_children(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, k: int,
                  dest: torch.Tensor, node_probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[R, k] int64: the children after each of R = n * m rows of logits ([R, V], request-major; temperature [n]
    float32, greedy [n] bool): a greedy request's top k guesses, a sampling request's k draws without
    replacement from q. q, rounded to node_probs' type, is written to node_probs' row dest[r] (node_probs viewed
    as [rows, V]; dest [R] int64, -1 where the row keeps none)."""
    if node_probs.dtype != torch.bfloat16:
        raise TypeError(f"draw_children keeps q in bfloat16, not {node_probs.dtype}")
    rows, vocab = logits.shape
    m = rows // temperature.shape[0]
    block = min(BLOCK, triton.next_power_of_2(vocab))
    nb = triton.cdiv(vocab, block)
    device = logits.device
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    sums = torch.empty(rows, nb, 2, dtype=torch.float32, device=device)
    scores = torch.empty(rows, nb, k, dtype=torch.float32, device=device)
    tokens = torch.empty(rows, nb, k, dtype=torch.int32, device=device)
    top = torch.empty(rows, k, dtype=torch.int64, device=device)
    seed = torch.randint(0, 2 ** 31 - 1, (1,), dtype=torch.int64, device=device, generator=generator)
    _block_sums[(rows, nb)](logits, logits.stride(0), temperature, sums, vocab, m, nb, BLOCK=block, num_warps=8)
    _block_draws[(rows, nb)](logits, logits.stride(0), temperature, greedy, sums, dest, node_probs, seed, scores,
                             tokens, vocab, m, nb, K=k, BLOCK=block, BLOCK_NB=triton.next_power_of_2(nb),
                             num_warps=8)
    _row_draws[(rows,)](scores, tokens, top, nb, K=k, BLOCK_C=triton.next_power_of_2(nb * k))
    return top
