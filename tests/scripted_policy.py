"""A speculation policy made predictable for tests: its decisions scripted, for tests of what each decision makes a
step do, or its steps timed by its cost table, for tests of what it makes of known costs."""
from __future__ import annotations

import itertools

from specserve.spec_decode.policy import SpeculationPolicy


def scripted(llm, pattern: list[int]) -> None:
    """Replace the policy's decisions by a pattern repeated; the scheduler and runner follow them as they would the
    policy's own."""
    decisions = itertools.cycle(pattern)
    llm.engine.core.scheduler.policy._decide = lambda batch, kind: next(decisions)


def timed_by_costs(monkeypatch) -> None:
    """Every step a policy measures takes its cost table's seconds for its decision and batch instead of the host's:
    on a tiny model a drafting step yields within the host's noise of a plain one on a CPU, so a test of what the
    policy makes of known costs would otherwise test that noise."""
    observe = SpeculationPolicy.observe_step
    monkeypatch.setattr(SpeculationPolicy, "observe_step", lambda self, kind, decisions, batch, emitted, _: observe(
        self, kind, decisions, batch, emitted, self.costs.step_seconds(decisions[0], batch)))
