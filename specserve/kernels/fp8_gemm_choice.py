"""Which GEMM an FP8 projection runs at each shape: torch._scaled_mm (cuBLAS), the small-M Triton kernel or the
FP8 dot kernel.

The choice is data, measured on the device (docs/design.md, 'FP8 weights'): `benchmarks/fp8_gemm_choice.py`
times the kernels for each projection shape (N, K) at each token count M (the small-M kernel up to its row
limit, the FP8 dot kernel, kernels/fp8_gemm.py, from 16 rows), the Triton kernels in several tiles, and
writes, per device, `kernels/configs/fp8_gemm/<device name>.json`: for each (N, K) a list of token-count
buckets, the fastest kernel in each and, for the Triton kernels, its fastest tile (none: the small-M kernel
takes the 16-bit tile data's, small_m_configs.py, the FP8 dot kernel DEFAULT_DOT_TILE). A GPU without a table
of its own takes FALLBACK_DEVICE's, as it takes that device's 16-bit tiles: `_scaled_mm` at one token made FP8
weights slower than bf16 on an H200 (BENCHMARKS.md, 'FP8 weights'). A shape or token count the table does not
name takes `torch._scaled_mm` (DEFAULT), as does every M past the table's largest bucket for the shape.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch

from specserve.kernels.small_m_configs import FALLBACK_DEVICE, SmallMConfig

# The Triton kernel's row limit (small_m_prologue.MAX_ROWS, which imports Triton; tests check they agree).
TRITON_MAX_ROWS = 32

SCALED_MM = "scaled_mm"
TRITON = "triton"
FP8_DOT = "fp8_dot"
KERNELS = (SCALED_MM, TRITON, FP8_DOT)
DEFAULT = SCALED_MM
CHOICE_DIR = Path(__file__).resolve().parent / "configs" / "fp8_gemm"
# The K of one Hopper FP8 MMA instruction (wgmma with 8-bit operands): the finest promotion of its sums.
FP8_MMA_K = 32
# The fewest rows or columns of a tile tl.dot takes.
MIN_DOT_TILE = 16


@dataclass(frozen=True)
class Fp8DotTile:
    """A launch of the FP8 dot kernel (fp8_gemm.py): block_m x block_n outputs a program, K in block_k
    chunks, split_k programs per output tile; the FP8 MMA's own sums of promote_k products at a time added
    into the float32 accumulator (a multiple of FP8_MMA_K, at most block_k)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    promote_k: int = FP8_MMA_K

    def __post_init__(self) -> None:
        if self.promote_k % FP8_MMA_K or not FP8_MMA_K <= self.promote_k <= self.block_k:
            raise ValueError(f"promote_k must be a multiple of {FP8_MMA_K} up to block_k ({self.block_k}), got "
                             f"{self.promote_k}")
        for name in ("block_m", "block_n", "block_k", "num_warps", "num_stages", "split_k"):
            value = getattr(self, name)
            if value < 1 or (name.startswith("block") and value & (value - 1)):
                raise ValueError(f"{name} must be a positive{' power of two' if name.startswith('block') else ''}, "
                                 f"got {value}")
        if self.block_m < MIN_DOT_TILE or self.block_n < MIN_DOT_TILE or self.block_k < FP8_MMA_K:
            raise ValueError(f"tl.dot of e4m3 needs tiles of at least 16 x 16 outputs and 32 along K, got "
                             f"{self.block_m} x {self.block_n} x {self.block_k}")


# Where the choice table names none: a 64-row tile, the decode batch's, over 64 columns.
DEFAULT_DOT_TILE = Fp8DotTile(64, 64, 128, 4, 4)


@dataclass(frozen=True)
class Fp8GemmChoice:
    """For a projection of output size n and input size k over at most max_m tokens (and more than the next
    smaller bucket's max_m), the faster kernel."""

    n: int
    k: int
    max_m: int
    kernel: str
    # A Triton kernel's tile (small_m_configs.SmallMConfig's fields; the FP8 dot kernel's Fp8DotTile takes
    # block_m too); 0: the kernel's own default.
    block_n: int = 0
    block_k: int = 0
    num_warps: int = 0
    num_stages: int = 0
    split_k: int = 1
    block_m: int = 0
    promote_k: int = FP8_MMA_K

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.kernel == TRITON and self.max_m > TRITON_MAX_ROWS:
            raise ValueError(f"the Triton kernel takes at most {TRITON_MAX_ROWS} rows, got a bucket up to {self.max_m}")
        tile = (self.block_n, self.block_k, self.num_warps, self.num_stages)
        if (any(tile) or self.split_k != 1) and (self.kernel == SCALED_MM or not all(v > 0 for v in tile)):
            raise ValueError(f"a tile goes with a Triton kernel and names all of block_n, block_k, num_warps and "
                             f"num_stages, got kernel {self.kernel!r}, {tile} and split_k {self.split_k}")
        if (self.block_m > 0) != (self.kernel == FP8_DOT and any(tile)) or \
                (self.promote_k != FP8_MMA_K and not self.block_m):
            raise ValueError(f"block_m and promote_k go with an {FP8_DOT} tile only, got kernel {self.kernel!r}, "
                             f"block_m {self.block_m}, promote_k {self.promote_k} and {tile}")

    def config(self) -> SmallMConfig | None:
        """The small-M kernel's tile, None for the tile data's."""
        if self.kernel != TRITON or not self.block_n:
            return None
        return SmallMConfig(self.block_n, self.block_k, self.num_warps, self.num_stages, split_k=self.split_k)

    def dot_tile(self) -> Fp8DotTile | None:
        """The FP8 dot kernel's tile, None for its default."""
        if self.kernel != FP8_DOT or not self.block_m:
            return None
        return Fp8DotTile(self.block_m, self.block_n, self.block_k, self.num_warps, self.num_stages, self.split_k,
                          self.promote_k)


def choice_path(device_name: str) -> Path:
    """The table of a device, named as torch.cuda.get_device_name() names it (spaces as underscores)."""
    return CHOICE_DIR / f"{device_name.replace(' ', '_')}.json"


def write_choices(path: Path, device_name: str, choices: list[Fp8GemmChoice]) -> None:
    """A device's table, one choice a line, sorted by shape and bucket; fields at their defaults left out."""
    rows = sorted(choices, key=lambda c: (c.n, c.k, c.max_m))
    defaults = asdict(Fp8GemmChoice(0, 0, 0, DEFAULT))
    named = ("n", "k", "max_m", "kernel")
    lines = [f"    {json.dumps({f: v for f, v in asdict(c).items() if f in named or v != defaults[f]})}" for c in rows]
    path.write_text(f'{{\n  "device": {json.dumps(device_name)},\n  "choices": [\n' + ",\n".join(lines) + "\n  ]\n}\n")


@lru_cache(maxsize=None)
def load_choices(device_name: str) -> dict[tuple[int, int], tuple[Fp8GemmChoice, ...]]:
    """The device's table by (n, k), each shape's buckets by ascending max_m: its file's, for a GPU without one
    FALLBACK_DEVICE's; empty where neither exists (the CPU without a file)."""
    path = choice_path(device_name)
    if not path.exists() and device_name != "cpu":
        path = choice_path(FALLBACK_DEVICE)
    if not path.exists():
        return {}
    table: dict[tuple[int, int], list[Fp8GemmChoice]] = {}
    for row in json.loads(path.read_text())["choices"]:
        choice = Fp8GemmChoice(**row)
        table.setdefault((choice.n, choice.k), []).append(choice)
    return {shape: tuple(sorted(rows, key=lambda c: c.max_m)) for shape, rows in table.items()}


def choose(n: int, k: int, m: int, device: torch.device) -> Fp8GemmChoice:
    """The choice for a projection [n, k] over m tokens on device: the table's bucket for m, else DEFAULT."""
    for choice in load_choices(_device_name(device)).get((n, k), ()):
        if m <= choice.max_m:
            return choice
    return Fp8GemmChoice(n, k, m, DEFAULT)


@lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
