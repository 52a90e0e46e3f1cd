"""The OpenAI-compatible server end to end, over loopback HTTP with the official openai client:
completions, chat, streaming, speculative decoding, concurrency, disconnects, bad input, metrics."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re

import httpx
import openai
import pytest

from entrypoints.shared_servers import NGRAM, SERVER_ENGINE
from live_server import LiveServer, one_torch_thread
from specserve import LLM, SamplingParams
from specserve.config import EngineConfig
from specserve.entrypoints.cli import main

HAS_SPEC = "speculative_config" in {f.name for f in dataclasses.fields(EngineConfig)}
needs_spec = pytest.mark.skipif(not HAS_SPEC, reason="speculative decoding is not in EngineConfig yet (no speculative_config field)")
# Repetitive prompts give the n-gram proposer matches to draft from.
PROMPTS = ["the cat sat on the mat, the cat sat on the mat, the cat",
           "Speculative decoding drafts tokens. Speculative decoding drafts",
           "0 1 2 3 0 1 2 3 0 1 2 3 0 1"]
GREEDY = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    with one_torch_thread():
        yield


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def completion_texts(server: LiveServer, prompts: list[str], stream: bool) -> list[tuple[str, int]]:
    """(text, completion tokens) per prompt; streamed chunks are joined."""
    c, out = client(server), []
    for prompt in prompts:
        if not stream:
            r = c.completions.create(model=server.model, prompt=prompt, **GREEDY)
            out.append((r.choices[0].text, r.usage.completion_tokens))
            continue
        chunks = list(c.completions.create(model=server.model, prompt=prompt, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY))
        assert chunks[-1].choices == [] and chunks[-2].choices[0].finish_reason == "length"
        out.append(("".join(ch.choices[0].text for ch in chunks[:-1]), chunks[-1].usage.completion_tokens))
    return out


def chat_texts(server: LiveServer, prompts: list[str], stream: bool) -> list[str]:
    c, out = client(server), []
    for prompt in prompts:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
        if not stream:
            out.append(c.chat.completions.create(model=server.model, messages=messages, **GREEDY)
                       .choices[0].message.content)
            continue
        chunks = list(c.chat.completions.create(model=server.model, messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY))
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == GREEDY["max_tokens"]
        out.append("".join(ch.choices[0].delta.content or "" for ch in chunks[:-1]))
    return out


def test_models_health_and_usage(plain_server):
    assert httpx.get(plain_server.url + "/health").status_code == 200
    assert [m.id for m in client(plain_server).models.list().data] == [plain_server.model]
    r = client(plain_server).completions.create(model=plain_server.model, prompt=PROMPTS[0], **GREEDY)
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24


def test_streamed_equals_non_streamed(plain_server):
    assert (completion_texts(plain_server, PROMPTS, stream=True)
            == completion_texts(plain_server, PROMPTS, stream=False))
    assert chat_texts(plain_server, PROMPTS, stream=True) == chat_texts(plain_server, PROMPTS, stream=False)


def test_a_stream_interval_streams_the_same_text(plain_server, tiny_llama):
    """An interval that does not divide max_tokens: chunks are handed over once they hold `interval` tokens,
    and the last one, shorter, when its sequence ends (engine/request_stream.py)."""
    interval = 5
    reference = completion_texts(plain_server, PROMPTS, stream=False)
    chat_reference = chat_texts(plain_server, PROMPTS, stream=False)
    with LiveServer(str(tiny_llama[0]), stream_interval=interval, **SERVER_ENGINE) as server:
        assert completion_texts(server, PROMPTS, stream=True) == reference
        assert chat_texts(server, PROMPTS, stream=True) == chat_reference
        chunks = list(client(server).completions.create(model=server.model, prompt=PROMPTS[0], stream=True,
                                                        **GREEDY))
    # One chunk for the first token, then at most one per `interval` tokens until the last.
    assert len(chunks) <= 2 + GREEDY["max_tokens"] // interval


@needs_spec
def test_speculative_streams_equal_plain_output(plain_server, ngram_server):
    reference = completion_texts(plain_server, PROMPTS, stream=False)
    assert completion_texts(ngram_server, PROMPTS, stream=False) == reference
    assert completion_texts(ngram_server, PROMPTS, stream=True) == reference
    assert chat_texts(ngram_server, PROMPTS, stream=True) == chat_texts(plain_server, PROMPTS, stream=False)


def test_logprobs(plain_server):
    c = client(plain_server)
    r = c.completions.create(model=plain_server.model, prompt=PROMPTS[0], logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 24
    # At temperature 0 the sampled token is the most likely one.
    assert all(tlp >= max(top.values()) for tlp, top in zip(lp.token_logprobs, lp.top_logprobs))
    r = c.chat.completions.create(model=plain_server.model, messages=[{"role": "user", "content": "hi"}],
                                  logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 24 and all(len(t.top_logprobs) == 3 for t in content)
    assert all((t.token, t.logprob) == (t.top_logprobs[0].token, t.top_logprobs[0].logprob) for t in content)


def test_64_concurrent_streams(plain_server):
    prompts = [f"Request number {i}: the quick brown fox" for i in range(64)]
    params = dict(model=plain_server.model, temperature=0, max_tokens=16)

    async def run() -> tuple[list[str], list[str]]:
        c = openai.AsyncOpenAI(base_url=plain_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        async def whole(p: str) -> str:
            return (await c.completions.create(prompt=p, **params)).choices[0].text

        async def streamed(p: str) -> str:
            return "".join([ch.choices[0].text async for ch in await c.completions.create(prompt=p, stream=True,
                                                                                         **params)])

        ref = await asyncio.gather(*map(whole, prompts))
        got = await asyncio.gather(*map(streamed, prompts))
        await c.close()
        return ref, got

    ref, got = asyncio.run(run())
    assert got == ref and len(set(ref)) > 1
    plain_server.wait_idle()


def test_disconnect_aborts_and_frees_blocks(plain_server):
    before = plain_server.metrics().get("specserve:requests_total{finish_reason=abort}", 0)
    body = {"model": plain_server.model, "prompt": PROMPTS[1], "max_tokens": 480, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=plain_server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 4:
                    break  # leaving the block closes the connection mid-stream
        generated = plain_server.wait_idle()["specserve:generation_tokens_total"]
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=0.3)
    m = plain_server.wait_idle()
    assert m["specserve:requests_total{finish_reason=abort}"] == before + 2
    # The non-streamed request's caller left before any output: its tokens still count.
    assert m["specserve:generation_tokens_total"] > generated


BAD_INPUT = [
    # (endpoint, body (dict, or raw text), status, param, words in the message)
    ("completions", {"temperature": -1}, 400, "temperature", ["[0, 100]"]),
    ("completions", {"temperature": "hot"}, 400, "temperature", ["number"]),
    ("completions", '{"model": "MODEL", "prompt": "a", "temperature": NaN}', 400, "temperature", []),
    ("completions", {"top_p": 0}, 400, "top_p", []),
    ("completions", {"max_tokens": 0}, 400, "max_tokens", [">= 1"]),
    ("completions", {"logprobs": 21}, 400, "logprobs", []),
    ("completions", {"stop": [""]}, 400, "stop", []),
    ("completions", {"seed": 2**70}, 400, "seed", []),
    ("completions", {"top_k": 2**40}, 400, "top_k", []),
    ("completions", {"n": 0}, 400, "n", ["[1, 128]"]),
    ("completions", {"n": 129}, 400, "n", ["[1, 128]"]),
    ("completions", {"prompt": ""}, 400, "prompt", ["empty"]),
    ("completions", {"prompt": [10**9]}, 400, "prompt", ["vocabulary"]),
    ("completions", {"prompt": None}, 400, "prompt", []),
    ("completions", {"prompt": [7] * 600}, 400, "prompt", ["600 tokens", "512 tokens"]),
    ("chat", {"messages": [{"role": "user", "content": "ab " * 600}]}, 400, "messages", ["tokens long", "512 tokens"]),
    ("chat", {"messages": []}, 400, "messages", []),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content[0]",
     ["text parts"]),
    ("chat", {"top_logprobs": 2}, 400, "top_logprobs", ["logprobs"]),
    ("chat", {"max_completion_tokens": 0}, 400, "max_completion_tokens", []),
    ("chat", {"n": 1000}, 400, "n", ["[1, 128]"]),
    ("chat", {"logit_bias": {"10000": 5}}, 400, "logit_bias", ["key 10000", "vocabulary size"]),
    ("completions", {"logit_bias": {"7": 101}}, 400, "logit_bias", ["token 7", "[-100, 100]"]),
    ("completions", {"logit_bias": {"7": "high"}}, 400, "logit_bias", ["token 7"]),
    ("chat", {"logit_bias": {"abc": 1}}, 400, "logit_bias", ["key 'abc'"]),
    ("chat", {"logit_bias": {"-3": 1}}, 400, "logit_bias", ["key '-3'"]),
    ("completions", '{"model": "MODEL", "prompt": ', 400, None, ["JSON"]),
    ("completions", "[1, 2]", 400, None, []),
    ("completions", {"model": "gpt-4"}, 404, "model", ["gpt-4"]),
    ("embeddings", {}, 404, None, ["/v1/embeddings"]),
]


@pytest.mark.parametrize("endpoint, body, status, param, words", BAD_INPUT,
                         ids=[f"{e}-{i}" for i, (e, *_rest) in enumerate(BAD_INPUT)])
def test_bad_input_is_refused_and_server_survives(plain_server, endpoint, body, status, param, words):
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}.get(endpoint, f"/v1/{endpoint}")
    if isinstance(body, dict):
        base = {"model": plain_server.model, "max_tokens": 4}
        base.update({"prompt": PROMPTS[0]} if endpoint == "completions" else
                    {"messages": [{"role": "user", "content": "hi"}]})
        content = json.dumps({**base, **body})
    else:
        content = body.replace("MODEL", plain_server.model)
    r = httpx.post(plain_server.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert all(w in error["message"] for w in words), error["message"]
    ok = client(plain_server).completions.create(model=plain_server.model, prompt="ok", max_tokens=2)
    assert ok.choices[0].finish_reason


def test_wrong_method_is_an_openai_error(plain_server):
    r = httpx.get(plain_server.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


@needs_spec
def test_metrics_match_engine(ngram_server, tiny_llama):
    # The prompts once before, so that the measured pass finds their blocks in the prefix cache whichever tests
    # this server answered before.
    completion_texts(ngram_server, PROMPTS, stream=True)
    before = ngram_server.wait_idle()
    completion_texts(ngram_server, PROMPTS, stream=True)
    m = ngram_server.wait_idle()
    # The same requests in an offline engine of the same configuration draft and accept the same tokens.
    offline = LLM(str(tiny_llama[0]), speculative_config=NGRAM, **SERVER_ENGINE)
    offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    stats = offline.engine.spec_stats
    assert stats.num_accepted > 0
    for name, value in (("accepted", stats.num_accepted), ("drafted", stats.num_drafted)):
        key = f"specserve:spec_decode_num_{name}_tokens_total"
        assert m[key] - before[key] == value
    per_pos = [m[f"specserve:spec_decode_acceptance_per_position{{position={i}}}"] for i in range(3)]
    assert all(0 < p <= 1 for p in per_pos) and per_pos == sorted(per_pos, reverse=True)
    ended = sum(v for k, v in m.items() if k.startswith("specserve:requests_total"))
    assert m["specserve:requests_total{finish_reason=length}"] >= len(PROMPTS)
    assert m["specserve:generation_tokens_total"] >= 24 * len(PROMPTS)
    assert m["specserve:time_to_first_token_seconds_count"] == m["specserve:e2e_request_latency_seconds_count"] == ended
    assert 0 < m["specserve:time_per_output_token_seconds_count"] <= ended
    assert 0 < m["specserve:prefix_cache_hit_rate"] <= 1


@needs_spec
def test_bench_serve_cli(ngram_server, tmp_path, capsys):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps({"turns": [p, "second turn"]}) for p in PROMPTS) + "\n")
    common = ["bench", "serve", "--base-url", ngram_server.url, "--dataset", str(dataset), "--max-tokens", "12"]
    assert main(common + ["--num-prompts", "6", "--concurrency", "3"]) == 0
    assert main(common + ["--num-prompts", "4", "--request-rate", "50", "--endpoint", "completions"]) == 0
    # The streams shared among client processes: every request is counted once, each process's load adds up.
    assert main(common + ["--num-prompts", "5", "--concurrency", "4", "--client-processes", "2"]) == 0
    reports = capsys.readouterr().out.split("Serving Benchmark Result")[1:]
    assert len(reports) == 3
    for report, n in zip(reports, (6, 4, 5)):
        assert re.search(rf"Successful requests: +{n}\n", report) and re.search(r"Failed requests: +0\n", report)
        for row in ("Output token throughput", "P50 TTFT", "P99 TTFT", "P90 TPOT", "P99 E2EL", "Acceptance rate"):
            assert re.search(rf"{re.escape(row)} \((ms|tok/s|%)\): +\d+\.\d\d\n", report), row


def test_bench_serve_shares_streams_and_prompts_among_processes():
    from specserve.entrypoints.openai.bench_serve import BenchConfig, _shares

    cfg = BenchConfig("http://x", concurrency=5, request_rate=30.0)
    prompts = [f"p{i}" for i in range(11)]
    assert cfg.num_processes(len(prompts)) == 1  # 5 streams: one process carries them
    shares = _shares(cfg, prompts, 2)
    assert [s.concurrency for s, _ in shares] == [3, 2]
    assert [s.request_rate for s, _ in shares] == [15.0, 15.0]
    assert sorted(p for _, ps in shares for p in ps) == sorted(prompts)
    assert BenchConfig("http://x", concurrency=64).num_processes(1000) == min(4, os.cpu_count())
    assert BenchConfig("http://x", concurrency=64, client_processes=8).num_processes(3) == 3
    with pytest.raises(ValueError, match="client_processes"):
        BenchConfig("http://x", client_processes=0)
