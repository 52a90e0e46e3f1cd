"""A step's grammar masks: one bitmask row per logits row the step samples or verifies, built on the host in
ModelRunner.launch right after the target's forward is enqueued (so while the device runs it; building them
waits for nothing on the device), copied to the device in one copy, and applied to the logits by one xgrammar
kernel per logits tensor.

Rows of requests without a grammar allow every token, so one kernel call covers the whole logits tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.scheduler import SchedulerOutput


@dataclass
class StepMasks:
    sample: torch.Tensor | None  # [len(sample_rows), words]: the rows that sample without drafts
    verify: torch.Tensor | None  # [len(verify_rows) * (k + 1), words]: each verifying request's k + 1 rows

    @classmethod
    def build(cls, sched: SchedulerOutput, sample_rows: list[int], verify_rows: list[int], vocab_size: int,
              device: torch.device) -> StepMasks:
        """The masks of a step in which at least one sampling request has a grammar."""
        return cls(_masks(sched, sample_rows, 1, vocab_size, device),
                   _masks(sched, verify_rows, None, vocab_size, device))

    @staticmethod
    def apply(logits: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Set the logits of disallowed tokens to -inf in place (logits: [rows, vocab] as the mask's rows)."""
        if mask is not None:
            import xgrammar as xgr

            xgr.apply_token_bitmask_inplace(logits, mask)


def _masks(sched: SchedulerOutput, rows: list[int], width: int | None, vocab_size: int,
           device: torch.device) -> torch.Tensor | None:
    """width: logits rows per request, or None for verification (1 + the step's most drafts)."""
    import xgrammar as xgr

    requests = [sched.scheduled[i] for i in rows]
    if not any(s.request.grammar is not None for s in requests):
        return None
    if width is None:
        width = 1 + max(len(s.spec_token_ids) for s in requests)
    bitmask = xgr.allocate_token_bitmask(len(requests) * width, vocab_size)  # every token allowed
    for i, s in enumerate(requests):
        if s.request.grammar is not None:
            s.request.grammar.fill_masks(bitmask, i * width, s.spec_token_ids if width > 1 else [])
    if device.type == "cuda":
        return bitmask.pin_memory().to(device, non_blocking=True)
    return bitmask
