"""Tensor parallelism on the CPU: two ranks over gloo give TP=1's greedy tokens (float32), with batching,
chunked prefill, prefix-cache hits and preemption; the errors that name the fix; workers that stop."""
from __future__ import annotations

import dataclasses
import gc
import os
import signal

import pytest

from specserve import LLM, SamplingParams
from specserve.distributed.parallel_state import TPGroup
from specserve.errors import ConfigError, EngineUnavailableError
from specserve.models.arch_config import ArchConfig
from specserve.models.parallel_layers import shard_arch
from tests.conftest import make_hf_model, repetitive_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _generate(path, batches, **kwargs):
    """The outputs of each batch of prompts, run one after another on one fresh engine, closed afterwards."""
    llm = LLM(str(path), dtype="float32", device="cpu", **kwargs)
    try:
        return [llm.generate(prompts, GREEDY, use_tqdm=False) for prompts in batches]
    finally:
        llm.engine.core.close()


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_tp2_greedy_equals_tp1_with_prefix_hits_chunks_preemption_and_one_kv_head(tmp_path, tokenizer_dir):
    """One KV head for two ranks (each rank keeps a copy of it), chunks of 16 tokens, 10 blocks of 16 that cannot
    hold 6 requests of up to 96 tokens at once, then a batch repeating prompts whose full blocks the prefix cache
    holds. Two sharded KV heads are run at TP=2 by tests/distributed/test_tp_engines.py and test_tp_graphs.py."""
    hf = make_hf_model(tmp_path, tokenizer_dir, "llama", num_key_value_heads=1)
    prompts = repetitive_prompts(hf.config.vocab_size, n=6, seed=5)
    batches = [prompts, prompts[-2:]]
    cfg = dict(max_model_len=128, block_size=16, num_kv_blocks=10, max_num_batched_tokens=16)
    want = _generate(tmp_path, batches, **cfg)
    got = _generate(tmp_path, batches, tensor_parallel_size=2, **cfg)
    assert [_tokens(b) for b in got] == [_tokens(b) for b in want]
    assert max(len(p) for p in prompts) > 16
    assert sum(o.metrics.num_preemptions for o in got[0]) > 0
    assert sum(o.metrics.num_cached_tokens for o in got[1]) > 0


def test_workers_stop_when_the_engine_is_collected(tiny_llama):
    llm = LLM(str(tiny_llama[0]), device="cpu", tensor_parallel_size=2)
    processes = llm.engine.core.tp_workers.processes
    assert all(p.is_alive() for p in processes)
    del llm
    gc.collect()
    assert not any(p.is_alive() for p in processes)


def test_a_dead_worker_fails_the_engine(tiny_llama):
    llm = LLM(str(tiny_llama[0]), device="cpu", tensor_parallel_size=2)
    worker = llm.engine.core.tp_workers.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()
    with pytest.raises(EngineUnavailableError, match="tensor-parallel rank 1"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("kwargs, field", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size"),  # 4 heads
    (dict(tensor_parallel_size=2, debug_cudagraph=True), "debug_cudagraph"),
    (dict(tensor_parallel_size=2, all_reduce="ring"), "all_reduce"),
    (dict(all_reduce="one_shot"), "all_reduce"),  # one rank: nothing to all-reduce
    (dict(tensor_parallel_size=2, all_reduce="one_shot"), "all_reduce"),  # a GPU kernel, on the CPU
])
def test_config_errors_name_the_fix(tiny_llama, kwargs, field):
    with pytest.raises(ConfigError) as e:
        LLM(str(tiny_llama[0]), device="cpu", **kwargs)
    assert e.value.field == field


def test_shard_arch_checks_kv_heads():
    arch = ArchConfig("LlamaForCausalLM", 100, 96, 96, 1, 12, 3, 8, 1e-5, 1e4, 64, False)
    with pytest.raises(ConfigError, match="KV heads"):
        shard_arch(arch, TPGroup(0, 2))
    assert shard_arch(arch, TPGroup(1, 6)).num_kv_heads == 1  # replicated: two ranks a head
    assert dataclasses.astuple(shard_arch(arch, TPGroup(0, 3)))[5:8] == (4, 1, 8)
