"""Measure the two GEMMs of an FP8 projection, torch._scaled_mm (rowwise scales) and the small-M Triton kernel
(kernels/fused_linear.py, fp8_linear), at each projection shape of the named models (the decoder layer's qkv,
o_proj, gate/up and down_proj, and of their EAGLE-3 heads' layer, whose qkv reads 2 x hidden) and each token
count up to the Triton kernel's 32 rows, the Triton kernel in each of TILES; keep the faster kernel (and
Triton's fastest tile) per shape and token count, and write the device's
choice table (kernels/fp8_gemm_choice.py). Both take the same FP8 input and scales (W8A8); the per-token
quantization in front of them is the same for both and not timed. Needs a CUDA device.

    python benchmarks/fp8_gemm_choice.py [--models llama3-8b,smollm2-shape] [--tokens 1,2,4,8,16,32]
        [--write [PATH]]

--write writes specserve/kernels/configs/fp8_gemm/<device>.json (or PATH); without it the table is printed only.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from bench_kernels import graph_time_us

from specserve.bench.models import SHAPES
from specserve.kernels.fp8_gemm_choice import SCALED_MM, TRITON, Fp8GemmChoice, choice_path, write_choices
from specserve.kernels.fused_linear import fp8_linear
from specserve.kernels.small_m_configs import SmallMConfig
from specserve.quantization.fp8 import quantize_per_channel, quantize_per_token


def projection_shapes(model: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each projection of the model's decoder layer and of an EAGLE-3 head's layer for it."""
    s = SHAPES[model]
    hidden, inter, heads, kv = s["hidden_size"], s["intermediate_size"], s["num_attention_heads"], \
        s["num_key_value_heads"]
    head_dim = hidden // heads
    qkv = (heads + 2 * kv) * head_dim
    return {f"{model} qkv": (qkv, hidden), f"{model} o_proj": (hidden, heads * head_dim),
            f"{model} gate_up": (2 * inter, hidden), f"{model} down": (hidden, inter),
            f"{model} head qkv": (qkv, 2 * hidden)}


# The Triton kernel's tiles tried beside the 16-bit tile data's (None): (block_n, block_k, num_warps, num_stages).
TILES = [None, (32, 512, 4, 4), (64, 256, 8, 4), (64, 512, 8, 3), (128, 256, 8, 3), (16, 512, 4, 4)]


def time_both(n: int, k: int, m: int) -> tuple[dict[str, float], tuple | None]:
    """(GPU microseconds per call of each kernel over m tokens, the Triton kernel's fastest tile); several weights
    rotated past the L2."""
    copies = max(2, min(512, (256 << 20) // (n * k)))
    weights = [quantize_per_channel(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
    xq, xs = quantize_per_token(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    turn = {"i": 0}

    def rotate():
        turn["i"] = (turn["i"] + 1) % copies
        return weights[turn["i"]]

    def scaled_mm():
        wq, ws = rotate()
        torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)

    def triton_kernel(tile):
        config = SmallMConfig(*tile) if tile else None

        def run():
            wq, ws = rotate()
            fp8_linear(xq, wq, ws, xs, out_dtype=torch.bfloat16, config=config)
        return run

    tiles = {tile: graph_time_us(triton_kernel(tile), reps=copies) for tile in TILES}
    best = min(tiles, key=tiles.get)
    return {SCALED_MM: graph_time_us(scaled_mm, reps=copies), TRITON: tiles[best]}, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama3-8b,smollm2-shape")
    ap.add_argument("--tokens", default="1,2,4,8,16,32")
    ap.add_argument("--write", nargs="?", const="", type=str, help="write the table (default path: the device's)")
    a = ap.parse_args()
    device_name = torch.cuda.get_device_name()
    shapes = {name: nk for model in a.models.split(",") for name, nk in projection_shapes(model).items()}
    choices = []
    print(f"{'projection':24} {'N x K':>13} {'M':>3} {'_scaled_mm us':>14} {'Triton us':>10} {'tile':>16}  faster")
    for name, (n, k) in shapes.items():
        for m in sorted(int(t) for t in a.tokens.split(",")):
            times, tile = time_both(n, k, m)
            best = min(times, key=times.get)
            tile_text = "/".join(map(str, tile)) if tile else "tile data"
            print(f"{name:24} {n:>6} x {k:<6} {m:>3} {times[SCALED_MM]:>14.2f} {times[TRITON]:>10.2f} "
                  f"{tile_text:>16}  {best}", flush=True)
            choices.append(Fp8GemmChoice(n, k, m, best, *(tile if best == TRITON and tile else ())))
    if a.write is not None:
        path = Path(a.write) if a.write else choice_path(device_name)
        # A shape measured twice (two models sharing it) keeps the last measurement.
        write_choices(path, device_name, list({(c.n, c.k, c.max_m): c for c in choices}.values()))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
