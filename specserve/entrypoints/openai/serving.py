"""What both generation endpoints share: admission, disconnects, metrics, server-sent events.

A request is answered only once the engine has produced its first output (or
refused it), so that every refusal, from an invalid prompt to a full queue,
gets its own HTTP status instead of an error inside a 200 stream.

Streamed chunks are the hot path (one per request per engine step at most):
they are built as bytes from a prefix fixed per request and msgspec-encoded
choices, with no pydantic objects per chunk.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse

from specserve.engine.async_llm import AsyncLLM
from specserve.entrypoints.openai.errors import OpenAIError, to_openai_error
from specserve.entrypoints.openai.metrics import ServerMetrics
from specserve.entrypoints.openai.responses import PromptTokensDetails, Usage
from specserve.entrypoints.openai.tool_calling import ToolCallingConfig
from specserve.errors import EngineUnavailableError, InvalidRequestError, QueueFullError, RequestTimeoutError
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

Outputs = AsyncIterator[RequestOutput]


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; there is nobody to answer."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, awaitable: Awaitable):
    """Await `awaitable`, or cancel it once the client disconnects.

    Starlette does not cancel a handler whose client left, so a long
    non-streamed generation would otherwise run to its end for nobody.
    """
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        work.cancel()  # a no-op once it is done
    if not work.done() or work.cancelled():
        raise ClientDisconnected()
    return work.result()


def usage(*outs: RequestOutput) -> Usage:
    """The tokens of the requests whose final outputs these are (one, or each prompt's of a batch)."""
    n_prompt = sum(out.metrics.num_prompt_tokens for out in outs)
    n_out = sum(out.metrics.num_output_tokens for out in outs)
    cached = sum(out.metrics.num_cached_tokens for out in outs)
    return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def all_or_none(awaitables: list[Awaitable], undo: Callable[[object], Awaitable] | None = None) -> list:
    """The results of awaitables run at once. Once one fails (or this is cancelled) the others are cancelled,
    `undo` is awaited on the results of those that had finished, and the failure is raised: the first in their
    order."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failure = next((t.exception() for t in tasks if t.done() and t.exception() is not None), None)
        if failure is None:
            return [t.result() for t in tasks]
        raise failure
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if undo is not None:
            for t in tasks:
                if not t.cancelled() and t.exception() is None:
                    await undo(t.result())
        raise


async def merged(streams: list[Outputs]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several requests as each comes, with its request's place in `streams`. A failure of one is
    raised here, and closing this (or a failure) closes them all, aborting those still running."""
    if len(streams) == 1:  # a streamed request's hot path: no task per output
        async with contextlib.aclosing(streams[0]) as outputs:
            async for out in outputs:
                yield 0, out
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for s in streams:
            await s.aclose()


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str, metrics: ServerMetrics, chat_template: str | None = None,
                 tool_calling: ToolCallingConfig = ToolCallingConfig()):
        self.engine = engine
        self.chat_template = chat_template  # None: the tokenizer's
        self.tool_calling = tool_calling
        # Used on the event loop only (logprob tokens); tokenization has its own in a worker thread.
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.metrics = metrics

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                              param="model", code="model_not_found")

    async def start(self, request: Request, prompt: str | list[int], params: SamplingParams, request_id: str,
                    param_name: Callable[[str], str]) -> Outputs:
        """Admit a request and wait for its first output; returns all its outputs, that one included."""
        outputs = self._generate(prompt, params, request_id)
        first = await self._answer(request, anext(outputs), param_name)
        return StartedOutputs(first, outputs)

    async def start_batch(self, request: Request, prompts: list[str | list[int]], params: SamplingParams,
                          request_ids: list[str], param_names: list[Callable[[str], str]]) -> list[Outputs]:
        """start() for every prompt at once; if one is refused, the others are aborted and its error raised."""
        return await all_or_none([self.start(request, p, params, rid, name)
                                  for p, rid, name in zip(prompts, request_ids, param_names)],
                                 lambda started: started.aclose())

    async def finish(self, request: Request, outputs: Outputs) -> RequestOutput:
        """The final output of a non-streamed request."""
        async def last() -> RequestOutput:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    pass
            return out

        return await self._answer(request, last())

    @staticmethod
    async def _answer(request: Request, awaitable: Awaitable, param_name=lambda field: field):
        """Await engine work for a client, turning every failure into its OpenAI error."""
        try:
            return await until_disconnect(request, awaitable)
        except ClientDisconnected:
            raise OpenAIError(499, "the client closed the request", code="client_closed_request") from None
        except Exception as e:
            raise to_openai_error(e, param_name) from e

    async def _generate(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> Outputs:
        """engine.generate, observing each request in the metrics when it ends: each of its n sequences by its
        own finish reason, or by the request's end (abort, timeout, error) where it did not finish."""
        last, reason = None, "abort"  # ended early without an error: the client went away
        finished: dict[int, str] = {}  # sequence index -> its finish reason
        try:
            # Closed explicitly, so leaving early aborts the request now rather than at garbage collection.
            async with contextlib.aclosing(self.engine.generate(prompt, params, request_id)) as outputs:
                async for out in outputs:
                    last = out
                    finished.update((seq.index, seq.finish_reason) for seq in out.outputs if seq.finish_reason)
                    yield out
        except (InvalidRequestError, QueueFullError):
            reason = None  # refused, never admitted
            raise
        except RequestTimeoutError:
            reason = "timeout"
            raise
        except EngineUnavailableError:
            reason = "error"
            raise
        finally:
            if reason is not None:
                self.metrics.record_request([finished.get(i, reason) for i in range(params.n)], last)


class StartedOutputs:
    """A request's outputs once start() has its first: that one, then the rest. Closing them closes the rest,
    aborting the request, whether or not any was read (a generator closed before its first step would not reach
    the rest, leaving the request to run until garbage collection)."""

    def __init__(self, first: RequestOutput, rest: Outputs):
        self._first: RequestOutput | None = first
        self._rest = rest

    def __aiter__(self) -> StartedOutputs:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await anext(self._rest)

    async def aclose(self) -> None:
        self._first = None
        await self._rest.aclose()


class ChunkWriter:
    """Server-sent events of one streamed response: `data: {...}` lines sharing id, object, created
    and model, whose bytes are encoded once."""

    def __init__(self, request_id: str, object_name: str, model: str):
        head = msgspec.json.encode({"id": request_id, "object": object_name, "created": int(time.time()),
                                    "model": model})
        self._prefix = b"data: " + head[:-1] + b',"choices":'

    def chunk(self, choices: list[dict], usage: Usage | None = None) -> bytes:
        tail = b"}\n\n" if usage is None else b',"usage":' + usage.model_dump_json().encode() + b"}\n\n"
        return self._prefix + msgspec.json.encode(choices) + tail


def sse(events: AsyncIterator[bytes]) -> StreamingResponse:
    """Stream server-sent events ending in `data: [DONE]`; an error after the stream started is sent as
    an OpenAI error event, since the status line is already out."""
    async def body() -> AsyncIterator[bytes]:
        async with contextlib.aclosing(events):
            try:
                async for event in events:
                    yield event
            except Exception as e:
                yield b"data: " + to_openai_error(e).encoded() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
