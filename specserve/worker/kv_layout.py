"""What one block of the paged KV cache is: the layers of every model that caches keys and values.

The target and a drafter (an EAGLE head's layer, a draft model's layers)
address the same block ids through the same block tables, so a block costs
the bytes of all their layers together, and the pool's size in blocks is one
number for all of them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from specserve.models.arch_config import ArchConfig


@dataclass(frozen=True)
class KVCacheLayout:
    """One model's caches: num_layers layers of [2, blocks, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim) < 1:
            raise ValueError(f"a KV cache layout needs positive sizes, got {self}")

    @classmethod
    def of(cls, arch: ArchConfig, num_layers: int | None = None) -> KVCacheLayout:
        return cls(num_layers or arch.num_layers, arch.num_kv_heads, arch.head_dim)

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim * dtype.itemsize

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One tensor [layers, 2, num_blocks + 1, block_size, kv heads, head dim] whose entries are the layers'
        caches, so one copy moves slots in all of them (tree_verify.move_kv). The block past the pool's is no
        request's: its first slot is where padded rows' cache moves go (KVCaches.spare_slot)."""
        shape = (self.num_layers, 2, num_blocks + 1, block_size, self.num_kv_heads, self.head_dim)
        return zeroed(shape, dtype, device)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros. On the CPU its bytes come from numpy's zeros (calloc), whose pages the system maps,
    zeroed, on first write: a default-sized CPU pool (kv_sizing.CPU_KV_CACHE_BYTES) then costs nothing until
    used, where torch.zeros writes every page first. Attention reads slots past a request's tokens (masked out,
    but multiplied by zero), so they must hold finite values: zeros, never uninitialised memory."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class KVCaches:
    """Every model's KV cache over one pool of blocks: the target's layers here (stack, layers), a drafter's
    handed to it. Graphs record the caches' addresses: allocate before capturing them, and free only after
    releasing them."""

    def __init__(self, target: KVCacheLayout, block_size: int, dtype: torch.dtype, device: torch.device):
        self.layouts = [target]
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.drafter = None
        self.num_blocks = 0
        # One tensor per layout; the target's is stack, its entries layers.
        self.stacks: list[torch.Tensor] = []
        self.stack: torch.Tensor | None = None
        self.layers: list[torch.Tensor] = []
        # The first slot of the block past the pool's (KVCacheLayout.allocate).
        self.spare_slot = 0

    def add_drafter(self, speculator) -> None:
        """A speculator with a kv_layout gets its cache over the same blocks (Speculator.bind_kv_cache)."""
        if speculator.kv_layout is not None:
            self.layouts.append(speculator.kv_layout)
            self.drafter = speculator

    @property
    def block_bytes(self) -> int:
        """The bytes of one block over every model's layers."""
        return sum(layout.block_bytes(self.block_size, self.dtype) for layout in self.layouts)

    def allocate(self, num_blocks: int) -> None:
        self.stacks = [layout.allocate(num_blocks, self.block_size, self.dtype, self.device)
                       for layout in self.layouts]
        self.num_blocks, self.stack, self.layers = num_blocks, self.stacks[0], list(self.stacks[0].unbind(0))
        self.spare_slot = num_blocks * self.block_size
        if self.drafter is not None:
            self.drafter.bind_kv_cache(self.stacks[1])

    def free(self) -> None:
        self.num_blocks, self.stacks, self.stack, self.layers, self.spare_slot = 0, [], None, [], 0
        if self.drafter is not None:
            self.drafter.bind_kv_cache(None)

    def clear(self) -> None:
        """Zero every cache, as allocated."""
        for stack in self.stacks:
            stack.zero_()
