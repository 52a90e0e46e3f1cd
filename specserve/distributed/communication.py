"""The collectives a sharded model runs, over the tensor-parallel group (parallel_state.py). A collective
that fails (a rank died, or did not answer within the group's timeout) raises EngineUnavailableError."""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from specserve.distributed import one_shot
from specserve.errors import EngineUnavailableError


@contextmanager
def _failing_engine(what: str):
    try:
        yield
    except RuntimeError as e:  # torch.distributed's backend errors, a timeout included
        raise EngineUnavailableError(f"a tensor-parallel {what} failed ({e}): a rank died or stopped answering, "
                                     "and the engine cannot continue; start a new engine") from e


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the ranks, in place: each rank holds a partial sum of a row-parallel projection. The
    one-shot all-reduce takes it where the group joined one and x fits its buffer (one_shot.py), NCCL (or gloo)
    otherwise."""
    fast = one_shot.current()
    if fast is not None and fast.fits(x):
        return fast(x)
    with _failing_engine("all-reduce"):
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, size: int) -> torch.Tensor:
    """The ranks' x side by side along the last dimension, in rank order (every rank gets the whole)."""
    parts = [torch.empty_like(x) for _ in range(size)]
    with _failing_engine("all-gather"):
        dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest of the ranks' values, known to every rank (NCCL reduces tensors on the GPU only)."""
    x = torch.tensor([value], dtype=torch.int64, device=device)
    with _failing_engine("all-reduce of a count"):
        dist.all_reduce(x, op=dist.ReduceOp.MIN)
    return int(x.item())


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x on every rank, in place: what rank 0 alone computed and the others must apply."""
    with _failing_engine("broadcast"):
        dist.broadcast(x, src=0)
    return x
