"""A one-shot all-reduce over symmetric memory, for the small messages of a decode step.

At batch 1 a tensor-parallel step runs 2 x layers + 1 all-reduces of a few KiB each, one after the other,
so what each costs is its latency, not bandwidth. NCCL's takes some 20 us inside a CUDA graph on two H100s
(benchmarks/allreduce_latency.py). torch's symmetric memory (torch.distributed._symmetric_memory) maps a
buffer of every rank of the node into every other rank's address space; its one-shot all-reduce copies the
local input into this rank's buffer, meets the other ranks at a barrier on signal pads, and sums every
rank's buffer over NVLink in one kernel. It needs no NVLink multicast and records into CUDA graphs.

It is used only where measured faster than NCCL: configs/one_shot_all_reduce.json, written by
`benchmarks/allreduce_latency.py --write-table`, holds per device name and number of ranks the largest
message in bytes up to which it won at every size measured. A device or group size with no entry uses NCCL
alone.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

TABLE_PATH = Path(__file__).resolve().parent / "configs" / "one_shot_all_reduce.json"


def load_max_bytes(device_name: str, ranks: int, path: Path = TABLE_PATH) -> int:
    """The largest message (bytes) the one-shot all-reduce takes on device_name with `ranks` ranks; 0: none."""
    if not path.exists():
        return 0
    return int(json.loads(path.read_text()).get(device_name, {}).get(str(ranks), 0))


def write_max_bytes(device_name: str, ranks: int, max_bytes: int, path: Path = TABLE_PATH) -> None:
    table = json.loads(path.read_text()) if path.exists() else {}
    table.setdefault(device_name, {})[str(ranks)] = max_bytes
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")


@dataclass
class OneShotAllReduce:
    """This rank's symmetric buffer of max_bytes, joined with every rank's of the default group."""

    buffer: torch.Tensor  # uint8, in symmetric memory; viewed as each message's dtype
    group_name: str
    max_bytes: int

    @classmethod
    def join(cls, device: torch.device, max_bytes: int) -> OneShotAllReduce:
        """Allocate and exchange the buffers: a collective of every rank of the default group."""
        from torch.distributed import _symmetric_memory as symm_mem

        op = torch.ops.symm_mem.one_shot_all_reduce_copy  # AttributeError where this torch lacks it
        del op
        group_name = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
        buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(buffer, group_name)
        return cls(buffer, group_name, max_bytes)

    def takes(self, x: torch.Tensor) -> bool:
        return x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, in a new tensor."""
        staging = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", self.group_name)


def join_one_shot_all_reduce(device: torch.device, ranks: int) -> OneShotAllReduce | None:
    """The one-shot all-reduce for this device and group size where the table has it, else None (NCCL alone).
    Every rank calls this at the same point; the ranks agree whether all of them could join, so that either
    every rank uses it or none does."""
    max_bytes = load_max_bytes(torch.cuda.get_device_name(device), ranks)
    if not max_bytes:
        return None
    try:
        one_shot = OneShotAllReduce.join(device, max_bytes)
    except (RuntimeError, ImportError, AttributeError) as e:
        logger.warning("symmetric memory is unavailable here (%s); all-reduces use NCCL alone", e)
        one_shot = None
    joined = torch.tensor([int(one_shot is not None)], device=device)
    dist.all_reduce(joined, op=dist.ReduceOp.MIN)
    return one_shot if int(joined.item()) else None
