"""/tokenize and /detokenize (vLLM's): a prompt's and a chat's token ids are the ones the generation endpoints run
(their usage counts them), the text of ids is the tokenizer's own decoding, and bad input is a 400 naming it."""
from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from test_openai_server import _one_torch_thread, client  # noqa: F401 (the autouse fixture)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def test_tokenize_counts_what_generation_runs(plain_server):
    prompt = "the cat sat on the mat"
    r = post(plain_server, "/tokenize", {"model": plain_server.model, "prompt": prompt, "return_token_strs": True})
    assert r.status_code == 200, r.text
    tokenized = r.json()
    done = client(plain_server).completions.create(model=plain_server.model, prompt=prompt, max_tokens=1)
    assert tokenized["count"] == len(tokenized["tokens"]) == done.usage.prompt_tokens
    assert tokenized["max_model_len"] == 512 and len(tokenized["token_strs"]) == tokenized["count"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    chat = post(plain_server, "/tokenize", {"messages": messages}).json()
    reply = client(plain_server).chat.completions.create(model=plain_server.model, messages=messages, max_tokens=1)
    assert chat["count"] == reply.usage.prompt_tokens and chat["token_strs"] is None
    open_ended = post(plain_server, "/tokenize", {"messages": messages + [{"role": "assistant", "content": "On"}],
                                                  "add_generation_prompt": False, "continue_final_message": True})
    assert open_ended.json()["count"] > chat["count"]


def test_detokenize_is_the_tokenizers_decoding(plain_server, tiny_llama):
    tok = AutoTokenizer.from_pretrained(str(tiny_llama[0]))
    ids = post(plain_server, "/tokenize", {"prompt": "Héllo wörld, 中文 🚀"}).json()["tokens"]
    r = post(plain_server, "/detokenize", {"model": plain_server.model, "tokens": ids})
    assert r.status_code == 200 and r.json()["prompt"] == tok.decode(ids)


@pytest.mark.parametrize("path, body, param, words", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, None, ["not both"]),
    ("/tokenize", {}, None, ["not neither"]),
    ("/tokenize", {"prompt": ""}, "prompt", ["empty"]),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model", ["gpt-4"]),
    ("/tokenize", {"prompt": "a", "add_special_tokens": False}, "add_special_tokens", ["not a parameter"]),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True},
     "continue_final_message", ["set add_generation_prompt to false"]),
    ("/detokenize", {"tokens": [5, 10**6]}, "tokens[1]", ["not a token id", "400 tokens"]),
    ("/detokenize", {"tokens": [5, -1]}, "tokens[1]", ["greater than or equal to 0"]),
], ids=["both", "neither", "empty", "model", "unknown-field", "open-and-generation-prompt", "unknown-id", "negative"])
def test_bad_input_is_a_400_naming_it(plain_server, path, body, param, words):
    r = post(plain_server, path, body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and all(w in error["message"] for w in words), error
