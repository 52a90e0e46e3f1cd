"""The one-shot all-reduce (`all_reduce="one_shot"`): small all-reduces of a tensor-parallel group of one node
in one kernel over buffers every rank maps (kernels/one_shot_all_reduce.py), instead of NCCL.

At batch 1 a decode step of an 8B model at TP=2 runs 65 all-reduces of 8 KiB, where NCCL's latency, not the
link, sets the time (BENCHMARKS.md, 'Tensor parallelism'): a one-shot all-reduce reads every peer's whole
message once over NVLink, one kernel and two barriers. It reads world-size times the bytes of a ring, so
messages past its buffer go to NCCL (communication.all_reduce decides per call).

Joining is a collective of every rank right after the group's start (parallel_state.join_all_reduce): each
rank allocates its buffer and signal pad (cuda_ipc.SharedBuffer), maps the others', and the group runs one
all-reduce whose result it checks, so a node where the mapping does not work fails at start-up, naming the fix.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from specserve.distributed.cuda_ipc import CudaRuntime, SharedBuffer

logger = logging.getLogger(__name__)

# The largest message (bytes) a call takes: larger ones go to NCCL. Decode and verification steps of an 8B
# model up to 512 tokens fit.
BUFFER_BYTES = 4 << 20
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class OneShotAllReduce:
    """This rank's side of the one-shot all-reduce; join() builds it, close() releases it."""

    def __init__(self, rank: int, world: int, device: torch.device, buffers: SharedBuffer, pads: SharedBuffer):
        self.rank, self.world, self.device = rank, world, device
        self._buffers, self._pads = buffers, pads
        self._buffer_addresses = torch.tensor(buffers.addresses, dtype=torch.int64, device=device)
        self._pad_addresses = torch.tensor(pads.addresses, dtype=torch.int64, device=device)

    @classmethod
    def join(cls, rank: int, world: int, device: torch.device) -> OneShotAllReduce:
        """A collective of the group's ranks, all on one node: allocate, map and check."""
        from specserve.kernels.one_shot_all_reduce import MAX_PROGRAMS

        if device.index is None:  # "cuda": the GPU this rank bound (parallel_state.rank_device)
            device = torch.device("cuda", torch.cuda.current_device())
        # Rank r of the node runs on cuda:r (parallel_state.rank_device): the group's GPUs are 0..world-1.
        for peer in range(world):
            if peer != device.index and not torch.cuda.can_device_access_peer(device.index, peer):
                raise RuntimeError(f"GPU {device.index} cannot access GPU {peer}'s memory directly (no NVLink or PCIe "
                                   "peer access), which the one-shot all-reduce needs; use all_reduce='nccl'")
        runtime = CudaRuntime()
        runtime.set_device(device.index)

        def all_gather(handle: bytes) -> list[bytes]:
            handles: list[bytes | None] = [None] * world
            dist.all_gather_object(handles, handle)
            return handles

        buffers = SharedBuffer.allocate(runtime, BUFFER_BYTES, rank, all_gather)
        pads = SharedBuffer.allocate(runtime, MAX_PROGRAMS * world * 4, rank, all_gather)
        joined = cls(rank, world, device, buffers, pads)
        joined._check()
        return joined

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dtype in DTYPES and x.is_contiguous() and x.device == self.device
                and x.numel() * x.element_size() <= BUFFER_BYTES)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from specserve.kernels.one_shot_all_reduce import one_shot_all_reduce

        return one_shot_all_reduce(x, self._buffer_addresses, self._pad_addresses, self.rank)

    def _check(self) -> None:
        """Every rank reduces (rank + 1) * ones; each must read 1 + 2 + ... + world everywhere, which it can
        only if the mapping and the barriers work."""
        for numel in (1, 3000, BUFFER_BYTES // 4):
            x = torch.full((numel,), float(self.rank + 1), dtype=torch.float32, device=self.device)
            self(x)
            expected = self.world * (self.world + 1) / 2
            if not bool((x == expected).all()):
                raise RuntimeError(f"the one-shot all-reduce's start-up check read {x.unique().tolist()} on rank "
                                   f"{self.rank}, not {expected}; use all_reduce='nccl'")
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Release the buffers (after every CUDA graph that replays this all-reduce is gone)."""
        torch.cuda.synchronize(self.device)
        self._buffers.close()
        self._pads.close()


_current: OneShotAllReduce | None = None


def join(rank: int, world: int, device: torch.device) -> None:
    global _current
    _current = OneShotAllReduce.join(rank, world, device)
    logger.info("One-shot all-reduce on for messages up to %d KiB (rank %d of %d)", BUFFER_BYTES >> 10, rank, world)


def current() -> OneShotAllReduce | None:
    return _current


def leave() -> None:
    global _current
    if _current is not None:
        _current.close()
        _current = None
