"""A speculation policy whose decisions are scripted, for tests of what each decision makes a step do."""
from __future__ import annotations

import itertools


def scripted(llm, pattern: list[int]) -> None:
    """Replace the policy's decisions by a pattern repeated; the scheduler and runner follow them as they would the
    policy's own."""
    decisions = itertools.cycle(pattern)
    llm.engine.core.scheduler.policy._decide = lambda batch, kind: next(decisions)
