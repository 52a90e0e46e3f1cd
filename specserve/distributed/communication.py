"""The collectives a sharded model runs, over the tensor-parallel group (parallel_state.py). A collective
that fails (a rank died, or did not answer within the group's timeout) raises EngineUnavailableError."""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from specserve.errors import EngineUnavailableError


@contextmanager
def _failing_engine(what: str):
    try:
        yield
    except RuntimeError as e:  # torch.distributed's backend errors, a timeout included
        raise EngineUnavailableError(f"a tensor-parallel {what} failed ({e}): a rank died or stopped answering, "
                                     "and the engine cannot continue; start a new engine") from e


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the ranks, in place: each rank holds a partial sum of a row-parallel projection."""
    with _failing_engine("all-reduce"):
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, size: int) -> torch.Tensor:
    """The ranks' x side by side along the last dimension, in rank order (every rank gets the whole)."""
    parts = [torch.empty_like(x) for _ in range(size)]
    with _failing_engine("all-gather"):
        dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
