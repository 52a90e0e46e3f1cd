"""One-shot all-reduce over buffers every rank maps (distributed/one_shot.py): one kernel per call, in place.

Each program owns a slice of the message (programs stride over it) and meets the same program of every other
rank at barriers of its own, so programs never wait on each other within a rank:

1. copy its slice of x into this rank's buffer;
2. barrier (release / acquire, system scope): every rank's copy is visible to every rank;
3. sum the slice over the ranks' buffers, in rank order on every rank (so every rank gets the same bits),
   in float32, and write it to x;
4. barrier (relaxed): every rank has read the buffers before any rank's next call overwrites them.

A barrier is one flag per (program, sending rank) in each rank's signal pad, zero at rest: a rank sets its flag
in every peer's pad from 0 to 1 (retrying while the peer has not yet taken the previous call's), then takes
its own pad's flags from 1 back to 0 as they arrive. The pads are zero again after every call, so the kernel
keeps no counter and replays inside CUDA graphs as it runs eagerly.

The flags are set and taken with PTX atomics (inline assembly), so this kernel runs on NVIDIA GPUs only, not
under the Triton interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements a program moves per step, and the most programs a call runs (the signal pads hold a flag per program
# and rank).
BLOCK = 2048
MAX_PROGRAMS = 32
NUM_WARPS = 8


@triton.jit
def _thread_index():
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


def _cas_loop(order: str, expect: int, new: int) -> tl.constexpr:
    """PTX that swaps a flag from `expect` to `new` at system scope with the memory order given, retrying until
    the flag held `expect`."""
    return tl.constexpr(f"""
    {{
        .reg .u32 %old;
        .reg .pred %swapped;
    cas_retry:
        atom.global.sys.{order}.cas.b32 %old, [$1], {expect}, {new};
        setp.eq.u32 %swapped, %old, {expect};
        @!%swapped bra cas_retry;
        mov.u32 $0, %old;
    }}
    """)


# Sending sets a peer's flag 0 -> 1 once its reader took the last one; taking sets one's own 1 -> 0 once its sender
# set it. The first barrier of a call orders the buffers' writes before their reads (release, acquire); the last
# only needs every read done, which the CTA barrier before it gives (relaxed).
_SEND_RELEASE = _cas_loop("release", 0, 1)
_SEND_RELAXED = _cas_loop("relaxed", 0, 1)
_TAKE_ACQUIRE = _cas_loop("acquire", 1, 0)
_TAKE_RELAXED = _cas_loop("relaxed", 1, 0)


@triton.jit
def _swap_flags(flags, ASM: tl.constexpr):
    tl.inline_asm_elementwise(ASM, "=r, l", [flags], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _barrier(pad_addresses, program, rank, WORLD: tl.constexpr, ACQ_REL: tl.constexpr):
    """Meet this program of every rank: the first WORLD threads send one flag each and take one each."""
    ranks = tl.arange(0, WORLD)
    peer_pads = tl.load(pad_addresses + ranks).to(tl.pointer_type(tl.int32))
    own_pad = tl.load(pad_addresses + rank).to(tl.pointer_type(tl.int32))
    if _thread_index() < WORLD:
        if ACQ_REL:
            _swap_flags(peer_pads + program * WORLD + rank, _SEND_RELEASE)
            _swap_flags(own_pad + program * WORLD + ranks, _TAKE_ACQUIRE)
        else:
            _swap_flags(peer_pads + program * WORLD + rank, _SEND_RELAXED)
            _swap_flags(own_pad + program * WORLD + ranks, _TAKE_RELAXED)


@triton.jit
def _one_shot_all_reduce_kernel(x_ptr, n, buffer_addresses, pad_addresses, rank,
                                WORLD: tl.constexpr, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    stride = tl.num_programs(0) * BLOCK
    dtype = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    own = tl.load(buffer_addresses + rank).to(tl.pointer_type(dtype))
    for start in range(program * BLOCK, n, stride):
        idx = start + offs
        tl.store(own + idx, tl.load(x_ptr + idx, mask=idx < n), mask=idx < n)
    tl.debug_barrier()
    _barrier(pad_addresses, program, rank, WORLD, True)
    tl.debug_barrier()
    for start in range(program * BLOCK, n, stride):
        idx = start + offs
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            buffer = tl.load(buffer_addresses + r).to(tl.pointer_type(dtype))
            acc += tl.load(buffer + idx, mask=idx < n, other=0.0).to(tl.float32)
        tl.store(x_ptr + idx, acc.to(dtype), mask=idx < n)
    tl.debug_barrier()
    _barrier(pad_addresses, program, rank, WORLD, False)


def num_programs(numel: int) -> int:
    return max(1, min(MAX_PROGRAMS, triton.cdiv(numel, BLOCK)))


def one_shot_all_reduce(x: torch.Tensor, buffer_addresses: torch.Tensor, pad_addresses: torch.Tensor,
                        rank: int) -> torch.Tensor:
    """x summed over the ranks, in place (x contiguous, on this rank's GPU, at most a buffer's bytes);
    *_addresses: int64 device tensors of every rank's buffer and signal pad as this rank maps them."""
    world = buffer_addresses.numel()
    _one_shot_all_reduce_kernel[(num_programs(x.numel()),)](x, x.numel(), buffer_addresses, pad_addresses, rank,
                                                           WORLD=world, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return x
