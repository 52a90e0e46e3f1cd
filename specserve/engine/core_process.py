"""The engine core in a process of its own, driven over two ZMQ sockets.

The API server's event loop and the core's step loop must not share an interpreter: in one process
they take turns on the GIL, and every turn the loop takes is host time the GPU waits for. Here the
core's process does nothing but receive requests and aborts, step, and send one CoreOutputs message
per step (msgpack). Commands are read before every step, blocking only while nothing is left to
step; a request is admitted only while fewer than `max_waiting` wait, so a flood is refused at once.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass

import msgspec
import zmq

from specserve.config import EngineConfig
from specserve.engine.messages import (CoreAbort, CoreError, CoreFailed, CoreOutput, CoreOutputs, CoreRequest,
                                       CoreShutdown, ToCore)
from specserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# How often an idle core checks that the process that started it is still there.
_PARENT_CHECK_MS = 1000


@dataclass(frozen=True)
class CoreAddresses:
    """Where the front end listens: `requests` for what it sends the core, `outputs` for what it gets back."""

    requests: str
    outputs: str


def run_engine_core(config: EngineConfig, addresses: CoreAddresses, max_waiting: int,
                    log_level: int = logging.INFO, core_factory=None) -> None:
    """The process's entry point. `core_factory(config)` builds the core (default: EngineCore); tests pass
    one that wraps it."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group; the front end decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM unwinds the process, so that the finally below stops the tensor-parallel workers before it exits.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = os.getppid()
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(addresses.requests)
    outbox = ctx.socket(zmq.PUSH)
    # Never block a step on a front end that reads late: it merges what piled up when it catches up.
    outbox.setsockopt(zmq.SNDHWM, 0)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(addresses.outputs)
    encoder = msgspec.msgpack.Encoder()
    core = None
    try:
        from specserve.distributed.parallel_state import share_cpu_cores
        share_cpu_cores(config.device, config.tensor_parallel_size, config.nnodes, config.data_parallel_size)
        if core_factory is None:
            from specserve.engine.core import EngineCore
            core_factory = EngineCore
        core = core_factory(config)
        outbox.send(encoder.encode(core.ready_message()))
        _CoreLoop(core, inbox, outbox, encoder, max_waiting, parent).run()
    except Exception as e:
        logger.exception("the engine core stopped on an error")
        outbox.send(encoder.encode(CoreFailed(f"{type(e).__name__}: {e}")))
    finally:
        if core is not None:
            core.close()
        inbox.close(linger=0)
        outbox.close()
        ctx.term()


@dataclass
class _Commands:
    aborted: bool = False  # whether an abort freed a request


class _CoreLoop:
    def __init__(self, core, inbox: zmq.Socket, outbox: zmq.Socket, encoder: msgspec.msgpack.Encoder,
                 max_waiting: int, parent_pid: int):
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.encoder = encoder
        self.decoder = msgspec.msgpack.Decoder(ToCore)
        self.max_waiting = max_waiting
        self.parent_pid = parent_pid
        self.num_requests_read = 0

    def run(self) -> None:
        while True:
            refused: list[CoreOutput] = []
            read = self._read_commands(refused)
            if read is None:
                return
            outputs = self.core.step() if self.core.has_unfinished_requests() else []
            # An abort changes the KV usage and queue lengths the front end reports, even with no output.
            if outputs or refused or read.aborted:
                self.outbox.send(self.encoder.encode(CoreOutputs(refused + outputs, self.core.stats(),
                                                                 self.num_requests_read)))

    def _read_commands(self, refused: list[CoreOutput]) -> _Commands | None:
        """Apply every queued command, waiting for the first while there is nothing to step; None once
        told to stop (or orphaned)."""
        while not self.core.has_unfinished_requests():
            if self.inbox.poll(_PARENT_CHECK_MS):
                break
            if os.getppid() != self.parent_pid:
                return None
        read = _Commands()
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return read
            cmd = self.decoder.decode(frame.buffer)
            if isinstance(cmd, CoreRequest):
                self.num_requests_read += 1
                error = self._add(cmd)
                if error is not None:
                    refused.append(CoreOutput(cmd.request_id, [], "abort", error=error))
            elif isinstance(cmd, CoreAbort):
                for request_id in cmd.request_ids:
                    read.aborted |= self.core.abort_request(request_id)
            elif isinstance(cmd, CoreShutdown):
                for request_id in list(self.core.scheduler.requests):
                    self.core.abort_request(request_id)
                return None

    def _add(self, cmd: CoreRequest) -> CoreError | None:
        waiting = len(self.core.scheduler.waiting)
        if waiting >= self.max_waiting:
            return CoreError("queue_full", f"the server is at capacity ({waiting} requests waiting); retry later")
        try:
            self.core.add_request(cmd)
        except InvalidRequestError as e:
            return CoreError("invalid", str(e).removeprefix(e.field + ": "), e.field)
        except Exception as e:  # bad input must never reach the step loop; report it to its sender
            logger.exception("could not add request %s", cmd.request_id)
            return CoreError("internal", f"{type(e).__name__}: {e}")
        return None
