"""Data parallelism: two engine replicas behind one server. Every output is the one-replica engine's, new
requests go to the less loaded replica, an abort reaches the replica that holds the request, a replica that
dies fails its own requests and takes the server down, and /metrics reports each replica and their sum."""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal

import httpx
import openai
import pytest
import torch

from core_factories import FixedTimeCore
from live_server import LiveServer, one_torch_thread
from specserve import LLM, SamplingParams
from specserve.config import EngineConfig
from specserve.engine.async_llm import AsyncLLM
from specserve.engine.data_parallel import replica_gpus, visible_to_child
from specserve.engine.messages import EngineStats
from specserve.entrypoints.cli import main
from specserve.errors import ConfigError, EngineUnavailableError

ENGINE = dict(max_model_len=512, num_kv_blocks=256, max_num_seqs=64)
PROMPTS = [f"Request {i}: the quick brown fox jumps over" for i in range(32)]
MAX_TOKENS = 16
ENGINE_METRICS = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate",
                  "prompt_tokens_total", "generation_tokens_total", "spec_decode_num_drafted_tokens_total",
                  "spec_decode_num_accepted_tokens_total"]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def dp2(tiny_llama):
    # Steps of a fixed length, so that a long request is still running while the test looks at the other.
    with LiveServer(str(tiny_llama[0]), data_parallel_size=2, core_factory=FixedTimeCore, **ENGINE) as server:
        yield server


@pytest.fixture(scope="module")
def reference(tiny_llama) -> dict[str, str]:
    """Each prompt's greedy text from one engine (one replica) of the same configuration."""
    llm = LLM(str(tiny_llama[0]), **ENGINE)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}


def replica_running(m: dict[str, float]) -> list[float]:
    return [m[f"specserve:replica_num_requests_running{{replica={i}}}"] for i in range(2)]


def test_concurrent_requests_equal_one_replica_and_both_replicas_serve(dp2, reference):
    before = dp2.wait_idle()
    params = dict(model=dp2.model, temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})

    async def run() -> tuple[list[str], list[str]]:
        c = openai.AsyncOpenAI(base_url=dp2.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        async def whole(p: str) -> str:
            return (await c.completions.create(prompt=p, **params)).choices[0].text

        async def streamed(p: str) -> str:
            chunks = await c.completions.create(prompt=p, stream=True, **params)
            return "".join([ch.choices[0].text async for ch in chunks])

        results = await asyncio.gather(*map(whole, PROMPTS), *map(streamed, PROMPTS))
        await c.close()
        return results[:len(PROMPTS)], results[len(PROMPTS):]

    whole, streamed = asyncio.run(run())
    expected = [reference[p] for p in PROMPTS]
    assert whole == expected and streamed == expected and len(set(expected)) > 1
    m = dp2.wait_idle()
    generated = [m[f"specserve:replica_generation_tokens_total{{replica={i}}}"]
                 - before[f"specserve:replica_generation_tokens_total{{replica={i}}}"] for i in range(2)]
    assert sum(generated) == 2 * len(PROMPTS) * MAX_TOKENS
    assert m["specserve:generation_tokens_total"] - before["specserve:generation_tokens_total"] == sum(generated)
    # Each new request went to the replica with fewer requests: the work is shared, not piled on one.
    assert min(generated) >= sum(generated) / 4, generated
    # /metrics: every engine metric for each replica, and the server's total is their sum.
    for name in ENGINE_METRICS:
        per_replica = [m[f"specserve:replica_{name}{{replica={i}}}"] for i in range(2)]
        if name.endswith("_total") or name.startswith("num_"):
            assert m[f"specserve:{name}"] == sum(per_replica), name
    assert all(m[f"specserve:replica_prompt_tokens_total{{replica={i}}}"] > 0 for i in range(2))


def test_an_abort_reaches_the_replica_that_holds_the_request(dp2):
    dp2.wait_idle()
    aborts = dp2.metrics().get("specserve:requests_total{finish_reason=abort}", 0)
    body = {"model": dp2.model, "prompt": PROMPTS[0], "max_tokens": 480, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.Client(base_url=dp2.url, timeout=30) as first, httpx.Client(base_url=dp2.url, timeout=30) as second:
        with first.stream("POST", "/v1/completions", json=body) as a:
            a_lines = a.iter_lines()  # kept: dropping the iterator would close the stream
            next(a_lines)
            m = dp2.wait_for(lambda m: sorted(replica_running(m)) == [0, 1])
            holder = replica_running(m).index(1)
            with second.stream("POST", "/v1/completions", json=body) as b:
                b_lines = b.iter_lines()
                next(b_lines)
                # The idle replica took it.
                dp2.wait_for(lambda m: replica_running(m) == [1, 1])
            # Leaving the block closed the second stream: its replica frees the request while the first, which
            # started earlier and runs as long, is still running on the other.
            other = 1 - holder
            m = dp2.wait_for(lambda m: m[f"specserve:replica_num_requests_running{{replica={other}}}"] == 0
                             and m[f"specserve:replica_kv_cache_usage_perc{{replica={other}}}"] == 0)
            assert m[f"specserve:replica_num_requests_running{{replica={holder}}}"] == 1
    m = dp2.wait_idle()
    assert m["specserve:requests_total{finish_reason=abort}"] == aborts + 2


def test_a_dead_replica_fails_its_requests_and_the_server_exits(tiny_llama):
    live = LiveServer(str(tiny_llama[0]), data_parallel_size=2, core_factory=FixedTimeCore, shutdown_grace_s=30,
                      **ENGINE).__enter__()
    body = {"model": live.model, "prompt": PROMPTS[0], "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=live.url, timeout=30) as http, httpx.Client(base_url=live.url, timeout=30) as other:
        with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 480}) as doomed:
            doomed_lines = doomed.iter_lines()
            next(doomed_lines)
            victim = replica_running(live.wait_for(lambda m: sorted(replica_running(m)) == [0, 1])).index(1)
            with other.stream("POST", "/v1/completions", json={**body, "max_tokens": 200}) as survivor:
                survivor_lines = survivor.iter_lines()
                next(survivor_lines)
                live.wait_for(lambda m: replica_running(m) == [1, 1])
                os.kill(live.engine.core_pids[victim], signal.SIGKILL)
                rest = [line for line in doomed_lines if line]
                assert rest[-1] == "data: [DONE]"
                assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == "engine_unavailable"
                # New requests are refused while the server drains.
                refused = http.post("/v1/completions", json={"model": live.model, "prompt": "hi", "max_tokens": 4})
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
                # The other replica's request runs to its end within the shutdown's grace period.
                events = [json.loads(line.removeprefix("data: ")) for line in survivor_lines
                          if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 200
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    # The server shuts itself down, so a supervisor can start it again.
    live._thread.join(timeout=60)
    assert not live._thread.is_alive() and live.engine.is_dead
    with pytest.raises(httpx.TransportError):
        httpx.post(live.url + "/v1/completions", json={**body, "max_tokens": 4}, timeout=5)


def test_a_replica_that_cannot_start_fails_the_start_and_leaves_no_process(tiny_llama):
    # Too few KV blocks for max_model_len: the configuration passes here and each core refuses it on loading.
    engine = AsyncLLM(EngineConfig(model=str(tiny_llama[0]), max_model_len=512, num_kv_blocks=4, data_parallel_size=2))
    with pytest.raises(EngineUnavailableError, match=r"engine core \d \(of 2\) could not start: .*num_kv_blocks"):
        asyncio.run(engine.start())
    for replica in engine.replicas:
        replica.process.join(10)
        assert replica.process.exitcode is not None


def test_offline_llm_refuses_data_parallelism(tiny_llama, capsys):
    with pytest.raises(ConfigError, match="data_parallel_size.*--data-parallel-size 2"):
        LLM(str(tiny_llama[0]), data_parallel_size=2, **ENGINE)
    assert main(["generate", "hi", "--model", str(tiny_llama[0]), "--data-parallel-size", "2"]) == 2
    assert "specserve serve --data-parallel-size 2" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="data_parallel_size"):
        EngineConfig(model=str(tiny_llama[0]), data_parallel_size=0)


@pytest.fixture
def two_gpus(monkeypatch):
    """Two GPUs as torch counts them, for the configuration's checks (nothing runs on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_more_replicas_than_gpus_is_an_error_naming_the_fix(two_gpus, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ConfigError, match="need 3 GPUs, but 2 are visible; lower --data-parallel-size to 2"):
        EngineConfig(device="cuda", data_parallel_size=3)
    with pytest.raises(ConfigError, match="device.*'cuda:1'.*CUDA_VISIBLE_DEVICES"):
        EngineConfig(device="cuda:1", data_parallel_size=2)
    assert EngineConfig(device="cuda", data_parallel_size=2).data_parallel_size == 2


def test_each_replica_sees_its_own_gpus(two_gpus, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7,9")  # torch keeps two of them
    assert [replica_gpus(i, 1) for i in range(3)] == [["5"], ["7"], []]
    assert replica_gpus(0, 2) == ["5", "7"]
    # A spawned process takes the variable as it was while the process started; this one is left as it was.
    out = tmp_path / "visible"
    child = multiprocessing.get_context("spawn").Process(target=os.system,
                                                         args=(f"echo $CUDA_VISIBLE_DEVICES > {out}",))
    with visible_to_child(replica_gpus(1, 1)):
        child.start()
    child.join()
    assert out.read_text().strip() == "7" and os.environ["CUDA_VISIBLE_DEVICES"] == "5,7,9"


def test_engine_stats_of_replicas_sum_to_the_servers():
    a = EngineStats(num_running=2, num_kv_blocks_used=10, num_kv_blocks=100, prefix_cache_queried_tokens=40,
                    prefix_cache_hit_tokens=30, spec_drafted_per_position=(4, 4), spec_accepted_per_position=(3, 1))
    b = EngineStats(num_running=1, num_kv_blocks_used=50, num_kv_blocks=100, prefix_cache_queried_tokens=60,
                    prefix_cache_hit_tokens=0, spec_drafted_per_position=(6, 6, 6),
                    spec_accepted_per_position=(3, 3, 0))
    total = EngineStats.total([a, b])
    assert total.num_running == 3 and total.kv_cache_usage == 0.3 and total.prefix_cache_hit_rate == 0.3
    assert total.spec_acceptance_per_position == [0.6, 0.4, 0.0]
    assert EngineStats.total([]) == EngineStats()
