"""The EAGLE-3 head shipped for SmolLM2-135M-Instruct loads by name, is lossless, and accepts drafts.

Floor: mean acceptance length 2.38 measured on these 3 prompts with the head shipped now (k = 5, greedy, 48
tokens, CPU float32, 2026-11-24); the six heads before it read 2.24, 2.30, 2.21, 1.97, 2.03 and 2.03, though
MT-bench's 80 first turns rank them otherwise (2.55 now, then 2.53, 2.50, 2.37, 2.25, 2.00, 1.91): three prompts
are too few to rank heads.
The test asks for 1.8, below every head shipped so far and well above an untrained head's 1.0-1.1.
"""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.heads import BUILTIN_HEADS

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence."]
GREEDY = SamplingParams(temperature=0, max_tokens=48)


@pytest.fixture(scope="module")
def plain():
    """The model without speculation, loaded once for the module's references."""
    return LLM("smollm2-135m", max_model_len=512)


@pytest.fixture(scope="module")
def reference(plain):
    chats = [plain.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    return chats, [o.outputs[0].token_ids for o in plain.generate(chats, GREEDY, use_tqdm=False)]


def test_shipped_head_is_small_and_in_vllm_layout():
    files = sorted(p.name for p in BUILTIN_HEADS["smollm2-135m-eagle3"].iterdir())
    assert "config.json" in files and "model.safetensors.index.json" in files
    assert all(p.stat().st_size < 16 * 2**20 for p in BUILTIN_HEADS["smollm2-135m-eagle3"].iterdir())


def test_shipped_head_accepts_drafts_losslessly(reference):
    chats, ref = reference
    llm = LLM("smollm2-135m", max_model_len=512, speculative_config={
        "method": "eagle3", "model": "smollm2-135m-eagle3", "num_speculative_tokens": 5})
    outs = [o.outputs[0].token_ids for o in llm.generate(chats, GREEDY, use_tqdm=False)]
    assert outs == ref
    stats = llm.engine.spec_stats.as_dict()
    assert stats["mean_acceptance_length"] >= 1.8, stats


def test_a_tree_of_drafts_emits_the_models_tokens_and_logprobs(plain, reference):
    """The shipped head drafting a tree: tokens and logprobs (those of the accepted path's rows) as without
    speculation, and more tokens a step than a chain of the tree's depth accepts on these prompts (1.8)."""
    chats, _ = reference
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2)
    without = plain.generate(chats, params, use_tqdm=False)
    llm = LLM("smollm2-135m", max_model_len=512, speculative_config={
        "method": "eagle3", "model": "smollm2-135m-eagle3",
        "speculative_token_tree": "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"})
    tree = llm.generate(chats, params, use_tqdm=False)
    assert llm.engine.spec_stats.mean_acceptance_length >= 1.8
    for p, t in zip(without, tree):
        assert t.outputs[0].token_ids == p.outputs[0].token_ids
        for want, got in zip(p.outputs[0].logprobs, t.outputs[0].logprobs, strict=True):
            assert want.keys() == got.keys()
            for token, lp in want.items():
                assert abs(got[token].logprob - lp.logprob) < 1e-3 and got[token].rank == lp.rank
