"""The processes of an engine on the CPU (its ranks, its replicas' engine cores) share the node's cores."""
from __future__ import annotations

import os

import pytest
import torch

from specserve.distributed.parallel_state import share_cpu_cores


@pytest.fixture
def eight_cpus(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("tp, nnodes, dp, threads", [(2, 1, 1, 4), (4, 2, 1, 4), (2, 1, 2, 2), (1, 1, 4, 2),
                                                     (16, 1, 1, 1)])
def test_each_process_takes_its_share_of_the_nodes_cores(eight_cpus, tp, nnodes, dp, threads):
    share_cpu_cores("cpu", tp, nnodes, dp)
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("device, tp", [("cpu", 1), ("cuda:0", 2)])
def test_an_engine_of_one_process_or_on_gpus_leaves_torchs_choice(eight_cpus, device, tp):
    torch.set_num_threads(3)
    share_cpu_cores(device, tp, 1, 1)
    assert torch.get_num_threads() == 3
