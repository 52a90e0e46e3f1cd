"""Launch configurations of the small-M projection kernels, per shape class.

At M <= 32 a projection reads its weight once and does almost no arithmetic,
so a configuration is judged by how well it keeps the memory system busy:
enough programs to occupy every SM (132 on an H100), enough bytes in flight
per SM (block_n x block_k x num_stages weight elements) to cover the DRAM
latency, and few enough K iterations that a small weight is not bound by
the loop's latency. The picks below follow that arithmetic for the two
decode shapes this engine is tuned on, SmolLM2-135M and Llama-3-8B;
benchmarks/bench_fused_linear.py times every CANDIDATES entry beside them on
the GPU, and this table should hold the measured best.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class SmallMConfig:
    # Output columns per program; in the qkv kernel, rotary pairs per program (columns of each half-head).
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # With a norm prologue: compute it on the token rows only and repeat them over the tile's rows
    # (small_m_prologue.py). Ignored without one.
    compact: bool = False
    # Programs each column tile's K is split over (fused_linear.py), for plain projections only: few output
    # columns over a long K leave most SMs idle in one program a tile.
    split_k: int = 1


# Up to this many weight bytes a projection is latency-bound (SmolLM2-135M: 0.7 to 3.5 MB). Measured best
# on an H100 (benchmarks/bench_fused_linear.py, 2026-11-23): down_proj 1536x576 in 4.08 us (cuBLAS 5.15),
# o_proj 576x576 in 3.37 us (cuBLAS 3.52); narrow tiles spread a 576-column output over 36 programs,
# and long K chunks keep the loop short.
SMALL_WEIGHT_BYTES = 16 << 20
SMALL = SmallMConfig(block_n=16, block_k=512, num_warps=4, num_stages=3)
# Up to SHORT_K input features, 512-element chunks leave the second of two K iterations nearly all mask:
# SmolLM2's o_proj (K = 576) runs 3.25 us in 32 x 128 tiles against SMALL's 3.32 at one token and 3.45 at
# five (results/h100_2026-11-24_s14_configs_confirm.txt, medians of five); down_proj (K = 1536) stays on
# SMALL (4.08 us, against 5.18 in these tiles).
SHORT_K = 1024
SMALL_SHORT_K = SmallMConfig(block_n=32, block_k=128, num_warps=4, num_stages=4)
# Past LONG_K input features a small weight has few output columns (the shipped head's down_proj, 576 x 6144:
# 36 tiles of 16 columns for 132 SMs): K split over 8 programs a tile, 7.04 / 7.08 / 7.16 us at 1 / 4 / 16
# tokens against SMALL's 9.64 / 10.26 / 9.72 (results/h100_2026-11-24_s19_projections_split.txt, medians of
# three). SmolLM2's own down_proj (K = 1536) loses split (4.66 against 4.07 at one token) and stays on SMALL.
LONG_K = 4096
SMALL_LONG_K = SmallMConfig(block_n=32, block_k=128, num_warps=4, num_stages=4, split_k=8)
# Larger weights (Llama-3-8B: 33 to 235 MB) are bandwidth-bound. Measured best on the same run: o_proj
# 4096x4096 in 13.9 us (cuBLAS 16.4), down_proj 14336x4096 in 42.1 us (cuBLAS 44.5).
LARGE = SmallMConfig(block_n=32, block_k=256, num_warps=4, num_stages=4)
# A gate/up projection (two accumulators a program) or a qkv projection has outputs enough for wider tiles.
LARGE_WIDE = SmallMConfig(block_n=32, block_k=256, num_warps=4, num_stages=4)
# The qkv kernel's programs each own block_n rotary pairs of one head. Without a norm on a small weight (an
# EAGLE-3 head's qkv, K = 2 x hidden), 32 pairs, a whole 64-wide head: the shipped SmolLM2 head's 960 x 1152
# in 5.47 us at one token and 5.62 at five, against 16 pairs by 128's 6.25 and 6.17
# (results/h100_2026-11-24_s14_configs_confirm.txt). Llama-3-8B's 16 pairs give it 192 programs.
QKV_SMALL = SmallMConfig(block_n=32, block_k=256, num_warps=4, num_stages=3)
QKV_LARGE = SmallMConfig(block_n=16, block_k=256, num_warps=4, num_stages=4)

# With the RMSNorm (and residual add) prologue, measured best on an H100
# (benchmarks/bench_prologue_variants.py, results/h100_2026-11-23_prologue_variants.txt; the
# prologue's "prepass+compact/slice" and "prepass/slice" variants). One token over a large weight: the
# compact prologue, 32 columns by 256 of K (Llama-3-8B 1.06-1.09x cuBLAS plus separate kernels; on SmolLM2
# too until NORM_SMALL below measured faster).
NORM_ONE_TOKEN = SmallMConfig(block_n=32, block_k=256, num_warps=4, num_stages=4, compact=True)
# Weights up to MEDIUM_WEIGHT_BYTES at one token: the compact prologue in 32 x 256 tiles, three stages
# (results/h100_2026-11-24_s14_configs_confirm.txt, medians of five rounds, us at one token / five):
# SmolLM2's add+norm+gate_up 5.13 / 5.87 (NORM_ONE_TOKEN 5.26, the 16 x 64 tiles used at five 6.13), its
# qkv 4.93 / 5.79 (5.09 / 5.89) in 32 rotary pairs, the shipped head's MLP (6144 wide) 9.25 / 10.01
# (9.54 / 10.35), its lm_head with the argmax 11.44 / 12.58 (11.65 / 18.03).
NORM_SMALL = SmallMConfig(block_n=32, block_k=256, num_warps=4, num_stages=3, compact=True)
# The same weights over 2 to 16 tokens (a verify step, a draft pass): 64-element chunks six stages deep, without
# the compact prologue (results/h100_2026-11-24_s19_projections_m16.txt, medians of three, us at 16 tokens):
# SmolLM2's add+norm+gate_up 5.87 (NORM_SMALL 6.63), its qkv in 32 rotary pairs 5.58 (6.02). At four tokens
# the eighteenth session's sweep (without this candidate) had 16 x 64 tiles ahead of NORM_SMALL likewise.
NORM_FEW_TOKENS = SmallMConfig(block_n=32, block_k=64, num_warps=4, num_stages=6)
# Past MEDIUM_WEIGHT_BYTES (the shipped head's MLP and lm_head, 14 MB each) the output is wide enough for
# wider tiles in short chunks, at 1 to 16 tokens (s19_projections_m1/_m4_head/_m16.txt, us at 1 / 4 / 16
# tokens, NORM_SMALL in brackets): the head's add+norm+gate_up 8.47 / 8.50 / 8.92 (9.24 / 11.98 / 11.39);
# its lm_head with the argmax in 128 columns, NORM_MEDIUM_ONE_ACC, 10.45 / 10.76 / - (11.54 / 14.56 / 14.91).
MEDIUM_WEIGHT_BYTES = 8 << 20
NORM_MEDIUM = SmallMConfig(block_n=64, block_k=64, num_warps=4, num_stages=4)
NORM_MEDIUM_ONE_ACC = SmallMConfig(block_n=128, block_k=64, num_warps=4, num_stages=4)
# Llama-3-8B's best kernel of this kind at 4 tokens was 32/256 (0.88x and 0.96x the separate kernels: the
# model keeps its norms apart there, see models/layers.py).
NORM_LARGE = SmallMConfig(block_n=32, block_k=256, num_warps=4, num_stages=4)
# The qkv kernel at one token over a large weight (Llama-3-8B, 50 MB): 32 rotary pairs a program, 256 of K,
# without the compact prologue, 22.3 us with rotary and the cache write; cuBLAS plus the norm and rotary
# kernels 26.8, NORM_ONE_TOKEN's 16 pairs 27.7 (results/h100_2026-11-23_s5_fused_linear_8b.txt).
QKV_NORM_ONE_TOKEN_LARGE = SmallMConfig(block_n=32, block_k=256, num_warps=4, num_stages=4)

# Past TALL_ABOVE tokens the kernels run 32-row tiles (small_m_prologue.block_m), in which the configurations
# above lose to cuBLAS plus the separate kernels on small weights. Measured best on an H100 at 17 and 32 rows
# (2026-11-24, seventeenth session, a helper's timing script whose raw output was not kept; bfloat16, medians
# of three, us at 17 / 32; the 16-row configuration, then cuBLAS plus the separate kernels,
# in brackets): SmolLM2's add+norm+gate_up+SiLU 6.99 / 7.00 (10.01 / 9.99; 7.64 / 7.54) and its qkv in 16
# rotary pairs 7.22 / 7.06 (9.60 / 9.15; 7.82 / 7.93). Projections without a prologue keep their tiles: o_proj
# and down_proj in SMALL_SHORT_K and SMALL 3.57 / 3.59 and 4.83 / 4.48 (cuBLAS 3.50 / 3.53 and 4.87 / 4.91),
# Llama-3-8B's in LARGE 14.48 / 14.41 and 43.45 / 43.66 (14.18 / 14.42 and 45.22 / 45.71).
TALL_ABOVE = 16
TALL_NORM_SMALL = SmallMConfig(block_n=16, block_k=64, num_warps=4, num_stages=4)
# One accumulator over a wide output, the shipped head's lm_head with the argmax (12,288 columns): wide tiles,
# fewer programs to reread the prologue, 11.90 / 12.74 (18.24 / 18.40; 12.74 / 12.95).
TALL_NORM_SMALL_ONE_ACC = SmallMConfig(block_n=128, block_k=64, num_warps=4, num_stages=4)
# The head's qkv without a norm (K = 2 x hidden): 6.58 / 6.21 (QKV_SMALL 8.39 / 8.01; 7.03 / 7.05).
TALL_QKV_SMALL = SmallMConfig(block_n=16, block_k=128, num_warps=4, num_stages=4)

# Triton's interpreter on CPU, where every program and every loop iteration costs Python time: blocks
# large enough for tiny test models, small enough that test shapes of ~100 still span several blocks
# and exercise the masks. num_warps and num_stages mean nothing there.
INTERPRETER = SmallMConfig(block_n=32, block_k=64, num_warps=1, num_stages=1)
# The qkv kernel's block_n counts rotary pairs: 16, tl.dot's minimum, also splits heads wider than 32.
INTERPRETER_QKV = SmallMConfig(block_n=16, block_k=64, num_warps=1, num_stages=1)

# What the benchmark sweeps: (block_n, block_k, num_warps, num_stages); then split-K forms of a few, which
# apply to plain projections only: ((block_n, block_k, num_warps, num_stages), split_k).
CANDIDATES = [SmallMConfig(*c) for c in [
    (16, 64, 4, 4), (16, 128, 4, 3), (16, 128, 4, 4), (16, 256, 4, 3), (16, 256, 4, 4), (16, 512, 4, 3),
    (16, 256, 8, 4), (32, 128, 4, 4), (32, 256, 4, 3), (32, 256, 4, 4), (32, 256, 8, 4), (64, 128, 4, 4),
    (64, 256, 8, 3),
    # Short chunks in deep pipelines (normed weights with K = 576), and wide tiles for wide outputs.
    (16, 64, 4, 6), (32, 64, 4, 4), (32, 64, 4, 6), (64, 64, 4, 4), (128, 64, 4, 4), (128, 64, 8, 4),
    # More bytes in flight per program, for long K over few output columns (the head's down_proj, K = 6144).
    (16, 512, 4, 4), (16, 512, 8, 4), (16, 1024, 8, 3), (16, 1024, 4, 2),
]] + [SmallMConfig(*c, split_k=s) for c, s in [
    ((16, 256, 4, 4), 2), ((16, 256, 4, 4), 4), ((16, 256, 4, 4), 8), ((16, 512, 4, 3), 2), ((16, 512, 4, 3), 4),
    ((32, 256, 4, 4), 4), ((16, 128, 4, 4), 4), ((16, 128, 4, 4), 8), ((32, 128, 4, 4), 8),
]]


def weight_bytes(weight: torch.Tensor) -> int:
    return weight.numel() * weight.element_size()


def _for_dtype(cfg: SmallMConfig, weight: torch.Tensor) -> SmallMConfig:
    # The stages of shared memory hold weight tiles: float32 tiles at the 16-bit sizes overflow the H100's
    # 227 KB (measured), so they take half as many K elements.
    if weight.element_size() > 2:
        return replace(cfg, block_k=cfg.block_k // 2)
    return cfg


def _norm_config(weight: torch.Tensor, m: int, wide: bool = True) -> SmallMConfig:
    if weight.device.type == "cpu":
        # The interpreter runs the compact prologue where the GPU does on small weights (every test's), so
        # the tests cover it; test_fused_linear runs the other prologue with a config of its own.
        return replace(INTERPRETER, compact=True)
    if weight_bytes(weight) <= SMALL_WEIGHT_BYTES:
        if m > TALL_ABOVE:
            return _for_dtype(TALL_NORM_SMALL if wide else TALL_NORM_SMALL_ONE_ACC, weight)
        if weight_bytes(weight) > MEDIUM_WEIGHT_BYTES:
            return _for_dtype(NORM_MEDIUM if wide else NORM_MEDIUM_ONE_ACC, weight)
        return _for_dtype(NORM_SMALL if m == 1 else NORM_FEW_TOKENS, weight)
    return _for_dtype(NORM_ONE_TOKEN if m == 1 else NORM_LARGE, weight)


def linear_config(weight: torch.Tensor, wide: bool, norm: bool = False, m: int = 16, top: bool = False) -> SmallMConfig:
    """The configuration for a projection with this weight over m tokens; wide: the gate/up kernel, two
    accumulators; norm: with the RMSNorm prologue; top: keeping each program's best columns (which, like
    the other prologues and epilogues, does not split K)."""
    if norm:
        return _norm_config(weight, m, wide)
    if weight.device.type == "cpu":
        return INTERPRETER
    if weight_bytes(weight) <= SMALL_WEIGHT_BYTES:
        if weight.shape[1] >= LONG_K and not (wide or top):
            return _for_dtype(SMALL_LONG_K, weight)
        return _for_dtype(SMALL_SHORT_K if weight.shape[1] <= SHORT_K else SMALL, weight)
    return _for_dtype(LARGE_WIDE if wide else LARGE, weight)


def qkv_config(weight: torch.Tensor, norm: bool = False, m: int = 16) -> SmallMConfig:
    """The qkv kernel's configuration; its block_n counts rotary pairs, half a tile's columns."""
    if norm:
        gpu, small = weight.device.type != "cpu", weight_bytes(weight) <= SMALL_WEIGHT_BYTES
        if gpu and small:
            # Measured as pairs (see NORM_SMALL, NORM_FEW_TOKENS, TALL_NORM_SMALL).
            few = NORM_SMALL if m == 1 else NORM_FEW_TOKENS
            return _for_dtype(TALL_NORM_SMALL if m > TALL_ABOVE else few, weight)
        if gpu and m == 1:
            return _for_dtype(QKV_NORM_ONE_TOKEN_LARGE, weight)
        # The measured column tiles as pairs; 16 pairs at least (tl.dot's minimum width).
        cfg = _norm_config(weight, m)
        return replace(cfg, block_n=max(16, cfg.block_n // 2))
    if weight.device.type == "cpu":
        return INTERPRETER_QKV
    if weight_bytes(weight) <= SMALL_WEIGHT_BYTES:
        return _for_dtype(TALL_QKV_SMALL if m > TALL_ABOVE else QKV_SMALL, weight)
    return _for_dtype(QKV_LARGE, weight)
