"""AsyncLLM: serve many asyncio clients from engine cores running in processes of their own.

This process (the API server's) owns everything that deals in text: tokenization and chat templates
run in a worker thread, off the event loop; detokenization, stop strings and output objects run on
the loop as each step's message arrives. Each core process (core_process.py) owns a replica of the
model; with data parallelism there are several, and each new request goes to the least loaded
(docs/design.md, 'Data parallelism'). They talk over ZMQ: requests and aborts one way, one
CoreOutputs message per engine step the other.

Request lifetimes are decided here: deadlines (a timer per request, so a request ends on time even
if nobody reads it), aborts when a caller goes away, and what happens when a core dies: its running
requests and every new request fail with EngineUnavailableError and `on_core_death` is called (the
server exits then, so whatever supervises it can start it again).
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import zmq
import zmq.asyncio

from specserve.config import EngineConfig
from specserve.engine.core_client import CoreClient
from specserve.engine.data_parallel import replica_gpus
from specserve.engine.messages import CoreAbort, CoreFailed, CoreOutputs, CoreRequest, EngineStats
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
    """generate() is the whole client API; start() and shutdown() bracket the core processes' lives."""

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
        self.max_model_len: int | None = None
        self.on_core_death: Callable[[], None] | None = None
        self.replicas: list[CoreClient] = []
        self._streams: dict[str, RequestStream] = {}
        self._replica_of: dict[str, CoreClient] = {}  # every request in _streams, and where it runs
        self._deadlines: dict[str, asyncio.TimerHandle] = {}
        self._unavailable: str | None = "not started"
        self._died_reason: str | None = None
        self._ipc_dir: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._readers: list[asyncio.Task] = []

    # ---- lifetime -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every replica's core process and wait until each has loaded the model; raises if one cannot
        start."""
        self._ipc_dir = tempfile.mkdtemp(prefix="specserve-")
        self._ctx = zmq.asyncio.Context()
        # Unsent messages are dropped when a socket closes: an engine never shut down (its caller failed)
        # is then collected without the context's term() waiting forever on a core that is gone.
        self._ctx.setsockopt(zmq.LINGER, 0)
        num = self.config.data_parallel_size
        on_cuda = self.config.device.startswith("cuda")
        # Each replica is an engine of its own: the core refuses a configuration of several.
        replica_config = dataclasses.replace(self.config, data_parallel_size=1)
        self.replicas = [CoreClient(i, num, replica_config, self._ctx, self._ipc_dir,
                                    replica_gpus(i, self.config.gpus_per_replica) if on_cuda and num > 1 else None)
                         for i in range(num)]
        log_level = logging.getLogger("specserve").getEffectiveLevel()
        for replica in self.replicas:
            replica.start(self.max_waiting, log_level, self._core_factory)
        waits = [asyncio.ensure_future(r.wait_ready()) for r in self.replicas]
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
        failed = [w.exception() for w in done if w.exception() is not None]
        if failed:  # the others are not waited for: a model may take minutes to load
            for w in pending:
                w.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await self._close()
            raise failed[0]
        self.max_model_len = waits[0].result().max_model_len
        loop = asyncio.get_running_loop()
        for replica in self.replicas:
            loop.add_reader(replica.process.sentinel, self._core_exited, replica)
        self._unavailable = None
        self._readers = [asyncio.create_task(self._read_outputs(r), name=f"specserve-outputs-{r.index}")
                         for r in self.replicas]

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Refuse new requests, let running ones finish for up to grace_s seconds, abort the rest. Requests of
        replicas still alive run on after another replica died."""
        if not self.replicas or self._unavailable in ("shut down", "shutting down"):
            return
        self._unavailable = "shutting down"
        deadline = time.monotonic() + grace_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._fail(None, EngineUnavailableError("the server shut down before the request finished"))
        loop = asyncio.get_running_loop()
        for replica in self.replicas:
            loop.remove_reader(replica.process.sentinel)
        await asyncio.gather(*(r.stop() for r in self.replicas))
        await self._close()
        self._unavailable = "shut down"

    async def _close(self) -> None:
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        for replica in self.replicas:
            replica.close()
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
        """Whether a core stopped on its own (crashed or failed), rather than by shutdown()."""
        return self._died_reason is not None

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    @property
    def core_pids(self) -> list[int]:
        """The process id of each replica's core, by replica index."""
        return [r.process.pid for r in self.replicas]

    @property
    def core_exit_codes(self) -> list[int | None]:
        return [r.process.exitcode for r in self.replicas]

    @property
    def stats(self) -> EngineStats:
        """Every replica's last reported state, summed."""
        return EngineStats.total(self.replica_stats)

    @property
    def replica_stats(self) -> list[EngineStats]:
        return [r.stats for r in self.replicas]

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
        self._check_room(len(ids), params)
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
        # Chosen and counted with no await in between, so a burst of requests spreads over the replicas. Every
        # sequence of a request goes to the same replica, where they share the prompt's KV blocks.
        replica = min(self.replicas, key=lambda r: (r.load, r.index))
        self._replica_of[request_id] = replica
        for seq in sequences:
            if not await replica.send_while_alive(CoreRequest(seq.core_request_id, ids, seq.params)):
                self._end(request_id)
                raise EngineUnavailableError(f"{replica.name} is not connected: it exited")
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

    def _check_room(self, prompt_len: int, params: SamplingParams) -> None:
        """A server asked for more tokens than the context leaves after the prompt cannot give them: refused, as
        OpenAI's and vLLM's servers refuse it (offline, LLM stops such a request when the context is full). A
        prompt that fills the context alone is the core's to refuse, as a prompt error."""
        room = self.max_model_len - prompt_len
        if params.max_tokens is not None and 0 < room < params.max_tokens:
            raise InvalidRequestError("max_tokens", f"is {params.max_tokens}, but the prompt is {prompt_len} tokens "
                                      f"and the model's context {self.max_model_len} (max_model_len), which leaves "
                                      f"room for {room}; ask for at most {room}, or shorten the prompt")

    def _check_available(self) -> None:
        if self._unavailable is not None:
            raise EngineUnavailableError(f"the engine is {self._unavailable}")

    def _end(self, request_id: str) -> tuple[RequestStream | None, list[str]]:
        """Forget a request on this side; returns its stream and the core requests of its sequences that
        still run."""
        running = self.processor.abort_request(request_id)
        self._replica_of.pop(request_id, None)
        timer = self._deadlines.pop(request_id, None)
        if timer is not None:
            timer.cancel()
        return self._streams.pop(request_id, None), running

    def _abort(self, request_id: str) -> RequestStream | None:
        """Forget a request here and abort every sequence of it in its replica's core; returns its stream."""
        replica = self._replica_of.get(request_id)
        stream, running = self._end(request_id)
        # A replica that is stopping or died holds nothing to abort (a send to one that exited is dropped).
        if running and replica is not None and not replica.stopping:
            replica.send(CoreAbort(running))
        return stream

    def _expire(self, request_id: str) -> None:
        self._deadlines.pop(request_id, None)
        stream = self._abort(request_id)
        if stream is not None:
            stream.put(RequestTimeoutError(f"the request did not finish within {self.request_timeout} s "
                                           "and was aborted"))

    # ---- outputs --------------------------------------------------------------------------

    async def _read_outputs(self, replica: CoreClient) -> None:
        try:
            while True:
                msg = replica.decoder.decode(await replica.outputs.recv(copy=False))
                if isinstance(msg, CoreFailed):
                    self._died(f"{replica.name} failed: {msg.message}", replica)
                    return
                self._deliver(replica, msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not leave requests waiting forever
            logger.exception("the output loop died")
            self._died(f"output processing failed: {type(e).__name__}: {e}", None)

    def _deliver(self, replica: CoreClient, msg: CoreOutputs) -> None:
        replica.note(msg)
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
            replica.send(CoreAbort(processed.to_abort))

    def _fail(self, replica: CoreClient | None, error: BaseException) -> None:
        """End with `error` every request of `replica`, or every request where it is None."""
        for request_id in [i for i, r in self._replica_of.items() if replica is None or r is replica]:
            self._end(request_id)[0].put(error)

    def _core_exited(self, replica: CoreClient) -> None:
        asyncio.get_running_loop().remove_reader(replica.process.sentinel)
        if not replica.stopping:
            self._died(f"{replica.name} process exited unexpectedly (exit code {replica.process.exitcode})", replica)

    def _died(self, reason: str, replica: CoreClient | None) -> None:
        """A core died (None: the front end cannot read the cores): fail its requests, refuse new ones, and
        report it, once, to whoever must restart the server. The other replicas' requests run on until the
        server's shutdown ends them."""
        logger.error("%s; failing %s", reason, "its requests" if replica is not None else "every request")
        if replica is not None:
            replica.stopping = True
        self._fail(replica, EngineUnavailableError(reason))
        self._died_reason = self._died_reason or reason
        if self._unavailable is None:
            self._unavailable = "dead"
            if self.on_core_death is not None:
                self.on_core_death()


def _refusal(error) -> SpecserveError:
    if error.kind == "invalid":
        return InvalidRequestError(error.field, error.message)
    if error.kind == "queue_full":
        return QueueFullError(error.message)
    return SpecserveError(error.message)
