"""Rank 0's side of a tensor-parallel engine: it starts its node's ranks 1..R-1 (worker_process.py), accepts
the ranks of other nodes (rendezvous.py, worker_node.py), and sends each the steps it plans. Steps go over a
connection per rank (a pipe on node 0, a socket from other nodes), not a collective: a worker waits for the
next step as long as the engine idles, and learns of rank 0's end as its connection's end. The model's
collectives run over torch.distributed (parallel_state.py), with a timeout.
"""
from __future__ import annotations

import logging
import multiprocessing
import pickle
import threading
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener

from specserve.config import EngineConfig
from specserve.distributed.collective_probe import CollectiveProbe
from specserve.distributed.messages import (WorkerAssignment, WorkerFailed, WorkerHello, WorkerLoaded, WorkerReady,
                                            WorkerStep)
from specserve.distributed.parallel_state import (COLLECTIVE_TIMEOUT_S, TPGroup, destroy_tp_group, init_tp_group,
                                                  join_all_reduce, require_no_group)
from specserve.distributed.rendezvous import Rendezvous, rendezvous_key
from specserve.distributed.worker_process import run_worker
from specserve.errors import EngineUnavailableError
from specserve.models.arch_config import ArchConfig
from specserve.models.loader import ModelSource
from specserve.models.parallel_layers import shard_arch


# How long close() waits for each worker of node 0 to leave before it kills it.
STOP_WAIT_S = 30.0


@dataclass
class _Rank:
    rank: int
    conn: Connection
    process: multiprocessing.Process | None  # None: a rank of another node

    def describe(self) -> str:
        return f"tensor-parallel rank {self.rank} " + (f"(pid {self.process.pid})" if self.process else
                                                      "(on another node)")


def _stop(ranks: list[_Rank], wait_s: list[float]) -> None:
    """Close the connections (each worker then leaves its loop and the group), leave the group, wait up to
    wait_s[0] for each of node 0's workers (then kill it). Leaving is local (parallel_state.py), so no rank
    waits for another to leave."""
    for r in ranks:
        r.conn.close()
    destroy_tp_group()
    for r in ranks:
        if r.process is not None:
            r.process.join(timeout=wait_s[0])
            if r.process.is_alive():
                r.process.kill()
                r.process.join()


class TPWorkers:
    """Ranks 1..N-1, started (node 0's) or accepted (other nodes') and joined to this process's group (rank 0)
    at construction."""

    def __init__(self, config: EngineConfig, source: ModelSource):
        size = config.tensor_parallel_size
        # A model that cannot be sharded fails here, before any process starts.
        shard_arch(ArchConfig.from_hf_config(source.hf_config), TPGroup(0, size))
        require_no_group()
        rendezvous = config.rendezvous()
        rendezvous.require_free_ports()
        self.ranks: list[_Rank] = []
        # How long a worker may take to leave once its connection closed: one that follows steps leaves at
        # once; during start-up it may wait in the rendezvous or a collective that rank 0 will never join
        # (abort), where waiting is pointless.
        self._wait_s = [STOP_WAIT_S]
        self._finalizer = weakref.finalize(self, _stop, self.ranks, self._wait_s)
        spawn = multiprocessing.get_context("spawn")
        level = logging.getLogger("specserve").getEffectiveLevel()
        for rank in range(1, rendezvous.ranks_per_node(size)):
            ours, theirs = spawn.Pipe()
            p = spawn.Process(target=run_worker, name=f"specserve-tp-rank-{rank}", daemon=True,
                              args=(config, source, rank, rank, rendezvous.init_method, theirs, level))
            p.start()
            theirs.close()
            self.ranks.append(_Rank(rank, ours, p))
        if rendezvous.nnodes > 1:
            self._accept_other_nodes(config, source, rendezvous)
        try:
            init_tp_group(0, size, rendezvous.init_method, config.device)
        except RuntimeError as e:  # torch.distributed's rendezvous timed out: some rank never joined
            self.abort()
            raise EngineUnavailableError(f"the {size} tensor-parallel ranks did not all meet at "
                                         f"{rendezvous.init_method} ({e}); the workers' logs say why") from e
        try:
            join_all_reduce(config.all_reduce, config.device)
        except RuntimeError as e:
            self.abort()
            raise EngineUnavailableError(f"the ranks could not start the {config.all_reduce} all-reduce ({e}); "
                                         "start the engine with all_reduce='nccl' (--all-reduce nccl)") from e

    def _accept_other_nodes(self, config: EngineConfig, source: ModelSource, rendezvous: Rendezvous) -> None:
        """Accept the ranks of nodes 1.. at the listener, and send each the engine's configuration."""
        size = config.tensor_parallel_size
        expected = set(range(rendezvous.ranks_per_node(size), size))
        conns: list[Connection] = []
        with Listener(rendezvous.listener_address, authkey=rendezvous_key()) as listener:
            def accept() -> None:
                for _ in expected:
                    conns.append(listener.accept())

            thread = threading.Thread(target=accept, daemon=True)
            thread.start()
            thread.join(COLLECTIVE_TIMEOUT_S)
        if len(conns) < len(expected):
            for conn in conns:
                conn.close()
            self.abort()
            addr, port = rendezvous.listener_address
            raise EngineUnavailableError(
                f"{len(conns)} of the {len(expected)} tensor-parallel ranks of other nodes connected to {addr}:{port} "
                f"within {COLLECTIVE_TIMEOUT_S:.0f} s; start `specserve ... --nnodes {rendezvous.nnodes} --node-rank K "
                f"--master-addr {rendezvous.master_addr} --master-port {rendezvous.master_port}` on every other node")
        for conn in conns:
            hello = conn.recv()
            if not isinstance(hello, WorkerHello) or hello.rank not in expected:
                self.abort()
                raise EngineUnavailableError(f"a node sent {hello!r} where one of ranks {sorted(expected)} was "
                                             "expected; start every node with the same --tensor-parallel-size "
                                             "and --nnodes")
            expected.discard(hello.rank)
            conn.send(WorkerAssignment(config, source))
            self.ranks.append(_Rank(hello.rank, conn, None))
        self.ranks.sort(key=lambda r: r.rank)

    def wait_until_loaded(self) -> None:
        """Wait until every rank has its shard: only then may rank 0 enter the collectives of KV sizing (a rank
        that failed to load would leave them waiting)."""
        self._wait_for(WorkerLoaded)

    def wait_until_ready(self) -> None:
        """Wait until every rank has allocated its KV cache."""
        self._wait_for(WorkerReady)

    def _wait_for(self, message: type) -> None:
        for r in self.ranks:
            if not r.conn.poll(COLLECTIVE_TIMEOUT_S):
                self._fail(r, "did not start in time")
            try:
                answer = r.conn.recv()
            except (EOFError, ConnectionResetError):
                self._fail(r, "exited during start-up")
            if isinstance(answer, WorkerFailed):
                self._fail(r, f"could not start:\n{answer.message}")
            assert isinstance(answer, message), answer

    def send_step(self, step: WorkerStep | CollectiveProbe) -> None:
        """Send every rank the step (or probe) this rank is about to run; raises if one has died."""
        payload = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        for r in self.ranks:
            if r.process is not None and not r.process.is_alive():
                self._fail(r, f"exited (exit code {r.process.exitcode})")
            try:
                r.conn.send_bytes(payload)
            except (BrokenPipeError, ConnectionResetError, OSError):
                self._fail(r, "exited")

    @property
    def processes(self) -> list[multiprocessing.Process]:
        """Node 0's worker processes."""
        return [r.process for r in self.ranks if r.process is not None]

    def _fail(self, rank: _Rank, what: str):
        self.abort()
        raise EngineUnavailableError(f"{rank.describe()} {what}; the engine cannot run without it. Its log says "
                                     "why; start a new engine")

    def close(self) -> None:
        self._finalizer()

    def abort(self) -> None:
        """Stop the workers of an engine that failed: kill node 0's at once, whatever they wait for."""
        self._wait_s[0] = 0
        self._finalizer()
