"""Structured output through the server, with the official openai client: response_format (json_object,
json_schema) on chat completions and vLLM's structured_outputs on both endpoints, without speculation, with
n-gram drafts, and with an EAGLE-3 head drafting chains and trees (its logits masked by the grammar)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from entrypoints.live_server import LiveServer, one_torch_thread
from heads import save_eagle_head
from schemas import SCHEMAS

ENGINE = dict(max_model_len=512, num_kv_blocks=128, max_num_seqs=16)
TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"
MESSAGES = [{"role": "user", "content": "Give me JSON"}]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def eagle3_head(tiny_llama, tmp_path_factory) -> str:
    return str(save_eagle_head(tmp_path_factory.mktemp("openai_structured") / "eagle3", tiny_llama[1].config,
                               "eagle3", seed=2))


@pytest.fixture(scope="module", params=["plain", "ngram", "eagle3", "eagle3_tree"])
def client(request, tiny_llama, eagle3_head):
    """Without speculation and with n-gram drafts, the servers the modules share; with EAGLE-3, this module's."""
    if request.param in ("plain", "ngram"):
        server = request.getfixturevalue(f"{request.param}_server")
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120), server.model
        return
    spec = {"eagle3": {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3},
            "eagle3_tree": {"method": "eagle3", "model": eagle3_head, "speculative_token_tree": TREE}}[request.param]
    with LiveServer(str(tiny_llama[0]), speculative_config=spec, **ENGINE) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120), server.model


def test_response_format_json_schema(client):
    """All twenty schemas at once (one batch), greedy and sampled."""
    c, model = client

    def ask(i: int):
        schema = SCHEMAS[i % len(SCHEMAS)]
        r = c.chat.completions.create(model=model, messages=MESSAGES, temperature=0 if i < len(SCHEMAS) else 1.0,
                                      seed=i, max_tokens=64,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "answer", "schema": schema,
                                                                       "strict": True}})
        return r, schema

    with ThreadPoolExecutor(8) as pool:
        for r, schema in pool.map(ask, range(2 * len(SCHEMAS))):
            assert r.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_response_format_json_object_streamed(client):
    c, model = client
    chunks = c.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=64, stream=True,
                                       response_format={"type": "json_object"})
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert isinstance(json.loads(text), dict)


def test_structured_outputs_on_both_endpoints(client):
    c, model = client
    r = c.completions.create(model=model, prompt="Pick one:", max_tokens=16, temperature=1.0, seed=3,
                             extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].text in ("red", "green", "blue")
    r = c.completions.create(model=model, prompt="Code:", max_tokens=16, temperature=0,
                             extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert len(r.choices[0].text) == 6 and r.choices[0].text[2] == "-"
    r = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0,
                                  extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
    assert r.choices[0].message.content in ("yes", "no")
    r = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=64, temperature=0,
                                  extra_body={"structured_outputs": {"json": SCHEMAS[2]}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[2])
