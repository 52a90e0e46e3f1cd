"""Where the ranks of a tensor-parallel engine meet, on one node or several (docs/design.md, 'Tensor
parallelism'; README, 'Several nodes').

Ranks are numbered node by node: node k runs ranks k * R .. (k + 1) * R - 1, R = tensor_parallel_size /
nnodes, rank k * R + i on its GPU i. Node 0 runs the engine (rank 0) and starts its own other ranks; every
other node runs `specserve ... --node-rank k`, which starts that node's ranks. All meet at two ports of node
0: torch.distributed's store at master_addr:master_port, and rank 0's listener for the ranks of other nodes
at master_port + 1, over which they receive the engine's configuration and then its steps.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from specserve.errors import ConfigError

# The key the ranks of other nodes prove they belong to the engine with (multiprocessing's HMAC handshake);
# set SPECSERVE_RENDEZVOUS_KEY to the same secret on every node. The ports must be reachable from the
# other nodes only, as torch.distributed's own store is.
_DEFAULT_KEY = "specserve-tensor-parallel"


def rendezvous_key() -> bytes:
    return os.environ.get("SPECSERVE_RENDEZVOUS_KEY", _DEFAULT_KEY).encode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Rendezvous:
    master_addr: str
    master_port: int
    nnodes: int = 1

    @classmethod
    def resolve(cls, tensor_parallel_size: int, nnodes: int = 1, master_addr: str | None = None,
                master_port: int | None = None) -> Rendezvous:
        """The rendezvous of an engine: the address and port given, else MASTER_ADDR / MASTER_PORT, else (one
        node only) 127.0.0.1 and a free port. Raises ConfigError naming the fix."""
        if type(nnodes) is not int or nnodes < 1:
            raise ConfigError("nnodes", f"must be an integer >= 1, got {nnodes!r}")
        if tensor_parallel_size % nnodes:
            raise ConfigError("nnodes", f"{nnodes} nodes cannot each run the same number of the "
                              f"{tensor_parallel_size} ranks; choose nnodes dividing tensor_parallel_size")
        addr = master_addr or os.environ.get("MASTER_ADDR")
        port = master_port if master_port is not None else os.environ.get("MASTER_PORT")
        if nnodes > 1 and (addr is None or port is None):
            raise ConfigError("master_addr", f"{nnodes} nodes meet at node 0's address and port: pass master_addr "
                              "and master_port (--master-addr, --master-port) or set MASTER_ADDR and MASTER_PORT, "
                              "the same on every node")
        try:
            port = _free_port() if port is None else int(port)
        except ValueError as e:
            raise ConfigError("master_port", f"must be a port number, got {port!r}") from e
        if not 1 <= port < 65535:
            raise ConfigError("master_port", f"must be in [1, 65534] (master_port + 1 is used too), got {port}")
        return cls(addr or "127.0.0.1", port, nnodes)

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    @property
    def listener_address(self) -> tuple[str, int]:
        """Rank 0's listener for the ranks of other nodes."""
        return self.master_addr, self.master_port + 1

    def require_free_ports(self) -> None:
        """Raises ConfigError naming the port if one that node 0 listens at is taken by a listening socket:
        torch.distributed's store at master_port (bound on every interface) and, with other nodes, the listener
        at master_port + 1. Checked before any rank starts, since ranks that meet at a port some other program
        holds wait there until the collective timeout. A port an earlier engine of this process closed (in
        TIME_WAIT) is free: both bind with address reuse."""
        ports = [("", self.master_port)] + ([self.listener_address] if self.nnodes > 1 else [])
        for addr, port in ports:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((addr, port))
                except OSError as e:
                    raise ConfigError("master_port", (
                        f"port {port} of {addr or 'this host'}, where the tensor-parallel ranks meet, is in use "
                        f"({e.strerror}): another engine or program listens there. Pass another master_port "
                        "(--master-port, MASTER_PORT; port + 1 too with several nodes), or leave it out on one "
                        "node to take a free port")) from None

    def ranks_per_node(self, tensor_parallel_size: int) -> int:
        return tensor_parallel_size // self.nnodes
