"""Small-M fused projection kernels against cuBLAS, per op and per decoder layer, on a CUDA device.

    python benchmarks/bench_fused_linear.py [--dtype bfloat16] [--tokens 1 4 16] [--shapes smollm2-135m llama3-8b]

For each decode shape and token count, every op of a decoder layer's small-M
path runs as:
  cublas            the projection alone (F.linear),
  cublas+kernels    the projection with the separate kernels the fused one
                    replaces (add + RMSNorm before it, rotary + KV write or
                    SiLU-and-mul after it), as the model runs above 16 tokens,
  fused default     the fused kernel with small_m_configs' choice,
  fused bn/bk/w/s   the fused kernel with each candidate configuration
                    (block_n, block_k, num_warps, num_stages),
then a whole decoder layer (attention over CONTEXT cached tokens per request)
three ways: plain torch ops, the fused path above the small-M threshold
(cuBLAS + Triton kernels: "before") and the small-M path ("after").

Times are GPU microseconds per call, from CUDA-graph replays (graph_time_us).
Each call reads the next of several copies of its weights, together well
over the H100's 50 MB L2, so that the times are of DRAM reads, not of the
cache. GB/s is weight bytes over time; floor is weight bytes at 3.0 TB/s.
"""
from __future__ import annotations

import argparse
import copy
import itertools

import torch
import torch.nn.functional as F
from bench_kernels import BLOCK_SIZE, CONTEXT, SHAPES, arch_of, decode_metadata, graph_time_us

from specserve.attention.backend import get_attention_backend
from specserve.kernels.activation import silu_and_mul
from specserve.kernels.fused_linear import fused_linear
from specserve.kernels.qkv_rotary_cache import qkv_rotary_cache
from specserve.kernels.rmsnorm import fused_add_rms_norm
from specserve.kernels.rotary_cache import rotary_and_cache
from specserve.kernels.small_m_configs import CANDIDATES
from specserve.models import layers
from specserve.models.layers import RotaryEmbedding, set_fused_kernels
from specserve.models.llama import DecoderLayer

# Bytes of weights one timing cycles through: four times the H100's L2.
ROTATION_BYTES = 200 << 20
PEAK_BYTES_PER_US = 3.0e6  # 3.0 TB/s, measured on the H100
EPS = 1e-5


def copies_for(nbytes: int) -> int:
    return max(2, -(-ROTATION_BYTES // nbytes))


def rotating_time_us(fn, copies: int) -> float:
    """GPU us per call of fn(i), the captured calls cycling i through range(copies)."""
    counter = itertools.count()
    return graph_time_us(lambda: fn(next(counter) % copies), reps=max(20, copies))


def op_cases(shape: str, m: int, dtype: torch.dtype) -> list[tuple[str, int, dict]]:
    """[(op, weight bytes, {variant: fn(i)})] for one shape and token count."""
    arch = arch_of(shape)
    hidden, inter = arch.hidden_size, arch.intermediate_size
    heads, kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
    q_size, kv_size = heads * head_dim, kv_heads * head_dim

    def rand(*size):
        return torch.randn(*size, device="cuda", dtype=dtype)

    def weights(n: int, k: int) -> list[torch.Tensor]:
        return [rand(n, k) * k**-0.5 for _ in range(copies_for(n * k * rand(1).element_size()))]

    x, residual, norm_weight = rand(m, hidden), rand(m, hidden), rand(hidden)
    rotary = RotaryEmbedding(head_dim, arch.max_position_embeddings, arch.rope_theta, {}).cuda()
    positions = torch.randint(0, arch.max_position_embeddings, (m,), device="cuda")
    cache = rand(2, -(-m // BLOCK_SIZE), BLOCK_SIZE, kv_heads, head_dim)
    slots = torch.arange(m, device="cuda")
    attn_out, act = rand(m, q_size), rand(m, inter)
    w_qkv, w_o = weights(q_size + 2 * kv_size, hidden), weights(hidden, q_size)
    w_gate_up, w_down = weights(2 * inter, hidden), weights(hidden, inter)

    def qkv_separate(i):
        normed, _ = fused_add_rms_norm(x, residual, norm_weight, EPS)
        q, k, v = F.linear(normed, w_qkv[i]).split([q_size, kv_size, kv_size], dim=-1)
        rotary_and_cache(positions, q.view(m, heads, head_dim), k.view(m, kv_heads, head_dim),
                         v.view(m, kv_heads, head_dim), rotary.cos, rotary.sin, cache, slots)

    def qkv_fused(cfg):
        return lambda i: qkv_rotary_cache(x, w_qkv[i], positions, rotary.cos, rotary.sin, cache, slots, heads,
                                          norm_weight=norm_weight, eps=EPS, residual=residual, config=cfg)

    def gate_up_separate(i):
        normed, _ = fused_add_rms_norm(x, residual, norm_weight, EPS)
        silu_and_mul(F.linear(normed, w_gate_up[i]))

    def gate_up_fused(cfg):
        return lambda i: fused_linear(x, w_gate_up[i], norm_weight=norm_weight, eps=EPS, residual=residual,
                                      silu_mul=True, config=cfg)

    def plain_fused(inp, ws):
        return lambda cfg: lambda i: fused_linear(inp, ws[i], config=cfg)

    cases = [
        ("add+norm+qkv+rotary+cache", w_qkv, lambda i: F.linear(x, w_qkv[i]), qkv_separate, qkv_fused),
        ("o_proj", w_o, lambda i: F.linear(attn_out, w_o[i]), None, plain_fused(attn_out, w_o)),
        ("add+norm+gate_up+silu", w_gate_up, lambda i: F.linear(x, w_gate_up[i]), gate_up_separate,
         gate_up_fused),
        ("down_proj", w_down, lambda i: F.linear(act, w_down[i]), None, plain_fused(act, w_down)),
    ]
    result = []
    for op, ws, cublas, separate, fused in cases:
        variants = {"cublas": cublas}
        if separate is not None:
            variants["cublas+kernels"] = separate
        variants["fused default"] = fused(None)
        # The qkv kernel's block_n counts rotary pairs of one head: no more than half a head. Split-K is for
        # the plain projections (no prologue, no epilogue) only.
        for cfg in CANDIDATES:
            if (op.endswith("cache") and cfg.block_n > head_dim // 2) or (cfg.split_k > 1 and separate is not None):
                continue
            split = f"/s{cfg.split_k}" if cfg.split_k > 1 else ""
            variants[f"fused {cfg.block_n}/{cfg.block_k}/{cfg.num_warps}/{cfg.num_stages}{split}"] = fused(cfg)
        result.append((op, ws[0].numel() * ws[0].element_size(), variants, len(ws)))
    return result


def layer_cases(shape: str, m: int, dtype: torch.dtype):
    """(weight bytes, copies, {variant: fn(i)}) of a whole decoder layer over m decode requests."""
    arch = arch_of(shape)
    layer = DecoderLayer(arch, get_attention_backend("triton")).to(device="cuda", dtype=dtype)
    nbytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    copies = copies_for(nbytes)
    stack = [layer] + [copy.deepcopy(layer) for _ in range(copies - 1)]
    rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta, {}).cuda()
    metadata = decode_metadata(m)
    caches = [torch.randn(2, m * CONTEXT // BLOCK_SIZE, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim,
                          device="cuda", dtype=dtype) for _ in range(copies)]
    positions = torch.full((m,), CONTEXT - 1, device="cuda")
    x, residual = (torch.randn(m, arch.hidden_size, device="cuda", dtype=dtype) for _ in range(2))

    def run(fused: bool, small_m_max_tokens: int, fold: bool = False):
        def fn(i):
            set_fused_kernels(stack[i], fused)
            layers.SMALL_M_MAX_TOKENS = small_m_max_tokens
            layers.FOLD_NORM_MAX_WEIGHT_BYTES = 1 << 62 if fold else 0
            layers.FOLD_NORM_ANY_WEIGHT_MAX_TOKENS = 0
            return stack[i](x, positions, rotary, caches[i], metadata, residual)
        return fn

    # "norms folded" forces the folding on whatever the weight size and "norms apart" forces it off (the
    # default folds up to FOLD_NORM_MAX_WEIGHT_BYTES, SmolLM2, and at FOLD_NORM_ANY_WEIGHT_MAX_TOKENS).
    variants = {"torch ops": run(False, 0), "before: cublas+kernels": run(True, 0),
                "small-M o_proj/down_proj, norms apart": run(True, 16),
                "small-M, norms folded into qkv and gate_up": run(True, 16, fold=True)}
    return nbytes, copies, variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fused_linear needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    defaults = layers.SMALL_M_MAX_TOKENS, layers.FOLD_NORM_MAX_WEIGHT_BYTES, layers.FOLD_NORM_ANY_WEIGHT_MAX_TOKENS
    print(f"{torch.cuda.get_device_name()}, {args.dtype}; GPU us per call under a CUDA graph, weights rotated "
          f"over >= {ROTATION_BYTES >> 20} MB\n")
    print("| shape | M | op | variant | us | weight GB/s | floor us | vs cublas |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    with torch.no_grad():
        for shape in args.shapes:
            for m in args.tokens:
                groups = op_cases(shape, m, dtype)
                nbytes, copies, variants = layer_cases(shape, m, dtype)
                groups.append((f"decoder layer (decode, ctx {CONTEXT})", nbytes, variants, copies))
                for op, nbytes, variants, copies in groups:
                    times = {}
                    for name, fn in variants.items():
                        try:
                            times[name] = rotating_time_us(fn, copies)
                        except Exception as e:  # a candidate config can exceed shared memory or registers
                            print(f"| {shape} | {m} | {op} | {name} | failed: {type(e).__name__} | | | |")
                            continue
                    base = next(iter(times.values()))
                    fused = {n: t for n, t in times.items() if n.startswith("fused ") and n != "fused default"}
                    best = min(fused, key=fused.get) if fused else None
                    for name, t in times.items():
                        mark = " (best)" if name == best else ""
                        print(f"| {shape} | {m} | {op} | {name}{mark} | {t:.2f} | {nbytes / t / 1e3:.0f} | "
                              f"{nbytes / PEAK_BYTES_PER_US:.2f} | {base / t:.2f}x |", flush=True)
                (layers.SMALL_M_MAX_TOKENS, layers.FOLD_NORM_MAX_WEIGHT_BYTES,
                 layers.FOLD_NORM_ANY_WEIGHT_MAX_TOKENS) = defaults


if __name__ == "__main__":
    main()
