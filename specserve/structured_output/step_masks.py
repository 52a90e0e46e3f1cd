"""A step's grammar masks: one bitmask row per logits row the step samples or verifies, built on the host in
ModelRunner.launch right after the target's forward is enqueued (so while the device runs it), copied to the
device in one copy, and applied to the logits by one xgrammar kernel per logits tensor.

What must hold: when the masks are built, every request's matcher has accepted every token before the step
(with asynchronous scheduling the runner first completes the step in flight, whose tokens these are), and a
verifying row's drafts are the ones the device verifies (for a row whose drafts stay on the device, those the
previous step proposed, which its resolve read back). Rows of requests without a grammar allow every token, so
one kernel call covers the whole logits tensor; so do the rows of a request that the previous step ended (the
step's tokens for it are dropped).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from specserve.transfer import to_device


@dataclass
class StepMasks:
    sample: torch.Tensor | None  # [len(sample_rows), words]: the rows that sample without drafts
    # [len(verify_rows) * (k + 1), words]: each verifying request's k + 1 rows, row j the position after its
    # tree index j (a chain: after its j-th draft), masked from the grammar's state along that node's path
    verify: torch.Tensor | None

    @classmethod
    def build(cls, sched: SchedulerOutput, sample_rows: list[int], verify_rows: list[int], vocab_size: int,
              device: torch.device, drafts_of: Callable[[ScheduledRequest], list[int]],
              tree_parents: tuple[int, ...] | None = None) -> StepMasks:
        """The masks of a step in which at least one sampling request has a grammar. drafts_of: the drafts a
        scheduled request verifies; tree_parents: each tree index's parent when the drafts are trees
        (DraftTree.parents), None for chains."""
        return cls(_masks(sched, sample_rows, False, vocab_size, device, drafts_of),
                   _masks(sched, verify_rows, True, vocab_size, device, drafts_of, tree_parents))

    @staticmethod
    def apply(logits: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Set the logits of disallowed tokens to -inf in place (logits: [rows, vocab] as the mask's rows)."""
        if mask is not None:
            import xgrammar as xgr

            xgr.apply_token_bitmask_inplace(logits, mask)


def _masks(sched: SchedulerOutput, rows: list[int], verify: bool, vocab_size: int, device: torch.device,
           drafts_of: Callable[[ScheduledRequest], list[int]],
           tree_parents: tuple[int, ...] | None = None) -> torch.Tensor | None:
    """verify: each request has 1 + the step's most drafts rows, else one."""
    import xgrammar as xgr

    requests = [sched.scheduled[i] for i in rows]
    if not any(s.request.grammar is not None for s in requests):
        return None
    drafts = [drafts_of(s) if verify else [] for s in requests]
    width = 1 + max(map(len, drafts))
    bitmask = xgr.allocate_token_bitmask(len(requests) * width, vocab_size)  # every token allowed
    live = [i for i, s in enumerate(requests) if s.request.grammar is not None and not s.request.is_finished]
    # Each request's rows from its own walk, on this thread: xgrammar fills a row in microseconds, less than
    # waking its batch filler's threads costs beside the engine's own.
    for i in live:
        requests[i].request.grammar.fill_masks(bitmask, i * width, drafts[i], tree_parents)
    return to_device(bitmask, device, torch.int32)

