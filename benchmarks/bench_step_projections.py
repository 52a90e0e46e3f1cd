"""Every small-M projection of a step, on one tensor-parallel rank, at the step's token counts: the tile its
shape class takes on this device (small_m_configs) against each candidate configuration (and its
compact-prologue form where there is a norm), in rounds that alternate the variants; medians of GPU us per
call, graph-timed, weights rotated past the L2.

    python benchmarks/bench_step_projections.py [--target smollm2-shape] [--tensor-parallel-size 1 [2 ...]]
        [--tokens 1 5] [--rounds 5] [--top 3] [--shapes head target] [--bandwidth-tbps T]
        [--write-config [PATH]]

Target: a shape preset of specserve/bench/models.py (smollm2-shape, llama3-8b, qwen2.5-32b, ...); its
decoder layer's qkv (add + norm + rotary + cache write), o_proj, gate_up (add + norm + SiLU-and-mul) and
down_proj, as rank 0 of --tensor-parallel-size ranks holds them (step_projections_shapes.py; several sizes time
each size's shards, and --write-config then tunes a class shared by sizes over all of them). With
smollm2-shape also the shipped EAGLE-3 head's (whole, as rank 0 runs it by default): its qkv (its input normed
already, K = 2 x hidden), gate_up over its 6144-wide MLP, down_proj and lm_head with the argmax over its
12,288-token draft vocabulary. --shapes keeps those whose name contains one of its words.

Tokens: 1 is a decode step (and a draft step at batch 1), k + 1 a verify step of k drafts (and the draft
prefill at batch 1), or the draft step's rows at batch k + 1.

Each row: the chosen tile (the class's on this device) and the fastest configuration, each as us, GB/s of
weight read and % of the device's bandwidth (a device-to-device copy, measured as `specserve bench decode`
measures it for its limit figures, unless --bandwidth-tbps gives it), then the next --top candidates. After
each token count, each part's total per step (x the target's layers) for chosen and best tiles, beside the
time its weight bytes take at that bandwidth.

--write-config writes this device's tile data file (default: specserve/kernels/configs/<device>.json): each
shape class the sweep measured takes the configuration with the least total time over the class's
measurements (every projection and token count that falls in it), the other classes keep what the device
had. Needs a CUDA device.
"""
from __future__ import annotations

import itertools
import statistics
from dataclasses import replace
from pathlib import Path

import torch
import triton
from bench_kernels import graph_time_us
from step_projections_shapes import Projection, parse_args

from specserve.bench.timing import measure_bandwidth
from specserve.kernels.fused_linear import fused_linear, fused_linear_argmax
from specserve.kernels.qkv_rotary_cache import qkv_rotary_cache
from specserve.kernels.small_m_configs import (CANDIDATES, SmallMConfig, config_path, linear_class, load_configs,
                                               qkv_class, write_configs)
from specserve.kernels.small_m_prologue import block_m
from specserve.models.layers import RotaryEmbedding

EPS = 1e-5
ROTATION_BYTES = 200 << 20
# The KV cache the qkv kernel writes: blocks x tokens a block, enough for the slots of 32 token rows.
CACHE_BLOCKS, BLOCK_SIZE = 8, 16


def rand(*size) -> torch.Tensor:
    return torch.randn(*size, device="cuda", dtype=torch.bfloat16)


def make_timed(p: Projection, m: int):
    """(copies of the weight, make(config) -> fn(i)): fn(i) runs p over m token rows with weight copy i."""
    copies = max(2, -(-ROTATION_BYTES // p.weight_bytes))
    weights = [rand(p.n, p.k) * p.k**-0.5 for _ in range(copies)]
    x = rand(m, p.k)
    prologue = dict(norm_weight=rand(p.k), eps=EPS, residual=rand(m, p.k)) if p.norm else {}
    if p.attention is not None:
        a = p.attention
        rotary = RotaryEmbedding(a.head_dim, a.max_positions, a.rope_theta, a.rope_scaling).cuda()
        positions, slots = torch.arange(100, 100 + m, device="cuda"), torch.arange(m, device="cuda")
        cache = rand(2, CACHE_BLOCKS, BLOCK_SIZE, a.kv_heads, a.head_dim)
        bias = rand(p.n) if p.bias else None
        return copies, lambda c: lambda i: qkv_rotary_cache(x, weights[i], positions, rotary.cos, rotary.sin, cache,
                                                            slots, a.heads, bias=bias, config=c, **prologue)
    if p.argmax:
        token_map = torch.arange(p.n, device="cuda")
        return copies, lambda c: lambda i: fused_linear_argmax(x, weights[i], token_map=token_map, config=c,
                                                               **prologue)
    return copies, lambda c: lambda i: fused_linear(x, weights[i], config=c, silu_mul=p.silu_mul, **prologue)


def shape_class(p: Projection, m: int) -> str:
    weight = torch.empty(p.n, p.k, device="meta", dtype=torch.bfloat16)
    if p.attention is not None:
        return qkv_class(weight, p.norm, m)
    return linear_class(weight, p.silu_mul, p.norm, m, p.argmax)


def candidates(p: Projection, m: int, chosen):
    """The chosen tile, then every candidate that applies to p. Split-K is for plain projections and the qkv
    kernel (the others here have a norm prologue with an epilogue, which fused_linear does not split); a compact
    prologue over as many token rows as the tile has is the plain one; the qkv kernel's block_n counts rotary
    pairs."""
    compacts = (False, True) if p.norm and triton.next_power_of_2(m) < block_m(m) else (False,)
    plain = not (p.norm or p.silu_mul or p.argmax) and p.attention is None
    return [chosen] + [replace(c, compact=compact) for c in CANDIDATES for compact in compacts
                       if (p.attention is None or c.block_n <= p.attention.head_dim // 2)
                       and (c.split_k == 1 or plain or p.attention is not None)]


def time_us(fn, copies: int) -> float:
    counter = itertools.count()
    return graph_time_us(lambda: fn(next(counter) % copies), reps=max(20, copies))


def label(c) -> str:
    return f"{c.block_n}/{c.block_k}/{c.num_warps}/{c.num_stages}" + ("/compact" if c.compact else "") + \
        (f"/s{c.split_k}" if c.split_k > 1 else "")


def updated_tiles(tiles: dict[str, SmallMConfig], measured: dict[str, list[dict[str, float]]],
                  by_label: dict[str, SmallMConfig]) -> dict[str, SmallMConfig]:
    """tiles with each measured shape class's winner: the label with the least total time over the class's
    measurements (medians by label, each run's first the class's current tile, which wins ties), among the
    labels every one of them timed. Classes not measured keep their tile."""
    winners = {}
    for shape_class, runs in measured.items():
        common = [k for k in runs[0] if all(k in run for run in runs[1:])]
        winners[shape_class] = by_label[min(common, key=lambda k: sum(run[k] for run in runs))]
    return {**tiles, **winners}


def sweep(make, configs, copies: int, rounds: int) -> dict[str, list[float]]:
    """Times by label over rounds that alternate the configurations; one that needs more shared memory than
    the GPU has drops out."""
    times = {label(c): [] for c in configs}
    for _ in range(rounds):
        for c in configs:
            if label(c) in times:
                try:
                    times[label(c)].append(time_us(make(c), copies))
                except triton.runtime.errors.OutOfResources:
                    del times[label(c)]
    return times


def main() -> None:
    a = parse_args(None, __doc__)
    if not torch.cuda.is_available():
        raise SystemExit("bench_step_projections needs a CUDA device")
    device = torch.cuda.get_device_name()
    tiles = load_configs(device)
    peak = a.bandwidth_tbps * 1e12 if a.bandwidth_tbps else measure_bandwidth("cuda")
    per_us = peak / 1e6  # bytes per us at the peak

    def speed(us: float, p: Projection) -> str:
        return f"{us:7.2f} us {p.weight_bytes / us / 1e3:6.0f} GB/s {100 * p.weight_bytes / us / per_us:3.0f}%"

    sizes = ", ".join(map(str, a.tensor_parallel_sizes))
    print(f"{device}, {a.target} at tensor-parallel size {sizes} (rank 0's shard); bandwidth "
          f"{peak / 1e12:.2f} TB/s ({'given' if a.bandwidth_tbps else 'device-to-device copy, measured'}); GPU us "
          f"per call, median of {a.rounds} rounds [min-max]; configs as block_n/block_k/warps/stages[/compact]"
          "[/s split_k] (block_n in rotary pairs for qkv)")
    measured: dict[str, list[dict[str, float]]] = {}
    by_label = {}
    with torch.no_grad():
        for m in a.tokens:
            # Each part's [chosen us, best us, us at the bandwidth] per step.
            totals: dict[str, list[float]] = {}
            for p in a.projections:
                cls = shape_class(p, m)
                configs = candidates(p, m, tiles[cls])
                by_label.update({label(c): c for c in configs})
                copies, make = make_timed(p, m)
                times = sweep(make, configs, copies, a.rounds)
                med = {k: statistics.median(v) for k, v in times.items()}
                measured.setdefault(cls, []).append(med)
                chosen = label(tiles[cls])
                best = min(med, key=med.get)
                rest = sorted((k for k in med if k not in (chosen, best)), key=med.get)[: a.top]
                print(f"M={m:2d} {p.group + p.name[p.name.index(' '):]:26s} {p.n:6d}x{p.k:<5d} {cls:26s} "
                      f"chosen {chosen:19s} {speed(med[chosen], p)} [{min(times[chosen]):.2f}-"
                      f"{max(times[chosen]):.2f}] | best {best:19s} {speed(med[best], p)} | next "
                      + ", ".join(f"{k} {med[k]:.2f}" for k in rest), flush=True)
                part = totals.setdefault(p.group, [0.0, 0.0, 0.0])
                for i, us in enumerate([med[chosen], med[best], p.weight_bytes / per_us]):
                    part[i] += us * p.per_step
            for group, (chosen_us, best_us, limit_us) in totals.items():
                layers = max(p.per_step for p in a.projections if p.group == group)
                print(f"M={m:2d} {group} per step ({layers} layer{'s' * (layers > 1)}): chosen {chosen_us:.1f} us "
                      f"({100 * limit_us / chosen_us:.0f}% of peak), best {best_us:.1f} us "
                      f"({100 * limit_us / best_us:.0f}% of peak), at peak {limit_us:.1f} us", flush=True)
    if a.write_config is not None:
        path = Path(a.write_config) if a.write_config else config_path(device)
        table = updated_tiles(tiles, measured, by_label)
        for cls in sorted(measured):
            print(f"{cls}: {label(tiles[cls])} -> {label(table[cls])}")
        write_configs(path, table)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
