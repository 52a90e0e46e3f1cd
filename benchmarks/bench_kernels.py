"""Fused Triton kernels against the unfused torch path they replace, per op, on a CUDA device.

    python benchmarks/bench_kernels.py [--dtype bfloat16] [--tokens 1 64 512] [--shapes smollm2-135m llama3-8b]

Each op runs both ways through the model's own modules (the fused flag of
models/layers.py switched on and off). Times are GPU microseconds per call
replayed from a CUDA graph, as the engine's full graphs run them: launch
overhead is left out, the gaps between a graph's kernels are not. The "fp8
rows" ops are the norm or SiLU-and-mul kernel writing an FP8 projection's
per-token quantized input, against that kernel then kernels/fp8_rows.py. The last
row of each group is a whole decoder layer (GEMMs and Triton attention
included) over decode requests of CONTEXT cached tokens.
"""
from __future__ import annotations

import argparse

import torch

from specserve.attention.backend import get_attention_backend
from specserve.bench.gpu_timing import gpu_ms
from specserve.attention.metadata import AttentionMetadata
from specserve.kernels.activation import silu_and_mul, silu_and_mul_fp8_rows
from specserve.kernels.fp8_rows import quantize_rows
from specserve.kernels.reshape_and_cache import write_kv_cache_triton
from specserve.models.arch_config import ArchConfig
from specserve.models.layers import RMSNorm, RotaryEmbedding, set_fused_kernels
from specserve.models.llama import DecoderLayer

# name: (hidden, intermediate, num_heads, num_kv_heads, head_dim)
SHAPES = {"smollm2-135m": (576, 1536, 9, 3, 64), "llama3-8b": (4096, 14336, 32, 8, 128)}
BLOCK_SIZE = 16
CONTEXT = 256


def graph_time_us(fn, reps: int = 20, iters: int = 50) -> float:
    """GPU time per call of fn, from a CUDA graph of reps calls replayed iters times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles the Triton kernels and sets up cuBLAS outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return gpu_ms(graph.replay, iters, warmup=1) * 1000 / reps


def arch_of(shape: str) -> ArchConfig:
    hidden, inter, heads, kv_heads, head_dim = SHAPES[shape]
    return ArchConfig(architecture="LlamaForCausalLM", vocab_size=32000, hidden_size=hidden, intermediate_size=inter,
                      num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                      rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False)


def decode_metadata(num_reqs: int) -> AttentionMetadata:
    """num_reqs decode requests, each with CONTEXT tokens in its own run of blocks."""
    blocks = CONTEXT // BLOCK_SIZE
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
    seq_lens = torch.full((num_reqs,), CONTEXT, dtype=torch.int32)
    block_table = torch.arange(num_reqs * blocks, dtype=torch.int32).view(num_reqs, blocks)
    slots = block_table[:, -1].long() * BLOCK_SIZE + BLOCK_SIZE - 1
    return AttentionMetadata(num_reqs, num_reqs, 1, CONTEXT, qsl.cuda(), seq_lens.cuda(), block_table.cuda(),
                             slots.cuda(), qsl, seq_lens)


def op_cases(shape: str, num_tokens: int, dtype: torch.dtype) -> dict:
    """op name: (unfused call, fused call)."""
    arch = arch_of(shape)
    hidden, inter = arch.hidden_size, arch.intermediate_size
    heads, kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim

    def rand(*size):
        return torch.randn(*size, device="cuda", dtype=dtype)

    norm = RMSNorm(hidden, arch.rms_norm_eps).to(device="cuda", dtype=dtype)
    x, residual, gate_up = rand(num_tokens, hidden), rand(num_tokens, hidden), rand(num_tokens, 2 * inter)

    def norm_path(fused: bool, *args):
        norm.fused = fused
        return norm(*args)

    rotary = RotaryEmbedding(head_dim, arch.max_position_embeddings, arch.rope_theta, {}).cuda()
    q, k, v = rand(num_tokens, heads + 2 * kv_heads, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    positions = torch.randint(0, arch.max_position_embeddings, (num_tokens,), device="cuda")
    cache = rand(2, -(-num_tokens // BLOCK_SIZE), BLOCK_SIZE, kv_heads, head_dim)
    slots = torch.arange(num_tokens, device="cuda")

    def rotary_unfused():
        _, k_rot = rotary(positions, q, k)
        write_kv_cache_triton(k_rot, v, cache, slots)

    def mul_unfused():
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    layer = DecoderLayer(arch, get_attention_backend("triton")).to(device="cuda", dtype=dtype)
    layer_cache = rand(2, num_tokens * CONTEXT // BLOCK_SIZE, BLOCK_SIZE, kv_heads, head_dim)
    metadata = decode_metadata(num_tokens)
    decode_positions = torch.full((num_tokens,), CONTEXT - 1, device="cuda")

    def layer_path(fused: bool):
        set_fused_kernels(layer, fused)
        return layer(x, decode_positions, rotary, layer_cache, metadata, residual)

    return {
        "add + rms_norm": (lambda: norm_path(False, x, residual), lambda: norm_path(True, x, residual)),
        "rms_norm": (lambda: norm_path(False, x), lambda: norm_path(True, x)),
        "silu_and_mul": (mul_unfused, lambda: silu_and_mul(gate_up)),
        "add + rms_norm + fp8 rows": (lambda: quantize_rows(norm_path(True, x, residual)[0]),
                                      lambda: norm.forward_fp8_rows(x, residual)),
        "silu_and_mul + fp8 rows": (lambda: quantize_rows(silu_and_mul(gate_up)),
                                    lambda: silu_and_mul_fp8_rows(gate_up)),
        "rotary + kv write": (rotary_unfused,
                              lambda: rotary.rotate_and_cache(positions, q, k, v, cache, slots)),
        f"decoder layer (decode, ctx {CONTEXT})": (lambda: layer_path(False), lambda: layer_path(True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()}, {args.dtype}; GPU us per call under a CUDA graph\n")
    print("| shape | op | tokens | unfused us | fused us | speedup |")
    print("|---|---|---:|---:|---:|---:|")
    with torch.no_grad():
        for shape in args.shapes:
            for num_tokens in args.tokens:
                for op, (unfused, fused) in op_cases(shape, num_tokens, dtype).items():
                    t_unfused, t_fused = graph_time_us(unfused), graph_time_us(fused)
                    print(f"| {shape} | {op} | {num_tokens} | {t_unfused:.2f} | {t_fused:.2f} | "
                          f"{t_unfused / t_fused:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
