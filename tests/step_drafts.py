"""The drafts an engine proposes, step by step, for tests that compare two ways of drafting."""
from __future__ import annotations

from specserve import LLM, SamplingParams


def recorded_drafts(llm: LLM, prompts, params: SamplingParams) -> list[dict[str, list[int]]]:
    """The drafts every step proposed while llm generates for prompts, in step order (what the next step
    verifies): one {request id: drafts} per step."""
    runner, steps = llm.engine.runner, []
    original = runner.resolve

    def resolve(handle):
        out = original(handle)
        steps.append(dict(out.drafts))
        return out

    runner.resolve = resolve
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del runner.resolve
    return steps
