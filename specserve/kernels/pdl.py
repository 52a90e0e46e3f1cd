"""Programmatic dependent launch (PDL): a layer's kernels start while the kernel ahead of them ends
(docs/design.md, 'Programmatic dependent launch').

A decode step at small batch is a chain of short kernels (about 300 a step for Llama-3-8B), each of which
pays its launch and its programs' placement on the SMs after the kernel ahead has ended. Launched with PDL
on Hopper, a kernel is placed once every program of the kernel ahead has passed its own wait_for_previous
(or ended), and its programs wait in wait_for_previous until that kernel has ended and its writes are
visible.

What must hold: a kernel launched with PDL (`pdl_args(device)`: its launch option and `PDL` flag) calls
wait_for_previous before it reads or writes global memory, so it reads what the kernels ahead wrote and
overwrites nothing they still read. That holds transitively: the kernel ahead ended only after its own wait
returned. Letting the next kernel be placed early is safe anywhere (it only waits there); every program of a
kernel has been placed by then, so waiting programs never keep one of its programs off the SMs. Off on the
CPU (the interpreter has no grid dependencies) and before Hopper.

Before its wait a kernel may read what no kernel writes: a projection's weight. prefetch_l2 starts its first
chunks towards L2 while the kernel ahead ends, so the weight stream does not start from DRAM's latency.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

# 128-byte lines of each weight row a projection asks L2 for before its wait (prefetch_weight_rows): 512 bytes
# of an FP8 row, 256 of a bfloat16 one; 0 asks for none.
PREFETCH_LINES = 4


@lru_cache(maxsize=None)
def launch_pdl(device: torch.device) -> bool:
    """Whether kernels on device launch with PDL: a CUDA device of compute capability 9 or more."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_args(device: torch.device) -> dict:
    """A launch's keyword arguments for PDL on device: the kernel's PDL flag and the launch option, always
    equal (a kernel launched with PDL must wait in wait_for_previous)."""
    on = launch_pdl(device)
    return dict(PDL=on, launch_pdl=on)


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Wait for the kernel ahead to end (its writes visible), then let the next kernel be placed."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_weight_rows(w_ptr, rows, N, stride_wn, k_start, K, LINES: tl.constexpr):
    """Ask L2 for the first LINES 128-byte lines from column k_start of the weight rows `rows` (a vector, those
    past N ignored) of w_ptr [N, K]. Nothing is loaded into registers and nothing waits for the lines; every
    address stays inside the weight (rows and columns clamped)."""
    step: tl.constexpr = 128 // (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
    cols = tl.minimum(k_start + tl.arange(0, LINES) * step, K - 1)
    ptrs = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[None, :] * stride_wn + cols[:, None]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_and_wait(w_ptr, rows, N, stride_wn, k_start, K, BOTH_HALVES: tl.constexpr, PDL: tl.constexpr,
                      LINES: tl.constexpr):
    """A projection's start under PDL: ask L2 for the first LINES lines of the weight rows `rows` (with
    BOTH_HALVES, of a gate/up weight [2N, K]'s up rows, rows + N, too), then wait for the kernel ahead. The
    weight is no kernel's output, so it may be asked for before the wait."""
    if PDL and LINES > 0:
        prefetch_weight_rows(w_ptr, rows, N, stride_wn, k_start, K, LINES)
        if BOTH_HALVES:
            prefetch_weight_rows(w_ptr, rows + N, 2 * N, stride_wn, k_start, K, LINES)
    wait_for_previous(PDL)
