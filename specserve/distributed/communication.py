"""The collectives a sharded model runs, over the tensor-parallel group (parallel_state.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the ranks, in place: each rank holds a partial sum of a row-parallel projection."""
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, size: int) -> torch.Tensor:
    """The ranks' x side by side along the last dimension, in rank order (every rank gets the whole)."""
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
