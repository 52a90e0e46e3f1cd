"""The one-shot all-reduce's host side without a GPU (the kernel itself: tests/gpu/test_one_shot_all_reduce_cuda.py):
every rank maps the others' buffers in rank order and keeps its own, closing unmaps the others' and frees its own,
and a call takes the one-shot path only for what its buffer holds."""
from __future__ import annotations

import torch

from specserve.distributed.cuda_ipc import SharedBuffer
from specserve.distributed.one_shot import BUFFER_BYTES, OneShotAllReduce


class FakeRuntime:
    """Stands in for CudaRuntime: rank r's allocation is at 1000 * (r + 1); a peer's maps at 10 ** 6 + it."""

    def __init__(self, rank: int):
        self.rank = rank
        self.calls: list[tuple] = []

    def malloc(self, nbytes: int) -> int:
        self.calls.append(("malloc", nbytes))
        return 1000 * (self.rank + 1)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self.calls.append(("memset", ptr, value, nbytes))

    def ipc_handle(self, ptr: int) -> bytes:
        return ptr.to_bytes(8, "little")

    def open_ipc_handle(self, handle: bytes) -> int:
        self.calls.append(("open", int.from_bytes(handle, "little")))
        return 10**6 + int.from_bytes(handle, "little")

    def close_ipc_handle(self, ptr: int) -> None:
        self.calls.append(("close", ptr))

    def free(self, ptr: int) -> None:
        self.calls.append(("free", ptr))


def test_each_rank_maps_the_others_in_rank_order_and_frees_only_its_own():
    world = 4
    runtimes = [FakeRuntime(r) for r in range(world)]
    handles = [rt.ipc_handle(1000 * (rt.rank + 1)) for rt in runtimes]
    buffers = [SharedBuffer.allocate(rt, 4096, rt.rank, lambda _own: handles) for rt in runtimes]
    for rank, (rt, buf) in enumerate(zip(runtimes, buffers)):
        assert buf.addresses == [1000 * (r + 1) if r == rank else 10**6 + 1000 * (r + 1) for r in range(world)]
        assert rt.calls[:2] == [("malloc", 4096), ("memset", 1000 * (rank + 1), 0, 4096)]
        rt.calls.clear()
        buf.close()
        assert sorted(rt.calls) == sorted([("close", 10**6 + 1000 * (r + 1)) for r in range(world) if r != rank]
                                          + [("free", 1000 * (rank + 1))])


def test_a_call_takes_the_one_shot_path_only_for_what_its_buffer_holds():
    rt = FakeRuntime(0)
    buf = SharedBuffer(rt, 0, [1, 2])
    shot = OneShotAllReduce(0, 2, torch.device("cpu"), buf, buf)
    assert shot.fits(torch.zeros(BUFFER_BYTES // 2, dtype=torch.bfloat16))
    assert not shot.fits(torch.zeros(BUFFER_BYTES // 2 + 1, dtype=torch.bfloat16))  # past the buffer: NCCL
    assert not shot.fits(torch.zeros(64, 4, dtype=torch.float32).t())  # not contiguous
    assert not shot.fits(torch.zeros(64, dtype=torch.int64))  # not a float
