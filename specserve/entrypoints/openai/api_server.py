"""The OpenAI-compatible HTTP server: routes, app lifetime, and running it under uvicorn."""
from __future__ import annotations

import copy
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request, Response

from specserve.config import EngineConfig
from specserve.engine.async_engine import AsyncLLMEngine
from specserve.engine.engine import LLMEngine
from specserve.entrypoints.openai.errors import install_error_handlers
from specserve.entrypoints.openai.metrics import ServerMetrics
from specserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from specserve.entrypoints.openai.serving import OpenAIServing
from specserve.entrypoints.openai.serving_chat import create_chat_completion
from specserve.entrypoints.openai.serving_completion import create_completion


def build_app(engine: AsyncLLMEngine, served_model_name: str, shutdown_grace_s: float = 5.0) -> FastAPI:
    """An app serving `engine`; the engine thread starts and stops with the app's lifespan."""
    metrics = ServerMetrics(engine)
    # Copied before the engine thread starts, so the two threads never share a tokenizer.
    tokenizer = copy.deepcopy(engine.engine.tokenizer)
    serving = OpenAIServing(engine, tokenizer, served_model_name, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        await engine.shutdown(shutdown_grace_s)

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.serving = serving
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(serving, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(serving, body, request)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=engine.engine.config.max_model_len)])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_healthy else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        content, media_type = metrics.render()
        return Response(content, media_type=media_type)

    return app


class GracefulServer(uvicorn.Server):
    """uvicorn, draining the engine before it waits on open connections.

    Plain uvicorn would wait for streams to end by themselves and then cancel
    them mid-response; draining first lets running requests finish within the
    grace period and ends the rest with an error event and `data: [DONE]`.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, shutdown_grace_s: float):
        super().__init__(config)
        self.engine = engine
        self.shutdown_grace_s = shutdown_grace_s

    async def shutdown(self, sockets=None) -> None:
        await self.engine.shutdown(self.shutdown_grace_s)
        await super().shutdown(sockets)


def run_server(config: EngineConfig, served_model_name: str, host: str, port: int, max_waiting: int,
               request_timeout: float | None, shutdown_grace_s: float) -> None:
    engine = AsyncLLMEngine(LLMEngine(config), max_waiting=max_waiting, request_timeout=request_timeout)
    app = build_app(engine, served_model_name, shutdown_grace_s)
    GracefulServer(uvicorn.Config(app, host=host, port=port, log_level="info"), engine, shutdown_grace_s).run()
