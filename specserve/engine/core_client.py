"""One engine core process as the front end sees it: the process, its two ZMQ sockets, and the load it
last reported. AsyncLLM holds one per data-parallel replica (docs/design.md, 'Data parallelism')."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
from dataclasses import dataclass
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from specserve.config import EngineConfig
from specserve.engine.core_process import CoreAddresses, run_engine_core
from specserve.engine.data_parallel import visible_to_child
from specserve.engine.messages import CoreOutputs, CoreReady, CoreRequest, CoreShutdown, EngineStats, FromCore
from specserve.errors import EngineUnavailableError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class ReplicaLoad:
    """What a new request is balanced by, compared field by field: the fewest requests first, then the
    emptiest KV cache."""

    num_requests: int  # running, waiting, and sent but not yet read by the core
    kv_cache_usage: float


class CoreClient:
    """Start with `start()` then `wait_ready()`; `send` never waits; `stop()` asks the core to exit, `close()`
    releases everything (killing a core still alive)."""

    def __init__(self, index: int, num_replicas: int, config: EngineConfig, ctx: zmq.asyncio.Context,
                 ipc_dir: str, gpus: list[str] | None):
        self.index = index
        self.name = "the engine core" if num_replicas == 1 else f"engine core {index} (of {num_replicas})"
        self.config = config
        self.gpus = gpus
        self.stats = EngineStats()
        self.num_requests_sent = 0
        self.num_requests_read = 0
        self.stopping = False
        self.process: multiprocessing.Process | None = None
        self.addresses = CoreAddresses(f"ipc://{ipc_dir}/requests-{index}", f"ipc://{ipc_dir}/outputs-{index}")
        self._encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(FromCore)
        self.requests = ctx.socket(zmq.PUSH)
        self.requests.setsockopt(zmq.SNDHWM, 0)
        self.requests.bind(self.addresses.requests)
        self.outputs = ctx.socket(zmq.PULL)
        self.outputs.setsockopt(zmq.RCVHWM, 0)
        self.outputs.bind(self.addresses.outputs)

    def start(self, max_waiting: int, log_level: int, core_factory: Callable | None) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(target=run_engine_core, name=f"specserve-engine-core-{self.index}", daemon=True,
                                     args=(self.config, self.addresses, max_waiting, log_level, core_factory))
        with visible_to_child(self.gpus):
            self.process.start()

    async def wait_ready(self) -> CoreReady:
        """The core's first message, once it has loaded the model; raises EngineUnavailableError if it exits or
        fails first."""
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(self.process.sentinel, lambda: exited.done() or exited.set_result(None))
        first = asyncio.ensure_future(self.outputs.recv())
        try:
            await asyncio.wait({first, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            loop.remove_reader(self.process.sentinel)
            ready = first.done()
            if not ready:
                first.cancel()
        if not ready:
            raise EngineUnavailableError(f"{self.name} exited during start-up (exit code {self.process.exitcode}); "
                                         "its log above says why")
        msg = self.decoder.decode(first.result())
        if not isinstance(msg, CoreReady):
            raise EngineUnavailableError(f"{self.name} could not start: {getattr(msg, 'message', msg)}")
        where = f" on GPU {','.join(self.gpus)}" if self.gpus else ""
        logger.info("%s running (pid %d)%s: KV cache of %d blocks of %d tokens", self.name, self.process.pid, where,
                    msg.num_kv_blocks, msg.block_size)
        return msg

    @property
    def load(self) -> ReplicaLoad:
        unread = self.num_requests_sent - self.num_requests_read
        return ReplicaLoad(self.stats.num_running + self.stats.num_waiting + unread, self.stats.kv_cache_usage)

    def note(self, msg: CoreOutputs) -> None:
        """Take the load a step's message reports."""
        self.stats = msg.stats
        self.num_requests_read = msg.num_requests_read

    def send(self, message) -> bool:
        """Hand a message to the core without waiting; False where no core is connected. A connected core
        never makes a send wait (no high-water mark), and one that has exited, before the front end has seen it
        go, has no connection: a waiting send would wait for it forever."""
        sent = self.requests.send(self._encoder.encode(message), flags=zmq.NOBLOCK).exception() is None
        if sent and isinstance(message, CoreRequest):
            self.num_requests_sent += 1
        return sent

    async def send_while_alive(self, message) -> bool:
        """send, retried while the core process lives: its connection may still be coming up just after
        start-up."""
        while not self.send(message):
            if not self.process.is_alive():
                return False
            await asyncio.sleep(0.001)
        return True

    async def stop(self) -> None:
        """Tell the core to abort what it holds and exit; kill it if it has not within 10 s."""
        self.stopping = True
        if not self.process.is_alive():
            return
        self.send(CoreShutdown())  # not sent: the core is exiting anyway
        await asyncio.to_thread(self.process.join, 10)
        if self.process.is_alive():
            logger.warning("%s did not stop within 10 s; killing it", self.name)
            self.process.kill()
            await asyncio.to_thread(self.process.join)

    def close(self) -> None:
        self.stopping = True
        if self.process is not None and self.process.is_alive():
            self.process.kill()
        self.requests.close(linger=0)
        self.outputs.close(linger=0)
