"""A node other than node 0 of a tensor-parallel engine (rendezvous.py): it starts its ranks, each of which
connects to rank 0's listener, receives the engine's configuration and follows its steps; the node's command
returns when every rank has stopped (rank 0 closed the engine or exited)."""
from __future__ import annotations

import logging
import multiprocessing
import time
from multiprocessing.connection import Client

from specserve.distributed.messages import WorkerAssignment, WorkerHello
from specserve.distributed.parallel_state import COLLECTIVE_TIMEOUT_S
from specserve.distributed.rendezvous import Rendezvous, rendezvous_key
from specserve.distributed.worker_process import run_worker
from specserve.errors import ConfigError

logger = logging.getLogger(__name__)


def run_worker_node(tensor_parallel_size: int, rendezvous: Rendezvous, node_rank: int) -> int:
    """Run node node_rank's ranks until they stop; returns how many failed (exited non-zero)."""
    if type(node_rank) is not int or not 1 <= node_rank < rendezvous.nnodes:
        raise ConfigError("node_rank", f"a worker node's rank must be in [1, {rendezvous.nnodes - 1}] (node 0 runs "
                          f"the engine), got {node_rank!r}")
    per_node = rendezvous.ranks_per_node(tensor_parallel_size)
    spawn = multiprocessing.get_context("spawn")
    level = logging.getLogger("specserve").getEffectiveLevel()
    processes = [spawn.Process(target=_run_rank, name=f"specserve-tp-rank-{node_rank * per_node + i}",
                               args=(rendezvous, node_rank * per_node + i, i, level)) for i in range(per_node)]
    for p in processes:
        p.start()
    logger.info("node %d: ranks %d..%d started, meeting rank 0 at %s", node_rank, node_rank * per_node,
                (node_rank + 1) * per_node - 1, rendezvous.init_method)
    for p in processes:
        p.join()
    return sum(p.exitcode != 0 for p in processes)


def _run_rank(rendezvous: Rendezvous, rank: int, local_rank: int, log_level: int) -> None:
    conn = _connect(rendezvous)
    conn.send(WorkerHello(rank))
    assignment: WorkerAssignment = conn.recv()
    run_worker(assignment.config, assignment.source, rank, local_rank, rendezvous.init_method, conn, log_level)


def _connect(rendezvous: Rendezvous):
    """A connection to rank 0's listener, retried while node 0 starts (up to the collective timeout)."""
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
    while True:
        try:
            return Client(rendezvous.listener_address, authkey=rendezvous_key())
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                addr, port = rendezvous.listener_address
                raise RuntimeError(f"node 0's engine did not listen at {addr}:{port} within "
                                   f"{COLLECTIVE_TIMEOUT_S:.0f} s; start it with the same --master-addr, "
                                   "--master-port and --nnodes") from None
            time.sleep(0.2)
