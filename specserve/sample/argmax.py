"""Greedy argmax over logits: torch's, or, for a large vocabulary on a GPU, the split kernels of kernels/argmax.py
(imported there only: the CPU path runs without Triton)."""
from __future__ import annotations

import torch


def greedy_argmax(logits: torch.Tensor, captured: bool = False) -> torch.Tensor:
    """logits.argmax(dim=-1) over [rows, vocab]: the split kernels for a large vocabulary on a GPU.
    captured: the call is being recorded into a CUDA graph (a smaller vocabulary already pays)."""
    if logits.is_cuda and logits.stride(-1) == 1:
        from specserve.kernels.argmax import argmax_rows, splits

        if splits(logits.shape[-1], captured):
            return argmax_rows(logits)
    return logits.argmax(dim=-1)
