"""Our Llama-family implementation against Hugging Face transformers on the same random weights."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, make_hf_model
from specserve import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox",
    "Paged attention stores keys and values in fixed-size blocks. Continuous batching admits",
    "Hi",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Symbols: (){}[]<>!?;: The quick brown fox jumps over",
]

VARIANTS = {
    "llama": dict(arch="llama"),
    "llama-tied": dict(arch="llama", tie=True),
    "llama3.1-rope": dict(arch="llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(arch="mistral", sliding_window=None),
    "qwen2-qkv-bias": dict(arch="qwen2"),
    "qwen3-qk-norm": dict(arch="qwen3"),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory, tokenizer_dir):
    path = tmp_path_factory.mktemp(request.param)
    kw = dict(VARIANTS[request.param])
    hf = make_hf_model(path, tokenizer_dir, kw.pop("arch"), tie=kw.pop("tie", False), **kw)
    return path, hf


def test_logits_match_transformers(variant):
    path, hf = variant
    llm = LLM(str(path), max_model_len=256, num_kv_blocks=64)
    engine = llm.engine
    ids = [engine.tokenize(p) for p in PROMPTS]
    # One mixed prefill batch through the engine's own runner; logits of every position.
    from specserve.engine.request import Request
    from specserve.engine.scheduler import ScheduledRequest, SchedulerOutput

    sched = SchedulerOutput()
    for i, t in enumerate(ids):
        req = Request(str(i), t, SamplingParams(temperature=0), set(), 256)
        assert engine.kv.allocate_slots(req, len(t), req.num_computed_tokens)
        sched.scheduled.append(ScheduledRequest(req, len(t), [], engine.kv.block_ids(req.request_id), samples=True,
                                                start=0))
    hidden = capture_hidden(engine, sched)
    ours = engine.core.model.compute_logits(hidden)
    offset = 0
    for t in ids:
        with torch.no_grad():
            ref = hf(torch.tensor([t])).logits[0].float()
        got = ours[offset:offset + len(t)]
        offset += len(t)
        rel = (got - ref).norm() / ref.norm()
        assert rel < 1e-4, f"relative logits error {rel:.2e}"


def capture_hidden(engine, sched):
    """Run the runner's forward for a hand-made schedule and return every position's hidden state."""
    captured = {}
    handle = engine.core.model.model.norm.register_forward_hook(lambda m, i, o: captured.setdefault("h", o))
    try:
        engine.runner.execute_model(sched)
    finally:
        handle.remove()
    return captured["h"]


def test_greedy_matches_transformers(variant):
    path, hf = variant
    llm = LLM(str(path), max_model_len=256)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 24)
