"""This process's place in the tensor-parallel group: its rank and the group's size.

The group is torch.distributed's default group: every process of the engine is one rank of it (one
engine, on one node or several: rendezvous.py). Without init_tp_group the process is rank 0 of a group of
one, and nothing communicates.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from specserve.distributed import one_shot


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int


_group = TPGroup(0, 1)

# A collective (the start-up rendezvous included) that waits longer raises: a rank that died or hangs fails
# the others instead of hanging them. Long enough for the slowest rank to import torch and start.
COLLECTIVE_TIMEOUT_S = 120.0


def share_cpu_cores(device: str, tensor_parallel_size: int, nnodes: int, data_parallel_size: int) -> None:
    """On the CPU, have this process (a rank's, or a replica's engine core) take its share of the node's cores,
    where the engine runs several processes on it: each taking all of them (torch's default) spins against the
    others at every collective, several times slower than a share each. A process of an engine of one leaves
    torch's choice alone, as does the caller's own process (rank 0 of an engine in it)."""
    processes = data_parallel_size * (tensor_parallel_size // nnodes)
    if device == "cpu" and processes > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))


def rank_device(device: str, local_rank: int) -> str:
    """The device of the rank that is its node's local_rank-th: cuda:local_rank on GPUs (every rank, rank 0
    included, binds its own with set_device, so that NCCL and the kernels of one process never touch another
    rank's GPU), else the CPU."""
    if not device.startswith("cuda"):
        return device
    torch.cuda.set_device(local_rank)
    return f"cuda:{local_rank}"


def init_tp_group(rank: int, size: int, init_method: str, device: str) -> None:
    """Join the group of `size` ranks that meets at init_method (tcp://address:port): NCCL between GPUs (device:
    this rank's GPU, bound already), gloo on the CPU."""
    global _group
    require_no_group()
    on_gpu = device.startswith("cuda")
    if on_gpu:
        # NCCL registers the buffers of collectives captured in CUDA graphs (NCCL_GRAPH_REGISTER, on by default).
        # With it on, the Qwen2.5-32B shape at TP=2 and batch 16 hangs at its first step on H100 and H200: both
        # GPUs spin in collectives while rank 1 has enqueued all it was sent (BENCHMARKS.md, 'Tensor
        # parallelism'); with it off the same run decodes. Every rank reads it when its communicator starts.
        os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=init_method, rank=rank,
                            world_size=size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                            device_id=torch.device(device) if on_gpu else None)
    _group = TPGroup(rank, size)


def join_all_reduce(kind: str, device: str) -> None:
    """With kind "one_shot" (EngineConfig.all_reduce), join the group's one-shot all-reduce (one_shot.py): a
    collective of every rank, right after init_tp_group. Raises RuntimeError naming the fix if it cannot."""
    if kind == "one_shot":
        one_shot.join(_group.rank, _group.size, torch.device(device))


def require_no_group() -> None:
    """Raises if this process is a rank of a group already: torch.distributed has one default group."""
    if dist.is_initialized():
        raise RuntimeError("this process is already a rank of a tensor-parallel engine; close that engine "
                           "(EngineCore.close) before starting another")


def leave_process_group() -> None:
    """Leave torch.distributed's default group, whatever the other ranks do. The caller must first drop every
    CUDA graph that holds a collective of the group. Over NCCL the communicator is aborted, a local call: the
    graceful shutdown (ncclCommFinalize) waits for the other ranks, which may be gone or be waiting for this
    one, and a rank that leaves has no collective in flight once its device is synchronised."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        torch.cuda.synchronize()
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()


def destroy_tp_group() -> None:
    global _group
    one_shot.leave()
    leave_process_group()
    _group = TPGroup(0, 1)


def tp_group() -> TPGroup:
    return _group
