"""e4m3 (float8_e4m3fn) rounding in float64, built from the format's definition: an independent reference for
what an FP8 KV-cache entry must hold (no torch or Triton cast is involved)."""
from __future__ import annotations

import torch


def e4m3_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """(every finite e4m3 (fn) value ascending in float64, whether its mantissa is even), from the format's
    definition."""
    values = {}
    for exponent in range(16):
        for mantissa in range(8):
            if exponent == 15 and mantissa == 7:
                continue  # NaN
            v = 2.0**-6 * mantissa / 8 if exponent == 0 else 2.0 ** (exponent - 7) * (1 + mantissa / 8)
            values[v] = values[-v] = mantissa % 2 == 0
    grid = sorted(values)
    return torch.tensor(grid, dtype=torch.float64), torch.tensor([values[v] for v in grid])


GRID, _EVEN = e4m3_grid()


def e4m3_reference(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale (divided in float32, as the cache defines it) saturated at +-448 and rounded to the nearest e4m3
    value, ties to even, in float64: what an FP8 cache entry must hold."""
    y = (x.float() / torch.tensor(scale, dtype=torch.float32)).double().clamp(-448.0, 448.0).flatten()
    upper = torch.searchsorted(GRID, y).clamp(1, len(GRID) - 1)
    lo, hi = GRID[upper - 1], GRID[upper]
    pick_hi = (hi - y < y - lo) | ((hi - y == y - lo) & _EVEN[upper])
    return torch.where(pick_hi, hi, lo).view(x.shape)
