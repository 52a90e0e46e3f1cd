"""What rank 0 sends the other ranks of a tensor-parallel group, and what they answer (workers.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specserve.config import EngineConfig
from specserve.models.loader import ModelSource
from specserve.worker.cudagraph import BatchDescriptor
from specserve.worker.staged_inputs import StagedExtra
from specserve.worker.step_path import StepPath


@dataclass
class WorkerLoaded:
    """A rank has loaded its shard: it now joins the collectives of KV sizing (every rank sizes its own
    cache, and all take the smallest count)."""


@dataclass
class WorkerReady:
    """A rank has allocated its KV cache (and captured its graphs): it follows steps from now on."""


@dataclass
class WorkerFailed:
    """A rank could not start; message says why."""

    message: str


@dataclass
class DraftFollow:
    """A step's drafting as a rank > 0 of a sharded drafter runs it beside rank 0 (ModelRunner.follow_proposal):
    how many requests draft, the largest position they draft from (the eager draft steps' metadata), and whether
    rank 0 broadcasts each draft (DraftInput.shared_picks)."""

    num_reqs: int
    max_base_position: int
    shared_picks: bool


@dataclass
class WorkerStep:
    """One step's target forward as rank 0 runs it (ModelRunner.launch), for the other ranks to run the same
    collectives in the same order: each request's query ids, lengths and block ids; a tree of drafts' position
    shift and tree bits per token (None for chains); the hidden rows of each lm_head call rank 0 makes outside
    graphs, in order (its sampling, then its verification); the number of KV-cache slot moves rank 0
    broadcasts after verifying trees outside graphs (0: none); the graphs rank 0 replays; the extras rank 0
    stages (staged_inputs.py), so that both stage the same layout; whether rank 0 shares its step's
    outputs at the step's end (StepOutputs.share_from_rank0); and a sharded drafter's drafting."""

    input_ids: np.ndarray
    query_lens: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    # The step's batch descriptor and path (worker/step_path.py): which of the rank's graphs it replays
    # (distributed/graph_following.py).
    descriptor: BatchDescriptor
    path: StepPath
    tree_shift: np.ndarray | None = None
    tree_bits: np.ndarray | None = None
    lm_head_rows: list[np.ndarray] = field(default_factory=list)
    num_tree_moves: int = 0
    extras: dict[StagedExtra, np.ndarray] = field(default_factory=dict)
    masked: bool = False
    shares_outputs: bool = False
    # A sharded drafter's drafting outside the whole step's graph: rank 0 shares its outputs (accepted counts
    # and tokens, from which the drafter's inputs are gathered) after the lm_head rows and tree moves, then every
    # rank drafts; None: the rank drafts nothing, and shares_outputs says whether the step ends with the share.
    drafting: DraftFollow | None = None


@dataclass
class WorkerHello:
    """A rank of another node, connected to rank 0's listener (rendezvous.py): which rank it is."""

    rank: int


@dataclass
class WorkerAssignment:
    """Rank 0's answer to a WorkerHello: the engine's configuration and model (its files at the same path on
    every node), which the rank builds its shard from."""

    config: EngineConfig
    source: ModelSource
