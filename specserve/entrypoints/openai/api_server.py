"""The OpenAI-compatible HTTP server: routes, app lifetime, and running it under uvicorn."""
from __future__ import annotations

import logging
import signal
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import jinja2
import uvicorn
from fastapi import FastAPI, Request, Response

from specserve.config import EngineConfig
from specserve.engine.async_llm import AsyncLLM
from specserve.entrypoints.openai.auth import ApiKeyMiddleware
from specserve.entrypoints.openai.body_limit import BodyLimitMiddleware
from specserve.entrypoints.openai.errors import install_error_handlers
from specserve.entrypoints.openai.metrics import ServerMetrics
from specserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from specserve.entrypoints.openai.receive_deadline import receive_deadline_protocol
from specserve.entrypoints.openai.responses import ModelCard, ModelList
from specserve.entrypoints.openai.serving import OpenAIServing
from specserve.entrypoints.openai.serving_chat import create_chat_completion
from specserve.entrypoints.openai.serving_completion import create_completion
from specserve.entrypoints.openai.serving_tokenize import detokenize, tokenize
from specserve.entrypoints.openai.tokenize_fields import DetokenizeRequest, TokenizeRequest
from specserve.entrypoints.openai.tool_calling import ToolCallingConfig

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """How the server listens and treats requests (the engine's own settings are in EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: the model as given
    max_waiting: int = 512  # requests allowed to wait for admission; more are answered 503
    request_timeout: float | None = None  # seconds; None: no deadline
    shutdown_grace_s: float = 10.0  # time running requests get to finish on shutdown
    stream_interval: int = 1  # tokens per streamed chunk, at most (the first and last go out at once)
    max_request_bytes: int = 8 * 2**20  # larger bodies are refused (413) before they are read
    # Seconds a client has to send a whole request, from connecting or from its previous answer's end;
    # slower ones are disconnected (receive_deadline.py).
    receive_timeout_s: float = 30.0
    api_key: str | None = field(default=None, repr=False)  # None: no key; else every route but /health needs it
    enable_docs: bool = False  # serve /docs, /redoc and /openapi.json (behind the key, if one is set)
    chat_template: str | None = None  # a Jinja chat template's text, used in place of the tokenizer's
    tool_calling: ToolCallingConfig = field(default_factory=ToolCallingConfig)

    def __post_init__(self) -> None:
        checks = [(0 <= self.port < 65536, "port", "must be in [0, 65535]"),
                  (self.max_waiting >= 1, "max_waiting", "must be >= 1"),
                  (self.request_timeout is None or self.request_timeout > 0, "request_timeout", "must be > 0"),
                  (self.shutdown_grace_s >= 0, "shutdown_grace_s", "must be >= 0"),
                  (self.stream_interval >= 1, "stream_interval", "must be >= 1 token"),
                  (self.max_request_bytes >= 1024, "max_request_bytes", "must be >= 1024"),
                  (self.receive_timeout_s > 0, "receive_timeout_s", "must be > 0"),
                  (self.api_key is None or self.api_key.strip() == self.api_key != "", "api_key",
                   "must be None or a non-empty string without surrounding white space")]
        for ok, name, rule in checks:
            if not ok:
                shown = "(hidden)" if name == "api_key" else repr(getattr(self, name))
                raise ValueError(f"{name} {rule}, got {shown}")
        if self.chat_template is not None:
            try:  # with the extension transformers renders templates with
                jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"chat_template is not a valid Jinja template: {e} (line {e.lineno})") from None


def build_engine(engine_config: EngineConfig, server: ServerConfig, core_factory=None) -> AsyncLLM:
    return AsyncLLM(engine_config, server.max_waiting, server.request_timeout, server.stream_interval, core_factory)


def build_app(engine: AsyncLLM, server: ServerConfig):
    """An app serving `engine`; the engine core's process starts and stops with the app's lifespan."""
    served_model_name = server.served_model_name or engine.config.model
    metrics = ServerMetrics(engine)
    serving = OpenAIServing(engine, served_model_name, metrics, server.chat_template, server.tool_calling)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await engine.start()
        yield
        await engine.shutdown(server.shutdown_grace_s)

    # The API's description is for developers, and tells a prober every route: off unless asked for (FastAPI's
    # defaults serve it at /docs, /redoc and /openapi.json).
    docs = {} if server.enable_docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="specserve", lifespan=lifespan, **docs)
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(serving, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(serving, body, request)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest):
        return await tokenize(serving, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest):
        return await detokenize(serving, body)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=engine.max_model_len)])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_healthy else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        content, media_type = metrics.render()
        return Response(content, media_type=media_type)

    app = BodyLimitMiddleware(app, server.max_request_bytes)
    # Outermost: a request without the key is refused before any of its body is read.
    return app if server.api_key is None else ApiKeyMiddleware(app, server.api_key)


class GracefulServer(uvicorn.Server):
    """uvicorn, draining the engine before it waits on open connections, and exiting when the engine
    core dies (so whatever supervises the server can start it again).

    Plain uvicorn would wait for streams to end by themselves and then cancel
    them mid-response; draining first lets running requests finish within the
    grace period and ends the rest with an error event and `data: [DONE]`.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, shutdown_grace_s: float):
        super().__init__(config)
        self.engine = engine
        self.shutdown_grace_s = shutdown_grace_s
        engine.on_core_death = self._core_died

    def _core_died(self) -> None:
        logger.error("the engine core died; the server shuts down")
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        await self.engine.shutdown(self.shutdown_grace_s)
        await super().shutdown(sockets)


def uvicorn_config(app, server: ServerConfig, **kwargs) -> uvicorn.Config:
    """uvloop and httptools where installed (uvicorn's "auto" picks them), a deadline on receiving each request,
    and no per-request access log."""
    return uvicorn.Config(app, loop="auto", http=receive_deadline_protocol(server.receive_timeout_s),
                          access_log=False, **kwargs)


def run_server(engine_config: EngineConfig, server: ServerConfig) -> None:
    engine = build_engine(engine_config, server)
    app = build_app(engine, server)
    uv = GracefulServer(uvicorn_config(app, server, host=server.host, port=server.port, log_level="info"), engine,
                        server.shutdown_grace_s)
    # uvicorn drains on SIGINT / SIGTERM, then raises the signal again under the handlers it found. By then
    # the drain is done, so those handlers only let run() return: a drained server exits with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    uv.run()
    if engine.is_dead:
        raise SystemExit("error: the engine core died; see the log above")
