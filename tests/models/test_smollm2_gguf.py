"""The real default model, SmolLM2-135M-Instruct from its GGUF, against transformers' own GGUF loader."""
from __future__ import annotations

import functools

import pytest
import torch

from conftest import hf_greedy
from specserve import LLM, SamplingParams
from specserve.models.loader import resolve_model_path

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three uses of a paperclip."}],
]


@pytest.fixture(scope="module")
def smollm2():
    return LLM("smollm2-135m", max_model_len=1024, dtype="float32", device="cpu")


def test_first_32_greedy_tokens_equal_transformers(smollm2, monkeypatch):
    pytest.importorskip("accelerate")  # transformers needs it to read GGUF files
    import gguf
    from transformers import AutoModelForCausalLM

    # transformers parses the file once for the config and again for the weights, and builds the same tensor
    # name map once per tensor: one of each serves it all (both are read only), in a fraction of the time.
    monkeypatch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))

    path = resolve_model_path("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    outs = smollm2.chat(CHATS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 32)
    assert "Paris" in outs[0].outputs[0].text


def test_eos_ends_the_reply(smollm2):
    out = smollm2.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] in smollm2.engine.core.eos_token_ids
    assert "<|im_end|>" not in out.outputs[0].text
