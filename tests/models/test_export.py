"""`specserve export`: the default model, a GGUF, written as a Hugging Face directory that transformers loads and
runs as specserve runs the GGUF."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import hf_greedy
from specserve import LLM, SamplingParams
from specserve.entrypoints.cli import main

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}],
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2_hf")
    assert main(["export", "smollm2-135m", str(out), "--dtype", "float32"]) == 0
    return out


@pytest.fixture(scope="module")
def gguf_replies():
    """(prompt ids, greedy token ids) of each chat, from specserve on the GGUF."""
    llm = LLM("smollm2-135m", dtype="float32", device="cpu", max_model_len=512, kv_cache_memory_bytes=2**27)
    prompts = [llm.apply_chat_template(c) for c in CHATS]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


def test_the_directory_is_complete(exported):
    files = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "generation_config.json"} <= files
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "float32" and config["tie_word_embeddings"] is True
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (49152, 1, 2)
    assert json.loads((exported / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    assert "chat_template" in json.loads((exported / "tokenizer_config.json").read_text())


def test_transformers_runs_the_export_as_specserve_runs_the_gguf(exported, gguf_replies):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts, replies = gguf_replies
    tok = AutoTokenizer.from_pretrained(str(exported))
    # The chat template survived: transformers builds the prompts specserve built from the GGUF.
    for chat, ids in zip(CHATS, prompts):
        built = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        assert list(built["input_ids"] if hasattr(built, "keys") else built) == ids
    hf = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    assert hf.config.model_type == "llama"
    for ids, reply in zip(prompts, replies):
        assert hf_greedy(hf, ids, 16) == reply
    assert "Paris" in tok.decode(replies[0])


def test_specserve_runs_the_export_as_the_gguf(exported, gguf_replies):
    prompts, replies = gguf_replies
    llm = LLM(str(exported), device="cpu", max_model_len=512, kv_cache_memory_bytes=2**27)
    assert llm.engine.config.torch_dtype == torch.float32
    assert [llm.apply_chat_template(c) for c in CHATS] == prompts
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == replies
