"""The one-shot all-reduce's host side without a GPU (the kernel itself: tests/gpu/test_one_shot_all_reduce_cuda.py):
every rank maps the others' buffers in rank order and keeps its own, closing unmaps the others' and frees its own,
a call takes the one-shot path only for what its buffer holds, and the engine's default takes it exactly where it
can run."""
from __future__ import annotations

import pytest
import torch

from specserve.config import EngineConfig
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


@pytest.mark.parametrize("tp, nnodes, peers, chosen", [
    (2, 1, True, "one_shot"),
    (4, 1, True, "one_shot"),
    (2, 1, False, "nccl"),  # GPUs that cannot reach each other's memory
    (3, 1, True, "nccl"),  # the kernel takes 2, 4 or 8 ranks
    (4, 2, True, "nccl"),  # two nodes: no memory to map across them
    (1, 1, True, "nccl"),  # one rank: nothing to all-reduce
])
def test_the_default_all_reduce_is_one_shot_where_it_runs(monkeypatch, tp, nnodes, peers, chosen):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    asked = []
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: asked.append((a, b)) or peers)
    cfg = EngineConfig(model="unused", device="cuda", tensor_parallel_size=tp, nnodes=nnodes,
                       master_addr="127.0.0.1", master_port=29500)
    assert cfg.all_reduce == chosen
    if chosen == "one_shot":  # every ordered pair of the group's GPUs was asked
        assert sorted(asked) == [(a, b) for a in range(tp) for b in range(tp) if a != b]
    assert EngineConfig(model="unused", device="cpu", tensor_parallel_size=2).all_reduce == "nccl"
