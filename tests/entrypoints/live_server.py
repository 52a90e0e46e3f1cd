"""A real uvicorn server on a free loopback port, in a thread of the test process, its engine core in
a process of its own, as `specserve serve` runs them; tests talk HTTP to it and read its /metrics."""
from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from specserve.config import EngineConfig
from specserve.entrypoints.openai.api_server import GracefulServer, ServerConfig, build_app, build_engine, uvicorn_config
from specserve.entrypoints.openai.tool_calling import ToolCallingConfig


@contextlib.contextmanager
def one_torch_thread():
    """Server, engine core and clients share two cores: a second intra-op thread per forward only
    makes the tiny model's steps wait on each other (several times slower). The core's process
    takes its thread count from OMP_NUM_THREADS when it starts."""
    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        torch.set_num_threads(before)
        if env is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = env


class LiveServer:
    def __init__(self, model: str, max_waiting: int = 512, request_timeout: float | None = None,
                 shutdown_grace_s: float = 1.0, stream_interval: int = 1, max_request_bytes: int = 8 * 2**20,
                 receive_timeout_s: float = 30.0, api_key: str | None = None, enable_docs: bool = False,
                 chat_template: str | None = None, tool_calling: ToolCallingConfig = ToolCallingConfig(),
                 core_factory=None, **engine):
        self.model = model
        self.auth = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        server = ServerConfig(max_waiting=max_waiting, request_timeout=request_timeout,
                              shutdown_grace_s=shutdown_grace_s, stream_interval=stream_interval,
                              max_request_bytes=max_request_bytes, receive_timeout_s=receive_timeout_s,
                              api_key=api_key, enable_docs=enable_docs, chat_template=chat_template,
                              tool_calling=tool_calling)
        self.engine = build_engine(EngineConfig(model=model, **engine), server, core_factory)
        self.app = build_app(self.engine, server)
        # Bound here and handed to uvicorn, so no other process can take the port in between.
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % self._socket.getsockname()[1]
        config = uvicorn_config(self.app, server, log_level="warning")
        self._server = GracefulServer(config, self.engine, shutdown_grace_s)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        deadline = time.monotonic() + 120  # the core process imports torch and loads the model first
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
            if not self._thread.is_alive():
                break
        raise RuntimeError(f"the server at {self.url} did not come up")

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the server did not shut down"

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name and labels, e.g. 'specserve:requests_total{finish_reason=stop}'."""
        text = httpx.get(self.url + "/metrics", headers=self.auth, timeout=10).text
        return {s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else ""):
                s.value for family in text_string_to_metric_families(text) for s in family.samples}

    def wait_for(self, condition, timeout: float = 10.0) -> dict[str, float]:
        """Poll /metrics until condition(samples) holds; returns the last scrape."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if condition(m):
                return m
            assert time.monotonic() < deadline, f"timed out waiting on /metrics: {m}"
            time.sleep(0.05)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Wait until nothing runs or waits and the KV cache is empty again."""
        return self.wait_for(lambda m: (m["specserve:num_requests_running"], m["specserve:num_requests_waiting"],
                                        m["specserve:kv_cache_usage_perc"]) == (0, 0, 0), timeout)


def connect(server: LiveServer) -> socket.socket:
    """A raw connection to the server, for requests no HTTP client would send."""
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data
