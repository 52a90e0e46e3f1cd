"""The main of ranks 1..N-1 of a tensor-parallel engine: build the rank's shard, size and allocate its KV cache
beside rank 0's, then run every step rank 0 sends (workers.py), until rank 0 closes its end of the connection.
A rank of node 0 is started by the engine with a pipe; a rank of another node by worker_node.py, connecting
to rank 0's listener (rendezvous.py)."""
from __future__ import annotations

import logging
import signal
import traceback

import torch

from specserve.attention.backend import get_attention_backend
from specserve.config import EngineConfig
from specserve.distributed.collective_probe import replay_collectives
from specserve.distributed.communication import broadcast_from_rank0
from specserve.distributed.graph_following import CaptureDone, CaptureGraphs, GraphFollower, require_graph
from specserve.distributed.messages import WorkerFailed, WorkerLoaded, WorkerReady, WorkerStep
from specserve.distributed.parallel_state import (destroy_tp_group, init_tp_group, join_all_reduce, rank_device,
                                                  share_cpu_cores, tp_group)
from specserve.models.loader import ModelSource, build_model
from specserve.spec_decode.factory import build_speculator
from specserve.spec_decode.tree_verify import move_kv
from specserve.worker.cudagraph_mode import CUDAGraphMode
from specserve.worker.model_runner import ModelRunner
from specserve.worker.staged_inputs import StagedExtra
from specserve.worker.step_path import Drafting, Sampling, Verification, WholeStep


def run_worker(config: EngineConfig, source: ModelSource, rank: int, local_rank: int, init_method: str, conn,
               log_level: int) -> None:
    """A rank's process: `conn` reaches rank 0, init_method is where the group meets."""
    logging.basicConfig(level=log_level, format=f"%(levelname)s rank {rank} %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group; rank 0 decides when the workers stop (its connection's end).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config.device = rank_device(config.device, local_rank)
    share_cpu_cores(config.device, config.tensor_parallel_size, config.nnodes, config.data_parallel_size)
    init_tp_group(rank, config.tensor_parallel_size, init_method, config.device)
    try:
        join_all_reduce(config.all_reduce, config.device)
        runner, follower = _start(config, source, conn)
    except Exception:  # noqa: BLE001 -- any failure to start is reported to rank 0, which raises it
        conn.send(WorkerFailed(traceback.format_exc()))
        destroy_tp_group()
        return
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, ConnectionResetError):  # rank 0 closed the engine, or exited
                break
            _follow(runner, follower, msg)
    finally:
        runner.release_graphs()  # they hold the group's collectives, which must go before the group
        destroy_tp_group()


def _follow(runner: ModelRunner, follower: GraphFollower, msg) -> None:
    """Run what rank 0 sent: a step, a part of its graph capture, or a probe of the collectives."""
    if isinstance(msg, WorkerStep):
        follow_step(runner, msg)
    elif isinstance(msg, CaptureGraphs):
        follower.capture(msg)
    elif isinstance(msg, CaptureDone):
        follower.done()
    else:
        replay_collectives(runner.model, msg)


def _start(config: EngineConfig, source: ModelSource, conn) -> tuple[ModelRunner, GraphFollower]:
    backend = get_attention_backend(config.attention_backend)
    model, arch = build_model(source, config.torch_dtype, config.device, backend, load_format=config.load_format,
                              seed=config.seed, tp=tp_group(),
                              quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype)
    config.finalize(arch.max_context)
    runner = ModelRunner(model, model.cfg, config)
    # A drafter sharded like the target (draft_tensor_parallel_size N): this rank holds its shard of the head too,
    # and drafts beside rank 0. Otherwise the drafter runs on rank 0 alone.
    spec = config.speculative_config
    if config.drafter_sharded:
        runner.set_speculator(build_speculator(spec, runner, backend), spec.forced_acceptance_prob)
    follower = GraphFollower(runner, backend)
    conn.send(WorkerLoaded())

    def follow_capture() -> None:
        """Record the graphs of rank 0's trial capture (kv_sizing.py), part by part, until it is done."""
        while not isinstance(msg := conn.recv(), CaptureDone):
            follower.capture(msg)
        follower.done()

    runner.initialize_kv_cache(backend, profile_step=lambda _: follow_step(runner, conn.recv()),
                               capture=follow_capture)
    conn.send(WorkerReady())
    return runner, follower


@torch.inference_mode()
def follow_step(runner: ModelRunner, step: WorkerStep) -> None:
    """The rank's part of rank 0's step: the same forward over its shard, lm_head over the rows rank 0 takes
    logits of, and the KV moves of verified trees, each replayed from the graph rank 0 replays, so that every
    rank runs the same collectives in the same order. Only rank 0 samples and verifies; with asynchronous
    scheduling it shares its outputs, from which every rank takes the in-flight requests' inputs. A sharded
    drafter drafts on every rank, from the outputs rank 0 shares before drafting, the trees' walks retraced
    from them."""
    b = runner.buffers
    metadata = b.prepare(step.input_ids, step.query_lens, step.seq_lens, step.block_table, runner.block_size,
                         step.extras, step.tree_shift, step.tree_bits, masked=step.masked)
    desc, path = step.descriptor, step.path
    if path.whole is not WholeStep.NONE:
        require_graph(runner.whole_step_graphs, desc, path.whole.value).run(desc, None, None)
        return
    b.spread()
    inflight = len(step.extras.get(StagedExtra.INFLIGHT, ()))
    if inflight:
        runner.fill_inflight_inputs(inflight)
    if desc.mode is not CUDAGraphMode.NONE:
        require_graph(runner.graphs, desc, "target")
    (padded_hidden, padded_aux), metadata = runner._run_target(desc, metadata)
    if path.sampling is Sampling.GREEDY_GRAPH or path.verification is Verification.GREEDY_GRAPH:
        require_graph(runner.greedy_graphs, desc, "greedy").run(desc, None, None)
    hidden = padded_hidden[:len(step.input_ids)]
    for rows in step.lm_head_rows:
        runner.model.lm_head(hidden.index_select(0, torch.from_numpy(rows).to(hidden.device)))
    if step.num_tree_moves:
        moves = torch.empty(2, step.num_tree_moves, dtype=torch.int64, device=hidden.device)
        move_kv(runner.kv.stack, *broadcast_from_rank0(moves))
    if step.drafting is not None:
        runner.outputs.share_from_rank0(len(step.query_lens))
        # Rank 0 sent no tree moves (step_following.broadcasts_tree_moves): its walk follows from its outputs.
        tree_step = runner.retrace_trees(*runner._verified_tokens()) if path.verifies_trees else None
        runner.follow_proposal(step.drafting, len(step.query_lens), desc, (padded_hidden, padded_aux), metadata,
                               path.drafting, tree_step)
    elif path.drafting is Drafting.PREFILL_ONLY and runner.config.drafter_sharded:
        runner._prefill_drafter(desc, (padded_hidden, padded_aux), metadata, len(step.query_lens))
    elif step.shares_outputs:
        runner.outputs.share_from_rank0(len(step.query_lens))
