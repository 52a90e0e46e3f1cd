"""A step's grammar masks: one bitmask row per logits row the step samples or verifies, built on the host in
ModelRunner.launch right after the target's forward is enqueued (so while the device runs it), straight into the
runner's pinned bitmask buffer (InputBuffers.token_bitmask), copied to the device in one copy, and applied to the
logits by one kernel per logits tensor (sample/token_bitmask.py), inside the greedy graphs or eagerly.

What must hold: when the masks are built, every request's matcher has accepted every token before the step
(with asynchronous scheduling the runner first completes the step in flight, whose tokens these are), and a
verifying row's drafts are the ones the device verifies (for a row whose drafts stay on the device, those the
previous step proposed, which its resolve read back). Rows of requests without a grammar allow every token, so
one kernel call covers the whole logits tensor; so do the rows of a request that the previous step ended (the
step's tokens for it are dropped), and a verifying request's rows that its walk does not reach (past a refused
draft: never read, but kept finite for the samplers). The rows that sample come first in the buffer, then each
verifying request's, so a batch that only samples, or only verifies, has request i's rows where a greedy graph
reads them (i, or i * (k + 1) + j).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from specserve.sample.token_bitmask import TokenMask
from specserve.structured_output.draft_masks import CarriedDraftMasks
from specserve.structured_output.fill_threads import batch_fill
from specserve.structured_output.tree_masks import fill_tree_masks
from specserve.worker.input_buffers import TokenBitmaskBuffer


@dataclass
class StepMasks:
    sample: TokenMask | None  # [len(sample_rows), words]: the rows that sample without drafts
    # [len(verify_rows) * (k + 1), words]: each verifying request's k + 1 rows, row j the position after its
    # tree index j (a chain: after its j-th draft), masked from the grammar's state along that node's path
    verify: TokenMask | None

    @classmethod
    def build(cls, sched: SchedulerOutput, sample_rows: list[int], verify_rows: list[int],
              buffer: TokenBitmaskBuffer, drafts_of: Callable[[ScheduledRequest], list[int]],
              tree_parents: tuple[int, ...] | None = None, carried: CarriedDraftMasks | None = None) -> StepMasks:
        """The masks of a step in which at least one sampling request has a grammar. drafts_of: the drafts a
        scheduled request verifies; tree_parents: each tree index's parent when the drafts are trees
        (DraftTree.parents), None for chains; carried: the step before's drafter masks, whose rows a verifying
        chain's positions take where they apply instead of a fill. A group of rows without a grammar request
        gets None."""
        sample = [sched.scheduled[i] for i in sample_rows]
        verify = [sched.scheduled[i] for i in verify_rows]
        host = buffer.fillable()
        num_sample = _fill_sample(buffer, sample)
        taken = CarriedRows()
        num_verify = _fill_verify(buffer, num_sample, verify, drafts_of, tree_parents, carried, taken)
        rows = num_sample + num_verify
        if rows > host.shape[0]:
            raise RuntimeError(f"a step masks {rows} logits rows but the bitmask buffer holds {host.shape[0]}")
        device = buffer.copy(rows)
        if taken.rows:
            buffer.take_rows(taken.rows, carried.source, taken.source_rows)
        return cls(TokenMask(device[:num_sample]) if _any_grammar(sample) else None,
                   TokenMask(device[num_sample:]) if _any_grammar(verify) else None)

    @staticmethod
    def apply(logits: torch.Tensor, mask: TokenMask | None) -> None:
        """Set the logits of disallowed tokens to -inf in place (logits: [rows, vocab] as the mask's rows)."""
        if mask is not None:
            mask.apply(logits)


@dataclass
class CarriedRows:
    """The rows a build takes from the drafter's (CarriedDraftMasks) instead of filling them."""

    rows: list[int] = field(default_factory=list)
    source_rows: list[int] = field(default_factory=list)


def _any_grammar(requests: list[ScheduledRequest]) -> bool:
    return any(s.request.grammar is not None for s in requests)


def _live(s: ScheduledRequest) -> bool:
    return s.request.grammar is not None and not s.request.is_finished


def _fill_sample(buffer: TokenBitmaskBuffer, requests: list[ScheduledRequest]) -> int:
    """Rows 0.. of the buffer's host rows: each request's mask after its tokens. Returns the rows written."""
    live = [i for i, s in enumerate(requests) if _live(s)]
    if len(live) < len(requests) and _any_grammar(requests):
        buffer.allow_all(0, len(requests))
    batch_fill([requests[i].request.grammar.matcher for i in live], buffer.host, live)
    return len(requests)


def _fill_verify(buffer: TokenBitmaskBuffer, first: int, requests: list[ScheduledRequest],
                 drafts_of: Callable[[ScheduledRequest], list[int]], tree_parents: tuple[int, ...] | None,
                 carried: CarriedDraftMasks | None, taken: CarriedRows) -> int:
    """Rows first.. of the buffer's host rows: 1 + the most drafts rows per request, each from a walk of its
    drafts, or named in `taken` where the drafter's carried row applies. Returns the rows written."""
    if not requests:
        return 0
    drafts = [drafts_of(s) for s in requests]
    width = 1 + max(map(len, drafts))
    if not _any_grammar(requests):
        return len(requests) * width
    buffer.allow_all(first, first + len(requests) * width)
    if tree_parents is None:
        _fill_chains(buffer, first, width, requests, drafts, carried, taken)
        return len(requests) * width
    live = [i for i, s in enumerate(requests) if _live(s)]
    fill_tree_masks([requests[i].request.grammar for i in live], buffer.host, [first + i * width for i in live],
                    [drafts[i] for i in live], tree_parents)
    return len(requests) * width


def _fill_chains(buffer: TokenBitmaskBuffer, first: int, width: int, requests: list[ScheduledRequest],
                 drafts: list[list[int]], carried: CarriedDraftMasks | None, taken: CarriedRows) -> None:
    """Each live request's row first + i * width + j: its mask after its drafts 0..j-1, depth by depth, all the
    requests of a depth in one batched call, as RequestGrammar.fill_masks walks one chain: a request stops at
    the first draft its grammar refuses or that ends it (a stop token), and its matcher is rolled back by the
    drafts it took. A row the drafter already built for the same state (carried) goes into `taken`, not filled."""
    walking = [(i, s.request.grammar.matcher) for i, s in enumerate(requests) if _live(s)]
    walking = [(i, m) for i, m in walking if not m.is_terminated()]
    walked = [0] * len(requests)
    spans = {} if carried is None else {
        i: carried.rows(requests[i].request.request_id, requests[i].request.grammar, drafts[i]) for i, _ in walking}
    for depth in range(width):
        fill = []
        for i, m in walking:
            row, depths = spans.get(i, (0, 0))
            if depth < depths:
                taken.rows.append(first + i * width + depth)
                taken.source_rows.append(depth * carried.n + row)
            else:
                fill.append((i, m))
        batch_fill([m for _, m in fill], buffer.host, [first + i * width + depth for i, _ in fill])
        going = []
        for i, m in walking:
            if depth < len(drafts[i]) and m.accept_token(drafts[i][depth]):
                walked[i] += 1
                if not m.is_terminated():
                    going.append((i, m))
        walking = going
    for s, n in zip(requests, walked):
        if n:
            s.request.grammar.matcher.rollback(n)
