"""Several nodes on one host: node 1 a separate launch of `specserve serve --node-rank 1`, meeting node 0's engine
at --master-addr/--master-port (gloo), gives TP=1's greedy tokens; and the rendezvous's errors name the fix."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.distributed.rendezvous import Rendezvous
from specserve.errors import ConfigError
from tests.conftest import repetitive_prompts
from tests.distributed.greedy_tokens import greedy_tokens

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tokens(path, prompts, **kwargs):
    return greedy_tokens(path, prompts, 12, **kwargs)


def test_two_nodes_of_one_rank_each_equal_tp1(tiny_llama):
    path, hf = tiny_llama
    prompts = repetitive_prompts(hf.config.vocab_size, n=4, seed=13)
    port = _free_port()
    node1 = subprocess.Popen(
        [sys.executable, "-m", "specserve.entrypoints.cli", "serve", "--model", str(path), "--device", "cpu",
         "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
         "--master-port", str(port)],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        got = _tokens(path, prompts, tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=port)
        # Node 1 returns once node 0's engine has closed: its rank saw its connection's end.
        log, _ = node1.communicate(timeout=60)
    finally:
        node1.kill()
    assert node1.returncode == 0, log
    assert "ranks 1..1 started" in log
    assert got == _tokens(path, prompts)


def test_rendezvous_errors_name_the_fix(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ConfigError, match="pass master_addr and master_port") as e:
        Rendezvous.resolve(4, nnodes=2)
    assert e.value.field == "master_addr"
    with pytest.raises(ConfigError, match="choose nnodes dividing") as e:
        Rendezvous.resolve(2, nnodes=3, master_addr="10.0.0.1", master_port=29500)
    assert e.value.field == "nnodes"
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    r = Rendezvous.resolve(4, nnodes=2)
    assert (r.init_method, r.listener_address, r.ranks_per_node(4)) == ("tcp://10.0.0.1:29500", ("10.0.0.1", 29501), 2)


def test_a_worker_node_rank_out_of_range_is_refused():
    from specserve.distributed.worker_node import run_worker_node

    with pytest.raises(ConfigError, match=r"must be in \[1, 1\]"):
        run_worker_node(2, Rendezvous("127.0.0.1", 29500, nnodes=2), node_rank=2)
