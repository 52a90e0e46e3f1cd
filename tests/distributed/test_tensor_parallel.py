"""Tensor parallelism on the CPU: two ranks over gloo give TP=1's greedy tokens (float32), with batching,
chunked prefill, prefix-cache hits and preemption; the errors that name the fix; workers that stop."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.errors import ConfigError, EngineUnavailableError
from tests.conftest import repetitive_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _generate(path, prompts, **kwargs):
    """(token ids per prompt, the engine's outputs) of a fresh engine, closed afterwards."""
    llm = LLM(str(path), dtype="float32", device="cpu", **kwargs)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], outs
    finally:
        llm.engine.core.close()


def test_tp2_greedy_equals_tp1(tiny_llama):
    path, hf = tiny_llama
    prompts = repetitive_prompts(hf.config.vocab_size, n=5, seed=3)
    want, _ = _generate(path, prompts)
    got, _ = _generate(path, prompts, tensor_parallel_size=2)
    assert got == want
