"""Every small-M projection of a SmolLM2 step with the shipped EAGLE-3 head, at the step's token counts:
the tile its shape class takes on this device (small_m_configs) against each candidate configuration (and
its compact-prologue form where there is a norm), in rounds that alternate the variants; medians of GPU us
per call, weights rotated past the L2.

    python benchmarks/bench_step_projections.py [--tokens 1 5] [--rounds 5] [--top 3] [--shapes head target]
        [--write-config [PATH]]

Tokens: 1 is a decode step (and a draft step at batch 1), k + 1 a verify step of k drafts (and the draft
prefill at batch 1), or the draft step's rows at batch k + 1. Shapes: the target's qkv (add + norm +
rotary + cache write), o_proj, gate_up (add + norm + SiLU-and-mul) and down_proj; the head's qkv (its
input normed already, K = 2 x hidden), gate_up over its 6144-wide MLP, down_proj and lm_head with the
argmax over its 12,288-token draft vocabulary; --shapes keeps those whose name contains one of its words.

--write-config writes this device's tile data file (default: specserve/kernels/configs/<device>.json): each
shape class the sweep measured takes the configuration with the least total time over the class's
measurements (every projection and token count that falls in it), the other classes keep what the device
had. Needs a CUDA device.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
from dataclasses import replace
from pathlib import Path

import torch
import triton
from bench_kernels import graph_time_us

from specserve.kernels.fused_linear import fused_linear, fused_linear_argmax
from specserve.kernels.qkv_rotary_cache import qkv_rotary_cache
from specserve.kernels.small_m_configs import (CANDIDATES, config_path, linear_class, load_configs, qkv_class,
                                               write_configs)
from specserve.kernels.small_m_prologue import block_m
from specserve.models.layers import RotaryEmbedding

HIDDEN, HEAD_DIM, HEADS, KV_HEADS, EPS = 576, 64, 9, 3, 1e-5
TARGET_MLP, HEAD_MLP, DRAFT_VOCAB = 1536, 6144, 12288
ROTATION_BYTES = 200 << 20


def projections(m: int) -> dict:
    """{name: (copies, has a norm, is qkv, shape class, make(config) -> fn(i))} over m token rows."""
    def rand(*size):
        return torch.randn(*size, device="cuda", dtype=torch.bfloat16)

    def weights(n, k):
        return [rand(n, k) * k**-0.5 for _ in range(max(2, -(-ROTATION_BYTES // (n * k * 2))))]

    x, residual, norm_weight = rand(m, HIDDEN), rand(m, HIDDEN), rand(HIDDEN)
    head_in, mlp_act, head_act = rand(m, 2 * HIDDEN), rand(m, TARGET_MLP), rand(m, HEAD_MLP)
    rotary = RotaryEmbedding(HEAD_DIM, 8192, 100000.0, {}).cuda()
    positions, slots = torch.arange(100, 100 + m, device="cuda"), torch.arange(m, device="cuda")
    cache = rand(2, 8, 16, KV_HEADS, HEAD_DIM)
    token_map = torch.arange(DRAFT_VOCAB, device="cuda")
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    w = {"target qkv": weights(qkv_rows, HIDDEN), "target o_proj": weights(HIDDEN, HIDDEN),
         "target gate_up": weights(2 * TARGET_MLP, HIDDEN), "target down_proj": weights(HIDDEN, TARGET_MLP),
         "head qkv": weights(qkv_rows, 2 * HIDDEN), "head gate_up": weights(2 * HEAD_MLP, HIDDEN),
         "head down_proj": weights(HIDDEN, HEAD_MLP), "head lm_head+argmax": weights(DRAFT_VOCAB, HIDDEN)}
    prologue = dict(norm_weight=norm_weight, eps=EPS, residual=residual)

    def qkv(inp, ws, **kw):
        return lambda c: lambda i: qkv_rotary_cache(inp, ws[i], positions, rotary.cos, rotary.sin, cache, slots,
                                                    HEADS, config=c, **kw)

    def linear(inp, ws, **kw):
        return lambda c: lambda i: fused_linear(inp, ws[i], config=c, **kw)

    # name: (has a norm, is qkv, wide (SiLU-and-mul), top (each program's best columns), make)
    makers = {
        "target qkv": (True, True, False, False, qkv(x, w["target qkv"], **prologue)),
        "target o_proj": (False, False, False, False, linear(x, w["target o_proj"])),
        "target gate_up": (True, False, True, False, linear(x, w["target gate_up"], silu_mul=True, **prologue)),
        "target down_proj": (False, False, False, False, linear(mlp_act, w["target down_proj"])),
        "head qkv": (False, True, False, False, qkv(head_in, w["head qkv"])),
        "head gate_up": (True, False, True, False, linear(x, w["head gate_up"], silu_mul=True, **prologue)),
        "head down_proj": (False, False, False, False, linear(head_act, w["head down_proj"])),
        "head lm_head+argmax": (True, False, False, True, lambda c: lambda i: fused_linear_argmax(
            x, w["head lm_head+argmax"][i], token_map=token_map, config=c, **prologue)),
    }
    return {name: (len(w[name]), norm, is_qkv,
                   qkv_class(w[name][0], norm, m) if is_qkv else linear_class(w[name][0], wide, norm, m, top), make)
            for name, (norm, is_qkv, wide, top, make) in makers.items()}


def time_us(fn, copies: int) -> float:
    counter = itertools.count()
    return graph_time_us(lambda: fn(next(counter) % copies), reps=max(20, copies))


def label(c) -> str:
    return f"{c.block_n}/{c.block_k}/{c.num_warps}/{c.num_stages}" + ("/compact" if c.compact else "") + \
        (f"/s{c.split_k}" if c.split_k > 1 else "")


def class_winners(measured: dict[str, list[dict[str, float]]]) -> dict[str, str]:
    """Each shape class's label with the least total time over the class's measurements (medians by label,
    each run's first the class's current tile, which wins ties), among the labels every one of them timed."""
    winners = {}
    for shape_class, runs in measured.items():
        common = [k for k in runs[0] if all(k in run for run in runs[1:])]
        winners[shape_class] = min(common, key=lambda k: sum(run[k] for run in runs))
    return winners


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--shapes", nargs="+", default=[""])
    ap.add_argument("--write-config", nargs="?", const="", metavar="PATH",
                    help="write the device's tile data file (PATH, or the package's file for this device)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_step_projections needs a CUDA device")
    device = torch.cuda.get_device_name()
    tiles = load_configs(device)
    print(f"{device}: GPU us per call, median of {a.rounds} rounds (min-max); configs as "
          "block_n/block_k/warps/stages[/compact][/s split_k] (block_n in rotary pairs for qkv); "
          "each row's first the class's tile on this device")
    measured: dict[str, list[dict[str, float]]] = {}
    by_label = {}
    with torch.no_grad():
        for m in a.tokens:
            # A compact prologue over as many token rows as the tile has is the plain one.
            compacts = (False, True) if triton.next_power_of_2(m) < block_m(m) else (False,)
            for name, (copies, norm, is_qkv, shape_class, make) in projections(m).items():
                if not any(word in name for word in a.shapes):
                    continue
                # Split-K is for plain projections only: the projections with a norm here are also those with
                # an epilogue, and the qkv kernel has none.
                configs = [tiles[shape_class]] + [replace(c, compact=compact) for c in CANDIDATES
                                                  for compact in (compacts if norm else (False,))
                                                  if not (is_qkv and c.block_n > HEAD_DIM // 2)
                                                  and (c.split_k == 1 or not (norm or is_qkv))]
                by_label.update({label(c): c for c in configs})
                times = {label(c): [] for c in configs}
                for _ in range(a.rounds):
                    for c in configs:
                        if label(c) not in times:
                            continue
                        try:
                            times[label(c)].append(time_us(make(c), copies))
                        except triton.runtime.errors.OutOfResources:
                            del times[label(c)]  # more shared memory than the GPU has
                med = {k: statistics.median(v) for k, v in times.items()}
                measured.setdefault(shape_class, []).append(med)
                current = label(tiles[shape_class])
                best = sorted((k for k in med if k != current), key=med.get)[: a.top]
                row = ", ".join(f"{k} {med[k]:.2f} [{min(times[k]):.2f}-{max(times[k]):.2f}]" for k in [current, *best])
                print(f"M={m:2d} {name:20s} {shape_class:24s} {row}", flush=True)
    if a.write_config is not None:
        path = Path(a.write_config) if a.write_config else config_path(device)
        winners = {shape_class: by_label[k] for shape_class, k in class_winners(measured).items()}
        for shape_class, cfg in sorted(winners.items()):
            print(f"{shape_class}: {label(tiles[shape_class])} -> {label(cfg)}")
        write_configs(path, {**tiles, **winners})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
