"""AsyncLLM: serve many asyncio clients from an engine core running in its own process.

This process (the API server's) owns everything that deals in text: tokenization and chat templates
run in a worker thread, off the event loop; detokenization, stop strings and output objects run on
the loop as each step's message arrives. The core process (core_process.py) owns the model. They
talk over ZMQ: requests and aborts one way, one CoreOutputs message per engine step the other.

Request lifetimes are decided here: deadlines (a timer per request, so a request ends on time even
if nobody reads it), aborts when a caller goes away, and what happens when the core dies: every
running and new request fails with EngineUnavailableError and `on_core_death` is called (the server
exits then, so whatever supervises it can start it again).
"""
from __future__ import annotations

import asyncio
import copy
import logging
import multiprocessing
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec
import zmq
import zmq.asyncio

from specserve.config import EngineConfig
from specserve.engine.core_process import CoreAddresses, run_engine_core
from specserve.engine.messages import (CoreAbort, CoreFailed, CoreOutputs, CoreReady, CoreRequest, CoreShutdown,
                                       EngineStats, FromCore)
from specserve.engine.output_processor import OutputProcessor
from specserve.engine.parallel_sampling import sequence_requests
from specserve.engine.request_stream import RequestStream
from specserve.errors import (EngineUnavailableError, InvalidRequestError, QueueFullError, RequestTimeoutError,
                              SpecserveError)
from specserve.models.loader import load_tokenizer, open_model_source
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    if not prompt:
        raise InvalidRequestError("prompt", "is empty; give at least one character or token id")
    return tokenizer.encode(prompt, add_special_tokens=True)


class AsyncLLM:
    """generate() is the whole client API; start() and shutdown() bracket the core process's life."""

    def __init__(self, config: EngineConfig, max_waiting: int = 512, request_timeout: float | None = None,
                 stream_interval: int = 1, core_factory: Callable | None = None):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        if request_timeout is not None and request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}")
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1 token, got {stream_interval}")
        self.config = config
        self.max_waiting = max_waiting
        self.request_timeout = request_timeout
        self.stream_interval = stream_interval
        self._core_factory = core_factory
        self.tokenizer = load_tokenizer(open_model_source(config.model, config.revision), config.tokenizer)
        # Tokenization runs in one worker thread with a tokenizer of its own: a tokenizer is not shared
        # across threads, and one thread keeps big prompts from taking every core from the loop.
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="specserve-tokenize")
        self._pool_tokenizer = copy.deepcopy(self.tokenizer)
        self.processor = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        self.max_model_len: int | None = None
        self.on_core_death: Callable[[], None] | None = None
        self._streams: dict[str, RequestStream] = {}
        self._deadlines: dict[str, asyncio.TimerHandle] = {}
        self._unavailable: str | None = "not started"
        self._died_reason: str | None = None
        self._process = None
        self._ipc_dir: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._requests: zmq.asyncio.Socket | None = None
        self._outputs: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._encoder = msgspec.msgpack.Encoder()

    # ---- lifetime -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the core process and wait until it has loaded the model; raises if it cannot start."""
        self._ipc_dir = tempfile.mkdtemp(prefix="specserve-")
        addresses = CoreAddresses(f"ipc://{self._ipc_dir}/requests", f"ipc://{self._ipc_dir}/outputs")
        self._ctx = zmq.asyncio.Context()
        # Unsent messages are dropped when a socket closes: an engine never shut down (its caller failed)
        # is then collected without the context's term() waiting forever on a core that is gone.
        self._ctx.setsockopt(zmq.LINGER, 0)
        self._requests = self._ctx.socket(zmq.PUSH)
        self._requests.setsockopt(zmq.SNDHWM, 0)
        self._requests.bind(addresses.requests)
        self._outputs = self._ctx.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._outputs.bind(addresses.outputs)
        spawn = multiprocessing.get_context("spawn")
        self._process = spawn.Process(
            target=run_engine_core, name="specserve-engine-core", daemon=True,
            args=(self.config, addresses, self.max_waiting, logging.getLogger("specserve").getEffectiveLevel(),
                  self._core_factory))
        self._process.start()
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(self._process.sentinel, lambda: exited.done() or exited.set_result(None))
        decoder = msgspec.msgpack.Decoder(FromCore)
        first = asyncio.ensure_future(self._outputs.recv())
        await asyncio.wait({first, exited}, return_when=asyncio.FIRST_COMPLETED)
        if not first.done():
            first.cancel()
            await self._close()
            raise EngineUnavailableError(f"the engine core process exited during start-up "
                                         f"(exit code {self._process.exitcode}); its log above says why")
        msg = decoder.decode(first.result())
        if not isinstance(msg, CoreReady):
            await self._close()
            raise EngineUnavailableError(f"the engine core could not start: {getattr(msg, 'message', msg)}")
        self.max_model_len = msg.max_model_len
        loop.remove_reader(self._process.sentinel)
        loop.add_reader(self._process.sentinel, self._core_exited)
        self._unavailable = None
        self._reader = asyncio.create_task(self._read_outputs(decoder), name="specserve-outputs")
        logger.info("engine core running (pid %d): KV cache of %d blocks of %d tokens", self._process.pid,
                    msg.num_kv_blocks, msg.block_size)

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Refuse new requests, let running ones finish for up to grace_s seconds, abort the rest."""
        if self._process is None or self._unavailable in ("shut down", "shutting down"):
            return
        dead = self._unavailable == "dead"
        self._unavailable = "shutting down"
        deadline = time.monotonic() + grace_s
        while self._streams and not dead and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._fail_all(EngineUnavailableError("the server shut down before the request finished"))
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        if self._process.is_alive():
            self._send(CoreShutdown())  # not sent: the core is exiting anyway
            await asyncio.to_thread(self._process.join, 10)
            if self._process.is_alive():
                logger.warning("the engine core did not stop within 10 s; killing it")
                self._process.kill()
                await asyncio.to_thread(self._process.join)
        await self._close()
        self._unavailable = "shut down"

    async def _close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._process is not None and self._process.is_alive():
            self._process.kill()
        for socket in (self._requests, self._outputs):
            if socket is not None:
                socket.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._tokenizer_pool.shutdown(wait=False)
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    @property
    def is_healthy(self) -> bool:
        return self._unavailable is None

    @property
    def is_dead(self) -> bool:
        """Whether the core stopped on its own (crashed or failed), rather than by shutdown()."""
        return self._died_reason is not None

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    @property
    def core_pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    # ---- requests -------------------------------------------------------------------------

    async def run_tokenizer(self, fn: Callable, *args):
        """fn(tokenizer, *args) in the tokenizer's worker thread, so big prompts never block the loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, fn, self._pool_tokenizer, *args)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until the finished one. Raises InvalidRequestError,
        QueueFullError, RequestTimeoutError or EngineUnavailableError; closing the iterator early (a
        client that went away) aborts the request and frees its KV blocks."""
        self._check_available()
        if params.n > self.max_waiting:
            raise InvalidRequestError("n", f"is {params.n}, but each sequence waits for admission as a request "
                                      f"and at most {self.max_waiting} may wait (the server's --max-waiting); "
                                      "ask for fewer")
        request_id = uuid.uuid4().hex if request_id is None else request_id
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        arrival = time.monotonic()
        ids = await self.run_tokenizer(encode_prompt, prompt) if isinstance(prompt, str) else list(prompt)
        self._check_available()
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        stream = RequestStream(params.output_kind, self.stream_interval)
        self._streams[request_id] = stream
        sequences = sequence_requests(request_id, params)
        self.processor.add_request(request_id, prompt if isinstance(prompt, str) else None, ids, params, sequences,
                                   arrival)
        if self.request_timeout is not None:
            self._deadlines[request_id] = asyncio.get_running_loop().call_later(
                self.request_timeout, self._expire, request_id)
        for seq in sequences:
            if not await self._send_while_alive(CoreRequest(seq.core_request_id, ids, seq.params)):
                self._end(request_id)
                raise EngineUnavailableError("the engine core is not connected: it exited")
        try:
            while True:
                out = await stream.get()
                yield out
                if out.finished:
                    return
        finally:
            # Still registered means the core still holds it: the caller stopped early.
            if self._streams.get(request_id) is stream:
                self._abort(request_id)

    def _send(self, message) -> bool:
        """Hand a message to the core without waiting; False where no core is connected. A connected core
        never makes a send wait (no high-water mark), and one that has exited, before this loop has seen it
        go, has no connection: a waiting send would wait for it forever."""
        return self._requests.send(self._encoder.encode(message), flags=zmq.NOBLOCK).exception() is None

    async def _send_while_alive(self, message) -> bool:
        """_send, retried while the core process lives: its connection may still be coming up just after
        start-up."""
        while not self._send(message):
            if not self._process.is_alive():
                return False
            await asyncio.sleep(0.001)
        return True

    def _check_available(self) -> None:
        if self._unavailable is not None:
            raise EngineUnavailableError(f"the engine is {self._unavailable}")

    def _end(self, request_id: str) -> tuple[RequestStream | None, list[str]]:
        """Forget a request on this side; returns its stream and the core requests of its sequences that
        still run."""
        running = self.processor.abort_request(request_id)
        timer = self._deadlines.pop(request_id, None)
        if timer is not None:
            timer.cancel()
        return self._streams.pop(request_id, None), running

    def _abort(self, request_id: str) -> RequestStream | None:
        """Forget a request here and abort every sequence of it in the core; returns its stream."""
        stream, running = self._end(request_id)
        if running and self._unavailable is None:
            self._send(CoreAbort(running))
        return stream

    def _expire(self, request_id: str) -> None:
        self._deadlines.pop(request_id, None)
        stream = self._abort(request_id)
        if stream is not None:
            stream.put(RequestTimeoutError(f"the request did not finish within {self.request_timeout} s "
                                           "and was aborted"))

    # ---- outputs --------------------------------------------------------------------------

    async def _read_outputs(self, decoder: msgspec.msgpack.Decoder) -> None:
        try:
            while True:
                msg = decoder.decode(await self._outputs.recv(copy=False))
                if isinstance(msg, CoreFailed):
                    self._died(f"the engine core failed: {msg.message}")
                    return
                self._deliver(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not leave requests waiting forever
            logger.exception("the output loop died")
            self._died(f"output processing failed: {type(e).__name__}: {e}")

    def _deliver(self, msg: CoreOutputs) -> None:
        self.stats = msg.stats
        outputs = msg.outputs
        if any(o.error is not None for o in outputs):
            for o in outputs:
                request_id = self.processor.request_of(o.request_id) if o.error is not None else None
                if request_id is not None:
                    # A refused sequence fails its whole request; the core drops the others it admitted.
                    stream = self._abort(request_id)
                    if stream is not None:
                        stream.put(_refusal(o.error))
            outputs = [o for o in outputs if o.error is None]
        processed = self.processor.process(outputs)
        for out in processed.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                self._end(out.request_id)
            stream.put(out)
        if processed.to_abort:
            self._send(CoreAbort(processed.to_abort))

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._end(request_id)[0].put(error)

    def _core_exited(self) -> None:
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        if self._unavailable is None:
            self._died(f"the engine core process exited unexpectedly (exit code {self._process.exitcode})")

    def _died(self, reason: str) -> None:
        logger.error("%s; failing every request", reason)
        self._unavailable = "dead"
        self._died_reason = reason
        self._fail_all(EngineUnavailableError(reason))
        if self.on_core_death is not None:
            self.on_core_death()


def _refusal(error) -> SpecserveError:
    if error.kind == "invalid":
        return InvalidRequestError(error.field, error.message)
    if error.kind == "queue_full":
        return QueueFullError(error.message)
    return SpecserveError(error.message)
