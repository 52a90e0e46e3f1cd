"""Several tensor-parallel engines in one process, one after another, and engines that fail to start: each
failure raises an error naming its cause instead of hanging, and leaves the process free for the next engine."""
from __future__ import annotations

import multiprocessing
import socket
import time

import pytest
import torch.distributed as dist

from specserve import LLM
from specserve.errors import ConfigError
from tests.conftest import repetitive_prompts
from tests.distributed.greedy_tokens import greedy_tokens



def _tokens(path, prompts, **kwargs):
    return greedy_tokens(path, prompts, 8, max_model_len=128, num_kv_blocks=32, **kwargs)


def test_tp2_with_the_start_up_warm_up(tiny_llama):
    """Both ranks run every kind of warm-up scenario (prefills alone, on a cached prefix and together, decode
    batches, chunks) and stay in step; a small engine keeps the plan short."""
    path, hf = tiny_llama
    prompts = repetitive_prompts(hf.config.vocab_size, n=3, seed=1)
    small = dict(max_num_seqs=3, max_num_batched_tokens=32)
    want = _tokens(path, prompts, **small)
    assert _tokens(path, prompts, tensor_parallel_size=2, warmup=True, **small) == want


def test_a_failed_start_leaves_the_process_free_for_the_next_engine(tiny_llama, tmp_path):
    """Rank 0 fails after its worker started (its drafter's directory holds no head) while the worker goes on
    into the collective of KV sizing: the error names the cause at once, the worker is gone, and the next
    engine of the process starts and gives one rank's tokens."""
    path, hf = tiny_llama
    start = time.monotonic()
    with pytest.raises(ConfigError, match="speculative_config.model") as failure:
        _tokens(path, [[5, 6, 7]], tensor_parallel_size=2,
                speculative_config={"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 2})
    assert time.monotonic() - start < 30  # within the workers' join, far from the collective timeout
    assert not dist.is_initialized()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("specserve-tp-rank")]
    del failure  # its traceback holds the failed core
    prompts = repetitive_prompts(hf.config.vocab_size, n=2, seed=2)
    assert _tokens(path, prompts, tensor_parallel_size=2) == _tokens(path, prompts)


def test_a_taken_port_is_refused_before_any_rank_starts(tiny_llama):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(ConfigError, match=f"master_port: port {port} .* in use"):
            LLM(str(tiny_llama[0]), device="cpu", num_kv_blocks=32, tensor_parallel_size=2, master_port=port)
        assert time.monotonic() - start < 10
    assert not dist.is_initialized()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("specserve-tp-rank")]


def test_two_engines_in_turn_meet_at_the_same_port(tiny_llama):
    """A second engine of the process meets where the first did (the port it closed is in TIME_WAIT)."""
    path, hf = tiny_llama
    prompts = repetitive_prompts(hf.config.vocab_size, n=2, seed=4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = _tokens(path, prompts, tensor_parallel_size=2, master_port=port)
    assert _tokens(path, prompts, tensor_parallel_size=2, master_port=port) == first == _tokens(path, prompts)
