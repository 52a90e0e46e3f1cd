"""One engine's greedy tokens on the CPU, the engine closed (and its ranks stopped) before the next starts."""
from __future__ import annotations

from specserve import LLM, SamplingParams


def greedy_tokens(path, prompts, max_tokens: int, **kwargs) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", device="cpu", **kwargs)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    finally:
        llm.engine.core.close()
