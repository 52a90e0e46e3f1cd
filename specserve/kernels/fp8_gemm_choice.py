"""Which GEMM an FP8 projection runs at each shape: torch._scaled_mm (cuBLAS) or the small-M Triton kernel.

The choice is data, measured on the device (docs/design.md, 'FP8 weights'): `benchmarks/fp8_gemm_choice.py`
times both kernels for each projection shape (N, K) at each token count M up to the Triton kernel's row limit,
the Triton kernel in several tiles, and writes, per device, `kernels/configs/fp8_gemm/<device name>.json`: for
each (N, K) a list of token-count buckets, the faster kernel in each and, for Triton, its fastest tile (none:
the 16-bit tile data's, small_m_configs.py). A GPU without a table of its own takes FALLBACK_DEVICE's, as it
takes that device's 16-bit tiles: `_scaled_mm` at one token made FP8 weights slower than bf16 on an H200
(BENCHMARKS.md, 'FP8 weights'). A shape or token count the table does not name takes `torch._scaled_mm`
(DEFAULT), as does every M past the Triton kernel's limit.
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
KERNELS = (SCALED_MM, TRITON)
DEFAULT = SCALED_MM
CHOICE_DIR = Path(__file__).resolve().parent / "configs" / "fp8_gemm"


@dataclass(frozen=True)
class Fp8GemmChoice:
    """For a projection of output size n and input size k over at most max_m tokens (and more than the next
    smaller bucket's max_m), the faster kernel."""

    n: int
    k: int
    max_m: int
    kernel: str
    # The Triton kernel's tile (small_m_configs.SmallMConfig's fields); 0: the tile data's.
    block_n: int = 0
    block_k: int = 0
    num_warps: int = 0
    num_stages: int = 0

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.kernel == TRITON and self.max_m > TRITON_MAX_ROWS:
            raise ValueError(f"the Triton kernel takes at most {TRITON_MAX_ROWS} rows, got a bucket up to {self.max_m}")
        tile = (self.block_n, self.block_k, self.num_warps, self.num_stages)
        if any(tile) and (self.kernel != TRITON or not all(v > 0 for v in tile)):
            raise ValueError(f"a tile goes with the Triton kernel and names all of block_n, block_k, num_warps and "
                             f"num_stages, got kernel {self.kernel!r} and {tile}")

    def config(self) -> SmallMConfig | None:
        """The Triton kernel's tile, None for the tile data's."""
        if not self.block_n:
            return None
        return SmallMConfig(self.block_n, self.block_k, self.num_warps, self.num_stages)


def choice_path(device_name: str) -> Path:
    """The table of a device, named as torch.cuda.get_device_name() names it (spaces as underscores)."""
    return CHOICE_DIR / f"{device_name.replace(' ', '_')}.json"


def write_choices(path: Path, device_name: str, choices: list[Fp8GemmChoice]) -> None:
    """A device's table, one choice a line, sorted by shape and bucket."""
    rows = sorted(choices, key=lambda c: (c.n, c.k, c.max_m))
    lines = [f"    {json.dumps(asdict(c))}" for c in rows]
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
    if m <= TRITON_MAX_ROWS:
        for choice in load_choices(_device_name(device)).get((n, k), ()):
            if m <= choice.max_m:
                return choice
    return Fp8GemmChoice(n, k, m, DEFAULT)


@lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
