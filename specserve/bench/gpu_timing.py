"""GPU time per call, measured with CUDA events (the one timing loop the GPU benchmark scripts share)."""
from __future__ import annotations

from collections.abc import Callable

import torch


def gpu_ms(fn: Callable[[], object], iters: int, warmup: int = 5) -> float:
    """Milliseconds per call of fn (a graph replay, an engine step) over iters back-to-back calls after
    warmup calls, from events on the current stream: launch gaps count, host time beside them does not."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
