"""Rank 0's side of a tensor-parallel engine: it starts ranks 1..N-1 (worker_process.py) and sends each the
steps it plans. Steps go over a pipe per rank, not a collective: a worker waits for the next step as long as
the engine idles, and learns of rank 0's end as the pipe's end. The model's collectives run over
torch.distributed (parallel_state.py), with a timeout.
"""
from __future__ import annotations

import logging
import multiprocessing
import pickle
import socket
import weakref

from specserve.config import EngineConfig
from specserve.distributed.collective_probe import CollectiveProbe
from specserve.distributed.messages import WorkerFailed, WorkerLoaded, WorkerReady, WorkerStep
from specserve.distributed.parallel_state import (COLLECTIVE_TIMEOUT_S, TPGroup, destroy_tp_group, init_tp_group,
                                                  require_no_group)
from specserve.distributed.worker_process import run_worker
from specserve.errors import EngineUnavailableError
from specserve.models.arch_config import ArchConfig
from specserve.models.loader import ModelSource
from specserve.models.parallel_layers import shard_arch



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(conns, processes) -> None:
    """Close the pipes (each worker then leaves its loop), wait for the workers, and leave the group."""
    for conn in conns:
        conn.close()
    for p in processes:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join()
    destroy_tp_group()


class TPWorkers:
    """Ranks 1..N-1, started and joined to this process's group (rank 0) at construction."""

    def __init__(self, config: EngineConfig, source: ModelSource):
        # A model that cannot be sharded fails here, before any process starts.
        shard_arch(ArchConfig.from_hf_config(source.hf_config), TPGroup(0, config.tensor_parallel_size))
        require_no_group()
        spawn = multiprocessing.get_context("spawn")
        port = _free_port()
        self.conns, self.processes = [], []
        level = logging.getLogger("specserve").getEffectiveLevel()
        for rank in range(1, config.tensor_parallel_size):
            ours, theirs = spawn.Pipe()
            p = spawn.Process(target=run_worker, name=f"specserve-tp-rank-{rank}", daemon=True,
                              args=(config, source, rank, port, theirs, level))
            p.start()
            theirs.close()
            self.conns.append(ours)
            self.processes.append(p)
        self._finalizer = weakref.finalize(self, _stop, self.conns, self.processes)
        init_tp_group(0, config.tensor_parallel_size, port, config.device)

    def wait_until_loaded(self) -> None:
        """Wait until every rank has its shard: only then may rank 0 enter the collectives of KV sizing (a rank
        that failed to load would leave them waiting)."""
        self._wait_for(WorkerLoaded)

    def wait_until_ready(self) -> None:
        """Wait until every rank has allocated its KV cache."""
        self._wait_for(WorkerReady)

    def _wait_for(self, message: type) -> None:
        for rank, (conn, p) in enumerate(zip(self.conns, self.processes), start=1):
            if not conn.poll(COLLECTIVE_TIMEOUT_S):
                self._fail(rank, p, "did not start in time")
            try:
                answer = conn.recv()
            except EOFError:
                self._fail(rank, p, "exited during start-up")
            if isinstance(answer, WorkerFailed):
                self._fail(rank, p, f"could not start:\n{answer.message}")
            assert isinstance(answer, message), answer

    def send_step(self, step: WorkerStep | CollectiveProbe) -> None:
        """Send every rank the step (or probe) this rank is about to run; raises if one has died."""
        payload = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, (conn, p) in enumerate(zip(self.conns, self.processes), start=1):
            if not p.is_alive():
                self._fail(rank, p, f"exited (exit code {p.exitcode})")
            try:
                conn.send_bytes(payload)
            except (BrokenPipeError, ConnectionResetError):
                self._fail(rank, p, "exited")

    def _fail(self, rank: int, process, what: str):
        self.close()
        raise EngineUnavailableError(f"tensor-parallel rank {rank} (pid {process.pid}) {what}; the engine "
                                     "cannot run without it. Its log above says why; start a new engine")

    def close(self) -> None:
        self._finalizer()
