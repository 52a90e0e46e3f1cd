"""Launch configurations of the small-M projection kernels: shape classes in code, tiles per device as data.

At M <= 32 a projection reads its weight once and does almost no arithmetic,
so a configuration is judged by how well it keeps the memory system busy:
enough programs to occupy every SM, enough bytes in flight per SM
(block_n x block_k x num_stages weight elements) to cover the DRAM latency,
and few enough K iterations that a small weight is not bound by the loop's
latency. What separates one shape class from another is decided here
(linear_class, qkv_class); which tile each class takes on a device is data,
configs/<device name>.json, written by the sweep that measures the classes
(benchmarks/bench_step_projections.py --write-config). A device without a
file of its own takes FALLBACK_DEVICE's tiles (docs/design.md, 'Tuned tile
configurations'); the CPU's interpreter takes INTERPRETER's.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

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
    # Programs each column tile's K is split over (fused_linear.py), for plain projections and the qkv kernel
    # (qkv_rotary_cache.py) only: few output columns over a long K leave most SMs idle in one program a tile.
    split_k: int = 1


# Below this many weight bytes a projection is latency-bound (SmolLM2-135M's are 0.7 to 3.5 MB): narrow tiles
# spread its few output columns over enough programs, and long K chunks keep the loop short. Larger weights
# (Llama-3-8B's, 33 to 235 MB; a rank's o_proj at tensor-parallel size 2, exactly 16 MiB, reads faster in
# their tiles: BENCHMARKS.md, 'Tensor parallelism') are bandwidth-bound.
SMALL_WEIGHT_BYTES = 16 << 20
# Up to SHORT_K input features a small weight's K fits in few short chunks, where long ones would leave the
# last of two iterations nearly all mask.
SHORT_K = 1024
# Past LONG_K input features a small weight has few output columns for its size (an EAGLE-3 head's down_proj,
# 576 x 6144: 36 tiles of 16 columns), too few programs for the SMs unless K is split.
LONG_K = 4096
# Past MEDIUM_WEIGHT_BYTES a small weight with a norm (a draft head's wide MLP and lm_head) has outputs wide
# enough for wider tiles, which reread the prologue in fewer programs.
MEDIUM_WEIGHT_BYTES = 8 << 20
# Up to NARROW_QKV_ROWS output rows a large qkv weight (a rank's under tensor parallelism: Llama-3-8B's at
# TP=2 has 3,072, Qwen2.5-32B's 3,584) spans fewer programs than an H100 has SMs in the unsplit tiles, which
# its own classes may split over K (qkv_rotary_cache.py); a whole 8B model's (6,144) fills them.
NARROW_QKV_ROWS = 4096
# Past TALL_ABOVE tokens the kernels run 32-row tiles (small_m_prologue.block_m), whose small-weight classes
# are their own.
TALL_ABOVE = 16

# Triton's interpreter on CPU, where every program and every loop iteration costs Python time: blocks
# large enough for tiny test models, small enough that test shapes of ~100 still span several blocks
# and exercise the masks. num_warps and num_stages mean nothing there.
INTERPRETER = SmallMConfig(block_n=32, block_k=64, num_warps=1, num_stages=1)
# The qkv kernel's block_n counts rotary pairs: 16, tl.dot's minimum, also splits heads wider than 32.
INTERPRETER_QKV = SmallMConfig(block_n=16, block_k=64, num_warps=1, num_stages=1)

# What the sweeps time: (block_n, block_k, num_warps, num_stages); then split-K forms of a few, which
# apply to plain projections and the qkv kernel only: ((block_n, block_k, num_warps, num_stages), split_k).
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

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
# The device whose tiles a device without a file takes: the one the classes were first tuned on.
FALLBACK_DEVICE = "NVIDIA H100 80GB HBM3"


def config_path(device_name: str) -> Path:
    """The data file of a device, named as torch.cuda.get_device_name() names it (spaces as underscores)."""
    return CONFIG_DIR / f"{device_name.replace(' ', '_')}.json"


@lru_cache(maxsize=None)
def load_configs(device_name: str = FALLBACK_DEVICE) -> dict[str, SmallMConfig]:
    """Each shape class's configuration on a device: its file over FALLBACK_DEVICE's."""
    paths = [config_path(FALLBACK_DEVICE), config_path(device_name)]
    table = {}
    for path in dict.fromkeys(p for p in paths if p.exists()):
        table.update({name: SmallMConfig(**cfg) for name, cfg in json.loads(path.read_text()).items()})
    return table


def write_configs(path: Path, table: dict[str, SmallMConfig]) -> None:
    """A device's data file, one shape class a line (sorted), every field written."""
    lines = [f'  "{name}": {json.dumps(asdict(table[name]))}' for name in sorted(table)]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")


def weight_bytes(weight: torch.Tensor) -> int:
    return weight.numel() * weight.element_size()


def linear_class(weight: torch.Tensor, wide: bool, norm: bool = False, m: int = 16, top: bool = False) -> str:
    """The shape class of a projection with this weight over m tokens (on a GPU); wide: the gate/up kernel, two
    accumulators; norm: with the RMSNorm prologue; top: keeping each program's best columns (which, like the
    other prologues and epilogues, does not split K)."""
    small = weight_bytes(weight) < SMALL_WEIGHT_BYTES
    if norm:
        if not small:
            return "norm_large_one_token" if m == 1 else "norm_large"
        if m > TALL_ABOVE:
            return "norm_tall_small" if wide else "norm_tall_small_one_acc"
        if weight_bytes(weight) > MEDIUM_WEIGHT_BYTES:
            return "norm_medium" if wide else "norm_medium_one_acc"
        return "norm_small_one_token" if m == 1 else "norm_small"
    if not small:
        return "large_wide" if wide else "large"
    if weight.shape[1] >= LONG_K and not (wide or top):
        return "small_long_k"
    return "small_short_k" if weight.shape[1] <= SHORT_K else "small"


def qkv_class(weight: torch.Tensor, norm: bool = False, m: int = 16) -> str:
    """The shape class of the qkv kernel (on a GPU), whose block_n counts rotary pairs: 16 at least, tl.dot's
    minimum width."""
    small = weight_bytes(weight) < SMALL_WEIGHT_BYTES
    if norm:
        if not small:
            size = "narrow" if weight.shape[0] <= NARROW_QKV_ROWS else "large"
            return f"qkv_norm_{size}_one_token" if m == 1 else f"qkv_norm_{size}"
        if m > TALL_ABOVE:
            return "qkv_norm_tall_small"
        return "qkv_norm_small_one_token" if m == 1 else "qkv_norm_small"
    if not small:
        return "qkv_large"
    return "qkv_tall_small" if m > TALL_ABOVE else "qkv_small"


@lru_cache(maxsize=None)
def _device_table(device: torch.device) -> dict[str, SmallMConfig]:
    # A weight on the meta device (the rules without a GPU) takes FALLBACK_DEVICE's tiles.
    return load_configs(torch.cuda.get_device_name(device) if device.type == "cuda" else FALLBACK_DEVICE)


def _device_config(weight: torch.Tensor, shape_class: str) -> SmallMConfig:
    cfg = _device_table(weight.device)[shape_class]
    # The stages of shared memory hold weight tiles: float32 tiles at the 16-bit sizes overflow the H100's
    # 227 KB, so they take half as many K elements.
    if weight.element_size() > 2:
        return replace(cfg, block_k=cfg.block_k // 2)
    return cfg


def linear_config(weight: torch.Tensor, wide: bool, norm: bool = False, m: int = 16, top: bool = False) -> SmallMConfig:
    """The configuration for a projection with this weight over m tokens (see linear_class)."""
    if weight.device.type == "cpu":
        # The interpreter runs the compact prologue where the GPU does on small weights (every test's), so
        # the tests cover it; test_fused_linear runs the other prologue with a config of its own.
        return replace(INTERPRETER, compact=True) if norm else INTERPRETER
    return _device_config(weight, linear_class(weight, wide, norm, m, top))


def qkv_config(weight: torch.Tensor, norm: bool = False, m: int = 16) -> SmallMConfig:
    """The qkv kernel's configuration; its block_n counts rotary pairs, half a tile's columns."""
    if weight.device.type == "cpu":
        return replace(INTERPRETER_QKV, compact=True) if norm else INTERPRETER_QKV
    return _device_config(weight, qkv_class(weight, norm, m))
