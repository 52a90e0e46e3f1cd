"""Which steps overlapped: the check that asynchronous scheduling really runs ahead."""
from __future__ import annotations

from specserve import LLM


def record_overlap(llm: LLM) -> list[bool]:
    """For every resolved step: whether a later step's launch had begun before it was resolved (a step with
    grammar masks resolves the one before it from inside its own launch)."""
    runner, started, overlapped = llm.engine.runner, [], []
    launch, resolve = runner.launch, runner.resolve

    def logged_launch(sched, *args):
        started.append(sched)
        return launch(sched, *args)

    def logged_resolve(handle):
        overlapped.append(started[-1] is not handle.sched)
        return resolve(handle)

    runner.launch, runner.resolve = logged_launch, logged_resolve
    return overlapped
