"""Logits of the tokens a grammar refuses set to -inf, from xgrammar's token bitmask (int32 [rows,
ceil(vocab / 32)], bit t % 32 of word t // 32 set where token t is allowed): one Triton launch on CUDA
(kernels/token_bitmask.py, imported there only: the CPU path runs without Triton), torch ops elsewhere.

`enabled` (a one-value integer device tensor, or None for always) switches the mask on for a step: a CUDA
graph that records the call applies a step's masks only where that step set the switch, so one recording
serves steps with and without grammar rows (worker/staged_inputs.py, MASKED).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenMask:
    """The masks of some logits rows: bitmask row i masks logits row i, where switch (None: always) is set."""

    bitmask: torch.Tensor  # int32 [>= rows, ceil(vocab / 32)]
    switch: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor) -> None:
        apply_token_bitmask(logits, self.bitmask, self.switch)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, enabled: torch.Tensor | None = None,
                        use_triton: bool | None = None) -> None:
    """In place on logits [rows, vocab] (unit column stride), bitmask's first rows masking logits' rows. Any float
    dtype; a token past the bitmask's words is never asked for (the bitmask covers the vocabulary)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"apply_token_bitmask takes logits [rows, vocab] with unit column stride, got "
                         f"{tuple(logits.shape)} with strides {logits.stride()}")
    if bitmask.dtype != torch.int32 or bitmask.shape[0] < logits.shape[0] or 32 * bitmask.shape[1] < logits.shape[1]:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} {bitmask.dtype} does not cover logits "
                         f"{tuple(logits.shape)}: need int32 [>= rows, >= ceil(vocab / 32)]")
    if use_triton is None:
        use_triton = logits.is_cuda
    if use_triton:
        from specserve.kernels.token_bitmask import apply_token_bitmask_triton

        apply_token_bitmask_triton(logits, bitmask, enabled)
    else:
        apply_token_bitmask_torch(logits, bitmask, enabled)


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, enabled: torch.Tensor | None) -> None:
    """The same in torch ops (the CPU path and the kernel's reference); reads the switch on the device."""
    rows, vocab = logits.shape
    cols = torch.arange(vocab, device=logits.device)
    words = bitmask[:rows, :].index_select(1, cols // 32)
    refused = ((words >> (cols % 32)) & 1) == 0
    if enabled is not None:
        refused &= enabled.reshape(()) != 0
    logits.masked_fill_(refused, float("-inf"))
