"""Who may reach the server and for how long: --api-key on every route but /health, the API's description
off unless asked for, and clients that do not send their request whole in time disconnected."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from core_factories import FixedTimeCore
from live_server import LiveServer, connect, one_torch_thread, read_until_closed
from specserve.config import EngineConfig
from specserve.entrypoints.cli import build_parser
from specserve.entrypoints.openai.api_server import ServerConfig, build_app, build_engine

KEY = "sk-test-0123456789"
TIMEOUT_S = 1.0
ENGINE = dict(max_model_len=512, num_kv_blocks=128, max_num_seqs=16)
ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/metrics"),
          ("POST", "/tokenize"), ("POST", "/detokenize"),
          ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"), ("GET", "/no/such/route")]


@pytest.fixture(scope="module")
def server(tiny_llama):
    # Steps of a fixed length, so that a stream outlasts the receive timeout.
    with one_torch_thread(), LiveServer(str(tiny_llama[0]), api_key=KEY, receive_timeout_s=TIMEOUT_S,
                                        core_factory=FixedTimeCore, **ENGINE) as s:
        yield s


def client(server: LiveServer, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=30)


@pytest.mark.parametrize("method, path", ROUTES)
def test_every_route_but_health_needs_the_key(server, method, path):
    assert httpx.get(server.url + "/health").status_code == 200
    for headers, words in (({}, "needs an API key"), ({"Authorization": "Bearer wrong"}, "not valid"),
                           ({"Authorization": f"Basic {KEY}"}, "not valid"), ({"Authorization": KEY}, "not valid")):
        r = httpx.request(method, server.url + path, headers=headers, json={})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        error = r.json()["error"]
        assert (error["code"], error["type"]) == ("invalid_api_key", "invalid_request_error")
        assert words in error["message"] and "Authorization: Bearer" in error["message"]


def test_the_key_opens_the_api(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [server.model]
    assert c.completions.create(model=server.model, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    reply = c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.usage.completion_tokens == 2
    assert "specserve:requests_total" in httpx.get(server.url + "/metrics", headers=server.auth).text
    # The API's description is off by default, key or not.
    assert httpx.get(server.url + "/openapi.json", headers=server.auth).status_code == 404
    with pytest.raises(openai.AuthenticationError):
        client(server, "sk-wrong").models.list()


def test_requests_are_refused_unread(server):
    """Without the key, or with a body over the limit, a request is answered before its body is sent."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n"
    for headers, answer in ((b"", b"HTTP/1.1 401 "), (f"Authorization: Bearer {KEY}\r\n".encode(), b"HTTP/1.1 413 ")):
        with connect(server) as sock:
            sock.sendall(head + headers + b"\r\n{")
            assert read_until_closed(sock).startswith(answer)


def test_docs_only_when_enabled(tiny_llama):
    engine = build_engine(EngineConfig(model=str(tiny_llama[0]), **ENGINE), ServerConfig())
    for enabled, status in ((False, 404), (True, 200)):
        with_docs = TestClient(build_app(engine, ServerConfig(enable_docs=enabled)))  # no lifespan: no engine core
        assert [with_docs.get(p).status_code for p in ("/docs", "/redoc", "/openapi.json")] == [status] * 3


def test_server_config_and_flags():
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(api_key="")
    with pytest.raises(ValueError, match="receive_timeout_s"):
        ServerConfig(receive_timeout_s=0)
    assert KEY not in repr(ServerConfig(api_key=KEY))


def test_the_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPECSERVE_API_KEY", KEY)
    assert build_parser().parse_args(["serve", "m"]).api_key == KEY
    assert build_parser().parse_args(["serve", "m", "--api-key", "other"]).api_key == "other"
    monkeypatch.delenv("SPECSERVE_API_KEY")
    assert build_parser().parse_args(["serve", "m"]).api_key is None


def test_slow_clients_are_cut_off_while_others_are_served(server):
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    half_headers = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Le"
    half_body = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth +
                 b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
    sent = [half_headers] * 20 + [half_body] * 20 + [b""]
    ended: list[tuple[bytes, float]] = []

    def slow(data: bytes) -> None:
        with connect(server) as sock:
            sock.sendall(data)
            start = time.monotonic()
            answer = read_until_closed(sock)
            ended.append((answer, time.monotonic() - start))

    threads = [threading.Thread(target=slow, args=(data,)) for data in sent]
    for t in threads:
        t.start()
    # Meanwhile a stream that lasts longer than the receive timeout runs to its end: only receiving is timed.
    start = time.monotonic()
    chunks = list(client(server).completions.create(model=server.model, prompt="hello", max_tokens=300, stream=True,
                                                    extra_body={"ignore_eos": True}))
    assert time.monotonic() - start > TIMEOUT_S and chunks[-1].choices[0].finish_reason == "length"
    for t in threads:
        t.join(timeout=30)
    assert len(ended) == len(sent)
    assert all(TIMEOUT_S * 0.9 < seconds < TIMEOUT_S + 3 for _, seconds in ended), ended
    # A client still sending headers is told why; one sending a body is cut off (the app sees it leave).
    assert sum(a.startswith(b"HTTP/1.1 408 ") and b"--receive-timeout" in a for a, _ in ended) == 21
    assert sum(a == b"" for a, _ in ended) == 20
    server.wait_idle()


def test_the_deadline_starts_again_after_each_answer(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        time.sleep(TIMEOUT_S / 2)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # the next request, left unfinished
        start = time.monotonic()
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 ") and time.monotonic() - start < TIMEOUT_S + 3
