"""The main of ranks 1..N-1 of a tensor-parallel engine: build the rank's shard and KV cache, then run every
step rank 0 sends (workers.py), until rank 0 closes its end of the pipe."""
from __future__ import annotations

import logging
import traceback

import torch

from specserve.attention.backend import get_attention_backend
from specserve.config import EngineConfig
from specserve.distributed.messages import WorkerFailed, WorkerReady, WorkerSetup, WorkerStep
from specserve.distributed.parallel_state import destroy_tp_group, init_tp_group, tp_group
from specserve.models.loader import ModelSource, build_model
from specserve.worker.model_runner import ModelRunner
from specserve.worker.staged_inputs import StagedExtra



def run_worker(config: EngineConfig, source: ModelSource, rank: int, port: int, conn, log_level: int) -> None:
    logging.basicConfig(level=log_level)
    init_tp_group(rank, config.tensor_parallel_size, port, config.device)
    try:
        runner = _start(config, source, rank, conn)
    except Exception:  # noqa: BLE001 -- any failure to start is reported to rank 0, which raises it
        conn.send(WorkerFailed(traceback.format_exc()))
        destroy_tp_group()
        return
    try:
        while True:
            try:
                step = conn.recv()
            except EOFError:  # rank 0 closed the engine, or exited
                break
            follow_step(runner, step)
    finally:
        destroy_tp_group()


def _start(config: EngineConfig, source: ModelSource, rank: int, conn) -> ModelRunner:
    if config.device.startswith("cuda"):
        config.device = f"cuda:{rank}"
        torch.cuda.set_device(config.device)
    backend = get_attention_backend(config.attention_backend)
    model, arch = build_model(source, config.torch_dtype, config.device, backend, load_format=config.load_format,
                              seed=config.seed, tp=tp_group())
    config.finalize(arch.max_context)
    runner = ModelRunner(model, model.cfg, config)
    setup: WorkerSetup = conn.recv()
    runner.kv.allocate(setup.num_kv_blocks)
    conn.send(WorkerReady())
    return runner


@torch.inference_mode()
def follow_step(runner: ModelRunner, step: WorkerStep) -> None:
    """The rank's part of rank 0's step: the same forward over its shard, and lm_head over the rows rank 0
    samples, so that every rank runs the same collectives in the same order. Only rank 0 samples."""
    extras = {} if step.sample_index is None else {StagedExtra.SAMPLE_INDEX: step.sample_index}
    b = runner.buffers
    metadata = b.prepare(step.input_ids, step.query_lens, step.seq_lens, step.block_table, runner.block_size, extras)
    b.spread()
    n = len(step.input_ids)
    hidden, _ = runner.model(b.input_ids[:n], b.positions[:n], runner.kv.layers, metadata)
    if step.sample_index is not None:
        runner.model.compute_logits(hidden.index_select(0, b.staged_extra(StagedExtra.SAMPLE_INDEX)))
