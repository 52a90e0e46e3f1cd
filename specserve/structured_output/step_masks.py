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
    _fill_along_drafts(bitmask, [i * width for i in live], [requests[i].request.grammar.matcher for i in live],
                       [drafts[i] for i in live])
    if tree_parents is None:
        _fill_along_drafts(bitmask, [i * width for i in live], [requests[i].request.grammar.matcher for i in live],
                           [drafts[i] for i in live])
    else:  # each node from its own path's state: a walk of each request's tree
        for i in live:
            requests[i].request.grammar.fill_masks(bitmask, i * width, drafts[i], tree_parents)
    return to_device(bitmask, device, torch.int32)


_batch = None


def _batch_matcher():
    """xgrammar's multi-threaded filler, made once: it fills many matchers' rows in parallel."""
    global _batch
    if _batch is None:
        import xgrammar as xgr

        _batch = xgr.BatchGrammarMatcher()
    return _batch


def _fill_along_drafts(bitmask: torch.Tensor, first_rows: list[int], matchers: list, drafts: list[list[int]]) -> None:
    """Row first_rows[j] + d: the tokens matchers[j] allows after drafts[j][:d], for every d up to the first
    draft it refuses or the draft that completes its grammar. Later rows keep what they hold: the verification
    rejects that draft, so no token is taken from a later position. One depth at a time for all matchers
    together; every matcher is rolled back to where it started before this returns (a matcher moves forward
    only with the tokens its request keeps, Request.append_token)."""
    import xgrammar as xgr

    batch = _batch_matcher()
    walked = [0] * len(matchers)
    active = list(range(len(matchers)))
    depth = 0
    while active:
        batch.batch_fill_next_token_bitmask([matchers[j] for j in active], bitmask,
                                            [first_rows[j] + depth for j in active])
        active = [j for j in active if len(drafts[j]) > depth]
        if not active:
            break
        accepted = xgr.BatchGrammarMatcher.batch_accept_token([matchers[j] for j in active],
                                                              [drafts[j][depth] for j in active])
        for j, ok in zip(active, accepted):
            walked[j] += ok
        active = [j for j, ok in zip(active, accepted) if ok and not matchers[j].is_terminated()]
        depth += 1
    back = [j for j in range(len(matchers)) if walked[j]]
    if back:
        xgr.BatchGrammarMatcher.batch_rollback([matchers[j] for j in back], [walked[j] for j in back])
