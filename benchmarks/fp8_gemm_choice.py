"""Measure the GEMMs of an FP8 projection, torch._scaled_mm (rowwise scales), the small-M Triton kernel
(kernels/fused_linear.py, fp8_linear; up to its 32 rows) and the FP8 dot kernel (kernels/fp8_gemm.py; from 16
rows), at each projection shape of the named models (the decoder layer's qkv, o_proj, gate/up and down_proj,
and of their EAGLE-3 heads' layer, whose qkv reads 2 x hidden) and each token count, the Triton kernels each in
several tiles; keep the fastest kernel (and its fastest tile) per shape and token count, and write the device's
choice table (kernels/fp8_gemm_choice.py). The FP8 dot kernel's tiles promote the MMA's sums every instruction or
every K chunk; a tile whose largest error against float64 passes cuBLAS's by more than PRECISION_MARGIN is
left out. All take the same FP8 input and scales (W8A8); the per-token
quantization in front of them is the same for all and not timed. Needs a CUDA device.

    python benchmarks/fp8_gemm_choice.py [--models llama3-8b,smollm2-shape] [--tokens 1,2,4,8,16,32,64,128]
        [--write [PATH]]

--write updates specserve/kernels/configs/fp8_gemm/<device>.json (or PATH): the buckets measured replace the
table's, the others stay (a device without a table starts from the fallback device's, which it ran before);
without it the table is printed only.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
from bench_kernels import graph_time_us

from specserve.bench.models import SHAPES
from specserve.kernels.fp8_gemm import fp8_dot
from specserve.kernels.fp8_gemm_choice import (FP8_DOT, FP8_MMA_K, SCALED_MM, TRITON, TRITON_MAX_ROWS, Fp8DotTile,
                                               Fp8GemmChoice, choice_path, write_choices)
from specserve.kernels.fused_linear import fp8_linear
from specserve.kernels.small_m_configs import FALLBACK_DEVICE, SmallMConfig
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


# The small-M kernel's tiles tried beside the 16-bit tile data's (None), some with K split.
TILES = [None] + [SmallMConfig(*tile) for tile in [(32, 512, 4, 4), (64, 256, 8, 4), (64, 512, 8, 3), (128, 256, 8, 3),
                                                   (16, 512, 4, 4)]] + \
    [SmallMConfig(32, 256, 4, 4, split_k=2), SmallMConfig(16, 512, 4, 4, split_k=2), SmallMConfig(32, 256, 4, 4, split_k=4)]
# The FP8 dot kernel's tiles, block_m aside (the token count's: 16 to 64 rows, then 64 or 128):
# (block_n, block_k, num_warps, num_stages, split_k), each promoting its sums every FP8 MMA and every block_k.
# Every program rereads the input's rows from L2 for its block_n weight rows: wide tiles read fewer input
# bytes per weight byte, and K split over 2 or 4 programs gives them enough programs to fill the SMs.
DOT_TILES = [(32, 256, 4, 4, 1), (64, 128, 4, 4, 1), (64, 256, 4, 3, 1), (128, 128, 4, 4, 1), (128, 128, 8, 3, 1),
             (64, 128, 4, 6, 1), (32, 128, 4, 6, 1), (64, 128, 4, 4, 2), (32, 256, 4, 4, 2), (64, 256, 4, 3, 4),
             (32, 256, 4, 6, 1), (64, 256, 4, 4, 2), (128, 128, 4, 4, 2), (128, 128, 4, 4, 4), (128, 256, 8, 3, 4)]
# The FP8 dot kernel's fewest rows: below, a 16-row MMA tile would be mostly padding.
DOT_MIN_ROWS = 16
# A tile is kept only if its largest error against float64 is at most this many times cuBLAS's on the same
# operands (torch._scaled_mm promotes its FP8 sums to float32 as it goes).
PRECISION_MARGIN = 1.25


def dot_tiles(m: int) -> list[Fp8DotTile]:
    rows = [min(64, triton.next_power_of_2(m))] + ([128] if m > 64 else [])
    return [Fp8DotTile(block_m, *tile, promote_k=promote_k) for block_m in rows for tile in DOT_TILES
            for promote_k in sorted({FP8_MMA_K, tile[1]})]


def as_precise_as_cublas(tiles: list[Fp8DotTile], xq, xs, wq, ws) -> list[Fp8DotTile]:
    """The tiles whose largest error against float64 is within PRECISION_MARGIN of torch._scaled_mm's."""
    want = (xq.double() * xs.double()) @ (wq.double() * ws.double()[:, None]).T

    def error(out: torch.Tensor) -> float:
        return (out.double() - want).abs().max().item()

    bound = PRECISION_MARGIN * error(torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1),
                                                      out_dtype=torch.bfloat16))
    kept = []
    for tile in tiles:
        try:
            err = error(fp8_dot(xq, wq, ws, xs, out_dtype=torch.bfloat16, tile=tile))
        except Exception:  # a tile that does not compile is left out when timed
            kept.append(tile)
            continue
        if err <= bound:
            kept.append(tile)
        else:
            print(f"  {FP8_DOT} tile {tile_text(tile)} left out: largest error {err:.4g}, cuBLAS's x "
                  f"{PRECISION_MARGIN} {bound:.4g}")
    return kept


def time_kernels(n: int, k: int, m: int) -> dict[str, tuple[float, object]]:
    """Per kernel that takes m rows, (GPU microseconds per call over m tokens, its fastest tile); several weights
    rotated past the L2. A tile that does not compile on the device is left out."""
    copies = max(2, min(512, (256 << 20) // (n * k)))
    weights = [quantize_per_channel(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
    xq, xs = quantize_per_token(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    turn = {"i": 0}

    def rotate():
        turn["i"] = (turn["i"] + 1) % copies
        return weights[turn["i"]]

    def scaled_mm(_tile):
        wq, ws = rotate()
        torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)

    def small_m(tile):
        wq, ws = rotate()
        fp8_linear(xq, wq, ws, xs, out_dtype=torch.bfloat16, config=tile)

    def dot(tile):
        wq, ws = rotate()
        fp8_dot(xq, wq, ws, xs, out_dtype=torch.bfloat16, tile=tile)

    candidates = {SCALED_MM: (scaled_mm, [None])}
    if m <= TRITON_MAX_ROWS:
        candidates[TRITON] = (small_m, TILES)
    if m >= DOT_MIN_ROWS:
        candidates[FP8_DOT] = (dot, as_precise_as_cublas(dot_tiles(m), xq, xs, *weights[0]))
    best = {}
    for kernel, (run, tiles) in candidates.items():
        times = {}
        for tile in tiles:
            try:
                times[tile] = graph_time_us(lambda: run(tile), reps=copies)
            except Exception as e:  # a tile past the device's shared memory or registers
                print(f"  {kernel} tile {tile} skipped: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
        if times:
            fastest = min(times, key=times.get)
            best[kernel] = (times[fastest], fastest)
    return best


def choice_of(n: int, k: int, m: int, kernel: str, tile: SmallMConfig | Fp8DotTile | None) -> Fp8GemmChoice:
    if tile is None:
        return Fp8GemmChoice(n, k, m, kernel)
    return Fp8GemmChoice(n, k, m, kernel, tile.block_n, tile.block_k, tile.num_warps, tile.num_stages,
                         split_k=tile.split_k, block_m=getattr(tile, "block_m", 0),
                         promote_k=getattr(tile, "promote_k", FP8_MMA_K))


def tile_text(tile: SmallMConfig | Fp8DotTile | None) -> str:
    """[block_m/]block_n/block_k/num_warps/num_stages[/sSPLIT_K][/pPROMOTE_K] (split_k where it is not 1,
    promote_k where it is not one MMA's)."""
    if tile is None:
        return "default"
    parts = [getattr(tile, "block_m", None), tile.block_n, tile.block_k, tile.num_warps, tile.num_stages,
             f"s{tile.split_k}" if tile.split_k > 1 else None,
             f"p{tile.promote_k}" if getattr(tile, "promote_k", FP8_MMA_K) != FP8_MMA_K else None]
    return "/".join(str(p) for p in parts if p is not None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama3-8b,smollm2-shape")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--write", nargs="?", const="", type=str, help="write the table (default path: the device's)")
    a = ap.parse_args()
    device_name = torch.cuda.get_device_name()
    shapes = {name: nk for model in a.models.split(",") for name, nk in projection_shapes(model).items()}
    choices = []
    print(f"{'projection':24} {'N x K':>13} {'M':>3} {'_scaled_mm us':>14} {'small-M us':>11} {'tile':>14} "
          f"{'fp8_dot us':>11} {'tile':>16} {'GB/s':>6}  fastest")
    for name, (n, k) in shapes.items():
        for m in sorted(int(t) for t in a.tokens.split(",")):
            best = time_kernels(n, k, m)
            fastest = min(best, key=lambda kernel: best[kernel][0])
            cells = [f"{best[kernel][0]:>11.2f} {tile_text(best[kernel][1]):>{width}}" if kernel in best
                     else f"{'-':>11} {'-':>{width}}" for kernel, width in ((TRITON, 14), (FP8_DOT, 16))]
            print(f"{name:24} {n:>6} x {k:<6} {m:>3} {best[SCALED_MM][0]:>14.2f} {' '.join(cells)} "
                  f"{n * k / best[fastest][0] / 1e3:>6.0f}  {fastest}", flush=True)
            choices.append(choice_of(n, k, m, fastest, best[fastest][1]))
    if a.write is not None:
        path = Path(a.write) if a.write else choice_path(device_name)
        measured = {(c.n, c.k, c.max_m): c for c in choices}  # a shape two models share: the last measurement
        # A device without a table of its own has run the fallback device's: its buckets not measured now stay.
        source = path if path.exists() else choice_path(FALLBACK_DEVICE)
        rows = json.loads(source.read_text())["choices"] if source.exists() else []
        kept = [c for c in (Fp8GemmChoice(**row) for row in rows) if (c.n, c.k, c.max_m) not in measured]
        write_choices(path, device_name, kept + list(measured.values()))
        print(f"wrote {path}: {len(measured)} buckets measured, {len(kept)} kept")

if __name__ == "__main__":
    main()
