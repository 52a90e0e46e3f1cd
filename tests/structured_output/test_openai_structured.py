"""Structured output through the server, with the official openai client: response_format (json_object,
json_schema) on chat completions and vLLM's structured_outputs on both endpoints, with and without n-gram
speculation."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from entrypoints.live_server import LiveServer, one_torch_thread
from schemas import SCHEMAS

ENGINE = dict(max_model_len=512, num_kv_blocks=128, max_num_seqs=16)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
MESSAGES = [{"role": "user", "content": "Give me JSON"}]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module", params=[None, NGRAM], ids=["plain", "ngram"])
def client(request, tiny_llama):
    with LiveServer(str(tiny_llama[0]), speculative_config=request.param, **ENGINE) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60), server.model


def test_response_format_json_schema(client):
    c, model = client
    for schema in SCHEMAS[:6]:
        r = c.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=64,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "answer", "schema": schema,
                                                                       "strict": True}})
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
