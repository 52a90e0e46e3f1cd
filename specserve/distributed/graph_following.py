"""CUDA graphs under tensor parallelism (docs/design.md, 'Tensor parallelism'): every rank records the same
graphs in the same order, and replays the one rank 0's step names.

A graph that holds a collective holds it on every rank: NCCL's kernels are recorded into each rank's graph
and meet again at every replay. Rank 0 alone chooses: before it records each part of its graphs (the
target's, the greedy sampling and verification's, a whole step's) it sends the part and its descriptors
(CaptureGraphs), and each other rank records its own body of that part for the same descriptors, with the
same kind of recorder. A rank's body runs the collectives rank 0's body runs, and nothing else: the
target's forward; lm_head over the rows whose logits rank 0 takes; a whole tree step's KV-cache moves,
which rank 0 broadcasts; a sharded drafter's graphs (the same DrafterGraphs capture as rank 0's, and its
drafts inside the whole step, a tree's after the walk retraced from the outputs rank 0 shares instead of
the moves). Rank 0's sampling and verification, and a drafter whole on rank 0, need
no other rank. Each step then names its descriptor and path (WorkerStep), and the rank replays that
part's graph, or fails if it has none (a rank that ran other collectives would hang the group).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from specserve.distributed.communication import broadcast_from_rank0
from specserve.spec_decode.tree_verify import move_kv
from specserve.worker.cudagraph import BatchDescriptor, CUDAGraphManager
from specserve.worker.cudagraph_mode import CUDAGraphMode
from specserve.worker.graph_recorder import AttentionSplitter, CudaGraphRecorder, EagerRecorder


class GraphPart(Enum):
    TARGET = "target"
    GREEDY = "greedy sampling"
    WHOLE_STEP = "whole step"
    WHOLE_TREE_STEP = "whole tree step"
    DRAFTER = "drafter"  # a sharded drafter's graphs (spec_decode/drafter_graphs.py)


@dataclass
class CaptureGraphs:
    """Rank 0 records `part`'s graphs for `descriptors` in this order, under `mode` (the target's mode; the
    others are full graphs), with the CPU stand-in recorder (EagerRecorder) where stand_in."""

    part: GraphPart
    mode: CUDAGraphMode
    descriptors: list[BatchDescriptor]
    stand_in: bool
    tree_depth: int = 0  # WHOLE_TREE_STEP: the KV moves per request that rank 0 broadcasts
    # TARGET and DRAFTER: rank 0's capture sizes, from which the rank builds the same target manager and the
    # drafter the same graphs (their descriptors and dispatch).
    sizes: list[int] = field(default_factory=list)


@dataclass
class CaptureDone:
    """Rank 0 has recorded all its graphs."""


def capture_message(part: GraphPart, mode: CUDAGraphMode, descriptors, recorder, tree_depth: int = 0,
                    sizes=()) -> CaptureGraphs:
    return CaptureGraphs(part, mode, list(descriptors), isinstance(recorder, EagerRecorder), tree_depth,
                         list(sizes))


class GraphFollower:
    """A rank's graphs of rank 0's parts, recorded into the runner's managers (graphs, greedy_graphs,
    whole_step_graphs) so that its steps replay them as rank 0's do."""

    def __init__(self, runner, backend):
        self.runner = runner
        self.backend = backend
        self.recorder = None
        self.splitter: AttentionSplitter | None = None
        self.tree_depth = 0

    def capture(self, msg: CaptureGraphs) -> None:
        r = self.runner
        if msg.part is GraphPart.TARGET:
            self.recorder = EagerRecorder() if msg.stand_in else CudaGraphRecorder(r.device)
            self.splitter = AttentionSplitter(self.backend)
            self.splitter.install(r.model)
            r.graphs = r.target_graph_manager(msg.mode, msg.sizes, self.recorder, self.splitter)
            r.graphs.capture(r._target_forward, r._prepare_capture, msg.descriptors)
        elif msg.part is GraphPart.GREEDY:
            r.greedy_graphs = self._manager(msg)
            r.greedy_graphs.capture(self._greedy_logits, r._prepare_capture, msg.descriptors)
        elif msg.part is GraphPart.DRAFTER:
            # The same call as rank 0's (TargetGraphs.capture_graphs): the same graphs in the same order.
            r.speculator.capture_graphs(r.graphs, self.splitter, self.recorder, msg.sizes, r.config.debug_cudagraph,
                                        r._prepare_capture, r.draft_base_positions, r.draft_block_table,
                                        r.config.drafter_sharded)
        else:
            self.tree_depth = msg.tree_depth
            if r.tree is not None and r.speculator is not None:
                # A sharded drafter's whole tree step retraces rank 0's walk over the same fixed indices.
                r.uniform_verify = r.uniform_verify_inputs()
            r.whole_step_graphs = self._manager(msg)
            r.whole_step_graphs.capture(self._whole_step, r._prepare_capture, msg.descriptors)

    def done(self) -> None:
        self.runner.buffers.reset()

    def _manager(self, msg: CaptureGraphs, splitter: AttentionSplitter | None = None) -> CUDAGraphManager:
        # Descriptors come from rank 0, so the manager needs no sizes of its own: it records and replays.
        cfg = self.runner.config
        return CUDAGraphManager(msg.part.value, msg.mode, [], cfg.max_num_seqs, cfg.max_num_batched_tokens, (),
                                self.recorder, splitter=splitter)

    def _greedy_logits(self, desc: BatchDescriptor, metadata) -> torch.Tensor:
        """lm_head over the target graph's rows for desc, as rank 0's greedy graph (TargetGraphs._greedy_outputs)."""
        padded_hidden = self.runner.graphs.graphs[desc.key].outputs[0]
        return self.runner.model.lm_head(padded_hidden[: desc.num_reqs * desc.query_len])

    def _whole_step(self, desc: BatchDescriptor, metadata) -> torch.Tensor:
        """The collectives of rank 0's whole step (TargetGraphs._whole_step, _whole_tree_step), after the
        in-flight requests' inputs that the step takes from rank 0's shared outputs; with a sharded drafter, its
        drafts, from the outputs rank 0 shares after verifying (a tree's walk retraced from them)."""
        r, n = self.runner, desc.num_reqs
        r.buffers.spread()
        r.fill_inflight_inputs(n)
        padded_hidden, padded_aux = r._target_forward(desc, metadata)
        logits = r.model.lm_head(padded_hidden[: n * desc.query_len])
        if self.tree_depth:
            moves = torch.empty(2, n * self.tree_depth, dtype=torch.int64, device=logits.device)
            move_kv(r.kv.stack, *broadcast_from_rank0(moves))
        if r.speculator is not None:  # a sharded drafter drafts here, from the outputs rank 0 shares first
            r.outputs.share_from_rank0(n)
            target_out = (padded_hidden, padded_aux)
            if r.tree is None:
                r.draft_in_whole_step(desc, target_out, metadata)
            else:
                v = r.uniform_verify
                outcome = r.retrace_trees(v.index[:n], v.num_drafts[:n], v.rows[:n])
                r.draft_tree_in_whole_step(desc, target_out, metadata, outcome)
        elif r.shares_outputs:
            r.outputs.share_from_rank0(n)
        return logits


def require_graph(manager: CUDAGraphManager | None, desc: BatchDescriptor, part: str) -> CUDAGraphManager:
    """The manager that has desc's graph, which rank 0 replays this step."""
    if manager is None or not manager.has_graph(desc):
        raise RuntimeError(f"rank 0 replays its {part} graph for {desc}, which this rank did not record; the ranks "
                           "recorded different graphs")
    return manager
