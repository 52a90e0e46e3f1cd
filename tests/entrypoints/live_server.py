"""A real uvicorn server on a free loopback port, in a thread of the test process, so tests can
both talk HTTP to it and look at its engine."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from specserve.config import EngineConfig
from specserve.engine.async_engine import AsyncLLMEngine
from specserve.engine.engine import LLMEngine
from specserve.entrypoints.openai.api_server import GracefulServer, build_app


@contextlib.contextmanager
def one_torch_thread():
    """Server thread, engine thread and clients share two cores: a second intra-op thread per
    forward only makes the tiny model's steps wait on each other (several times slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class LiveServer:
    def __init__(self, model: str, max_waiting: int = 512, request_timeout: float | None = None,
                 shutdown_grace_s: float = 1.0, **engine):
        self.model = model
        self.engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=model, **engine)), max_waiting, request_timeout)
        self.app = build_app(self.engine, model, shutdown_grace_s)
        # Bound here and handed to uvicorn, so no other process can take the port in between.
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % self._socket.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning")
        self._server = GracefulServer(config, self.engine, shutdown_grace_s)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the server at {self.url} did not come up")

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the server did not shut down"

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name and labels, e.g. 'specserve:requests_total{finish_reason=stop}'."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
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
