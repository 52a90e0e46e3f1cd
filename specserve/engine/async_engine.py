"""AsyncLLMEngine: serve many asyncio clients from one LLMEngine.

The engine is not thread-safe and its step() blocks for as long as the model
runs, so a dedicated thread owns it: the only code that ever touches the
LLMEngine is `_run` on that thread. Running step() on the event loop would
freeze every connection for the length of a step; handing each step to
run_in_executor frees the loop but leaves it driving the engine (a round trip
through the loop per step, and adds and aborts racing the step unless they are
queued anyway). A thread that owns the engine outright is both responsive and
simple: the event loop talks to it through a FIFO of commands (add, abort,
stop), drained before each step, and the thread hands outputs back with
loop.call_soon_threadsafe, one batch per step. The FIFO order is what makes an
abort that follows an add always find its request.

Request lifetimes are decided on the engine thread too: admission against the
bounded waiting queue, per-request deadlines (so a request ends on time even if
nobody is reading it) and shutdown. Failures travel through the request's own
output queue as exceptions, so a caller of generate() waits in one place for
either.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from specserve.engine.engine import LLMEngine
from specserve.errors import InvalidRequestError, SpecserveError
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(SpecserveError):
    """Too many requests are already waiting; the client should retry later."""


class RequestTimeoutError(SpecserveError):
    """The request ran past its deadline and was aborted."""


class EngineUnavailableError(SpecserveError):
    """The engine is shutting down or has died; no request can be served."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of engine state, published by the engine thread after every step so
    other threads (the metrics endpoint) can read it without touching the engine."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    spec_num_drafted: int = 0
    spec_num_accepted: int = 0
    spec_acceptance_per_position: tuple[float, ...] = ()
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0

    @classmethod
    def of(cls, engine: LLMEngine) -> "EngineStats":
        spec = engine.spec_stats
        return cls(len(engine.scheduler.running), len(engine.scheduler.waiting), engine.kv.usage,
                   engine.kv.prefix_cache_hit_rate, spec.num_drafted, spec.num_accepted,
                   tuple(spec.acceptance_per_position), engine.num_prompt_tokens, engine.num_generated_tokens)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    deadline: float | None
    # Where this request's outputs go. Carrying the queue itself (not looking it up by id on
    # delivery) keeps a late output of an aborted request from reaching a new one with its id.
    outputs: asyncio.Queue


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


class AsyncLLMEngine:
    """generate() is the whole client API; start() and shutdown() bracket the engine thread's life."""

    def __init__(self, engine: LLMEngine, max_waiting: int = 512, request_timeout: float | None = None):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        if request_timeout is not None and request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.request_timeout = request_timeout
        self.stats = EngineStats.of(engine)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Event-loop side: the output queue of each request whose caller still waits on it.
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._unavailable: str | None = "not started"
        # Engine-thread side: the requests the engine holds.
        self._requests: dict[str, _Add] = {}

    # ---- event-loop side ------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will call generate()."""
        self._loop = asyncio.get_running_loop()
        self._unavailable = None
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_healthy(self) -> bool:
        return self._unavailable is None

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until the finished one. Raises InvalidRequestError,
        QueueFullError, RequestTimeoutError or EngineUnavailableError; closing the iterator
        early (a client that went away) aborts the request and frees its KV blocks."""
        if self._unavailable is not None:
            raise EngineUnavailableError(f"the engine is {self._unavailable}")
        request_id = uuid.uuid4().hex if request_id is None else request_id
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = outputs
        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        self._commands.put(_Add(request_id, prompt, params, deadline, outputs))
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            # Still registered means the engine still holds it: the caller stopped early.
            if self._streams.get(request_id) is outputs:
                del self._streams[request_id]
                self._commands.put(_Abort(request_id))

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Refuse new requests, let running ones finish for up to grace_s seconds, abort the rest."""
        if self._thread is None or self._unavailable == "shut down":
            return
        self._unavailable = "shutting down"
        deadline = time.monotonic() + grace_s
        while self._streams and self._thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join)
        self._unavailable = "shut down"
        self._fail_all(EngineUnavailableError("the server shut down before the request finished"))

    def _deliver(self, items: list[tuple[_Add, RequestOutput | BaseException]]) -> None:
        for request, item in items:
            request.outputs.put_nowait(item)  # unread and dropped if the caller already left
            ended = isinstance(item, BaseException) or item.finished
            if ended and self._streams.get(request.request_id) is request.outputs:
                del self._streams[request.request_id]

    def _fail_all(self, error: BaseException) -> None:
        for outputs in self._streams.values():
            outputs.put_nowait(error)
        self._streams.clear()

    def _died(self, reason: str) -> None:
        self._unavailable = "dead"
        self._fail_all(EngineUnavailableError(reason))

    # ---- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._handle_commands():
                items: list = []
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        request = self._requests[out.request_id]
                        items.append((request, out))
                        if out.finished:
                            del self._requests[out.request_id]
                    self._expire(items)
                self.stats = EngineStats.of(self.engine)
                if items:
                    self._loop.call_soon_threadsafe(self._deliver, items)
        except Exception as e:  # a bug, not bad input: input errors never leave _add
            logger.exception("the engine loop died")
            self._loop.call_soon_threadsafe(self._died, f"engine error: {type(e).__name__}: {e}")

    def _handle_commands(self) -> bool:
        """Apply every queued command, blocking for the first one while there is nothing to
        step; False once told to stop."""
        rejected: list = []
        block = not self.engine.has_unfinished_requests()
        while True:
            try:
                cmd = self._commands.get(block=block)
            except queue.Empty:
                break
            block = False
            if isinstance(cmd, _Add):
                error = self._add(cmd)
                if error is not None:
                    rejected.append((cmd, error))
            elif isinstance(cmd, _Abort):
                if self._requests.pop(cmd.request_id, None) is not None:
                    self.engine.abort_request(cmd.request_id)
            else:
                for request_id in self._requests:
                    self.engine.abort_request(request_id)
                self._requests.clear()
                self.stats = EngineStats.of(self.engine)
                return False
        if rejected:
            self._loop.call_soon_threadsafe(self._deliver, rejected)
        return True

    def _add(self, cmd: _Add) -> BaseException | None:
        waiting = len(self.engine.scheduler.waiting)
        if waiting >= self.max_waiting:
            return QueueFullError(f"the server is at capacity ({waiting} requests waiting); retry later")
        try:
            self.engine.add_request(cmd.prompt, cmd.params, cmd.request_id)
        except InvalidRequestError as e:
            return e
        except Exception as e:  # bad input must never reach the step loop; report it to its sender
            logger.exception("could not add request %s", cmd.request_id)
            return e
        self._requests[cmd.request_id] = cmd
        return None

    def _expire(self, items: list) -> None:
        if self.request_timeout is None:
            return
        now = time.monotonic()
        expired = [r for r in self._requests.values() if r.deadline <= now]
        for request in expired:
            del self._requests[request.request_id]
            self.engine.abort_request(request.request_id)
            items.append((request, RequestTimeoutError(
                f"the request did not finish within {self.request_timeout} s and was aborted")))
