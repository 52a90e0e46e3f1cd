"""Production limits of the server: a full waiting queue answers 503, a request past its deadline
is aborted and reported (408 before the response starts, an error event after), the server serves
on afterwards, and shutdown ends open streams properly. One running slot (max_num_seqs=1) makes
"running" and "waiting" exact."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import make_hf_model
from live_server import LiveServer, one_torch_thread

TIMEOUT_S = 5.0
# A long context makes generations that outlast the deadline: thousands of steps.
CONTEXT = 4096


ENGINE = dict(max_model_len=CONTEXT, num_kv_blocks=CONTEXT // 16 + 8, max_num_seqs=1)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def long_model(tmp_path_factory, tokenizer_dir) -> str:
    path = tmp_path_factory.mktemp("long_context_llama")
    make_hf_model(path, tokenizer_dir, "llama", max_position_embeddings=CONTEXT)
    return str(path)


@pytest.fixture(scope="module")
def server(long_model):
    with LiveServer(long_model, max_waiting=2, request_timeout=TIMEOUT_S, **ENGINE) as s:
        yield s


def body(s: LiveServer, max_tokens: int, stream: bool = False) -> dict:
    return {"model": s.model, "prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": stream}


def post(s: LiveServer, payload: dict) -> httpx.Response:
    return httpx.post(s.url + "/v1/completions", json=payload, timeout=30)


def test_full_queue_answers_503_then_recovers(server):
    with ThreadPoolExecutor(2) as pool, httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body(server, CONTEXT - 100, True)) as running:
            lines = running.iter_lines()  # kept: dropping the iterator would close the connection
            next(lines)  # a token is out: the stream holds the only running slot
            queued = [pool.submit(post, server, body(server, 4)) for _ in range(2)]
            server.wait_for(lambda m: m["specserve:num_requests_waiting"] == 2)
            refused = post(server, body(server, 4))
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "queue_full"
        # Closing the stream aborted it, which lets the queued requests run.
        done = [q.result(timeout=30) for q in queued]
    assert all(d.status_code == 200 and d.json()["choices"][0]["finish_reason"] == "length" for d in done)
    server.wait_idle()


def test_sequences_past_the_queue_fail_the_whole_request(server):
    """n = 2 with one place left in the queue: the first sequence is queued, the second refused, and the whole
    request is answered 503 with its queued sequence withdrawn."""
    with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body(server, CONTEXT - 100, True)) as running:
            lines = running.iter_lines()
            next(lines)  # the stream holds the only running slot
            queued = pool.submit(post, server, body(server, 4))
            server.wait_for(lambda m: m["specserve:num_requests_waiting"] == 1)
            refused = post(server, {**body(server, 4), "n": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full", refused.text
            server.wait_for(lambda m: m["specserve:num_requests_waiting"] == 1)
        assert queued.result(timeout=30).status_code == 200
    server.wait_idle()


def test_deadline_aborts_and_reports(server):
    before = server.metrics().get("specserve:requests_total{finish_reason=timeout}", 0)
    with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body(server, CONTEXT - 100, True)) as running:
            lines = running.iter_lines()
            next(lines)
            # This one waits behind the stream, then runs into its own deadline.
            queued = pool.submit(post, server, body(server, CONTEXT - 100))
            rest = [line for line in lines if line]
        waited = queued.result(timeout=30)
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == "request_timeout"
    assert waited.status_code == 408 and waited.json()["error"]["code"] == "request_timeout"
    m = server.wait_idle()
    assert m["specserve:requests_total{finish_reason=timeout}"] == before + 2
    assert post(server, body(server, 4)).status_code == 200


def test_shutdown_ends_open_streams_with_an_error_event(long_model):
    live = LiveServer(long_model, shutdown_grace_s=0.5, **ENGINE).__enter__()
    with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=30) as http:
        with http.stream("POST", live.url + "/v1/completions", json=body(live, CONTEXT - 100, True)) as running:
            lines = running.iter_lines()
            next(lines)
            start = time.monotonic()
            stopped = pool.submit(live.__exit__, None, None, None)
            rest = [line for line in lines if line]
        stopped.result(timeout=30)
    # The stream outlives the grace period, so it is aborted rather than cut off.
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == "engine_unavailable"
    assert time.monotonic() - start < 10
    # The core was told to stop (aborting what it held) and exited on its own.
    assert live.engine.num_active_requests == 0 and live.engine.core_exit_codes == [0]
