"""What rank 0 sends the other ranks of a tensor-parallel group, and what they answer (workers.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class WorkerSetup:
    """The KV cache's size in blocks, which rank 0 chose: every rank holds the same blocks."""

    num_kv_blocks: int


@dataclass
class WorkerReady:
    """A rank has loaded its shard and allocated its KV cache."""


@dataclass
class WorkerFailed:
    """A rank could not start; message says why."""

    message: str


@dataclass
class WorkerStep:
    """One step's forward as rank 0 stages it (ModelRunner.launch): each request's query ids, lengths and
    block ids, and the rows whose logits rank 0 computes (None: no row samples this step)."""

    input_ids: np.ndarray
    query_lens: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    sample_index: np.ndarray | None
