"""One manager for a model's CUDA graphs: batch descriptors, padding, dispatch, capture, replay.

A batch descriptor is the dispatch key (docs/design.md, 'Batch descriptors and
padding'). Under PIECEWISE only num_tokens is padded, to the next capture size;
under FULL num_tokens and num_reqs are both padded, and every per-request
buffer a graph reads must be valid for the padded rows (the owner's job:
docs/invariants.md, 'Padded rows'). Full graphs of uniform batches (every
request has query length q: 1 for decode, 1 + k when verifying k drafts) are
keyed by their padded request count, with num_tokens = num_reqs * q; mixed full
and piecewise graphs by their padded token count. A batch larger than every
capture size runs eagerly.

The owner supplies the forward as a function of a descriptor that reads and
writes only persistent buffers; the manager records it once per descriptor
(through the engine's one recorder, so all graphs share one memory pool) and
replays it. With debug on, each replay is followed by the same forward run
eagerly, and any difference raises.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from specserve.attention.metadata import AttentionMetadata
from specserve.worker.cudagraph_mode import CUDAGraphMode
from specserve.worker.graph_recorder import AttentionSplitter, RecordedGraph, flatten_tensors

logger = logging.getLogger(__name__)


class CUDAGraphMismatchError(RuntimeError):
    """A replayed graph's outputs differ from the same step run eagerly (debug_cudagraph)."""


def default_capture_sizes(limit: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256 (as vLLM) and every 32 past it, capped at `limit`."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(288, limit + 1, 32))
    return [s for s in sizes if s <= limit] or [limit]


@dataclass(frozen=True)
class BatchDescriptor:
    """How one batch runs. For NONE the sizes are the batch's own; for PIECEWISE num_tokens is padded
    and num_reqs is the batch's own; for FULL both are padded. query_len is set for uniform batches."""

    mode: CUDAGraphMode
    num_tokens: int
    num_reqs: int
    query_len: int | None = None

    @property
    def key(self) -> tuple:
        # Piecewise graphs do not depend on num_reqs: attention, the only reader of it, runs eagerly.
        if self.mode is CUDAGraphMode.PIECEWISE:
            return (self.mode, self.num_tokens)
        return (self.mode, self.num_tokens, self.num_reqs, self.query_len)


class CUDAGraphManager:
    def __init__(
        self,
        name: str,
        mode: CUDAGraphMode,
        capture_sizes: Sequence[int],
        max_num_reqs: int,
        max_num_tokens: int,
        uniform_query_lens: Sequence[int],
        recorder,
        debug: bool = False,
        splitter: AttentionSplitter | None = None,
        single_request_query_lens: Sequence[int] = (),
        generator: torch.Generator | None = None,
    ):
        self.name = name
        self.mode = mode
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.uniform_query_lens = tuple(sorted(set(uniform_query_lens)))
        self.recorder = recorder
        self.debug = debug
        self.splitter = splitter
        # The generator the graphs draw from, registered with each full graph so that a replay draws new numbers
        # (a piecewise graph's draws would repeat the recording's).
        self.generator = generator
        if generator is not None and mode.has_piecewise:
            raise ValueError(f"{name}: graphs that draw random numbers must be full graphs, not {mode.name}")
        if mode.has_piecewise and splitter is None:
            raise ValueError(f"{name}: mode {mode.name} records piecewise graphs and needs an AttentionSplitter")
        # Piecewise and mixed full graphs: sizes are token counts; uniform full graphs: request counts.
        self.token_sizes = sorted(s for s in capture_sizes if s <= max_num_tokens)
        self.req_sizes = {q: sorted(s for s in capture_sizes if s <= max_num_reqs and s * q <= max_num_tokens)
                          for q in self.uniform_query_lens}
        # One request's query of these lengths runs as a full graph too, in one graph each: the uncached tail of
        # a prompt the prefix cache holds is at most a block, and run piecewise its eager attention calls cost
        # the host several decode steps' time.
        self.single_request_query_lens = tuple(
            q for q in sorted(set(single_request_query_lens))
            if q not in self.req_sizes and q <= max_num_tokens and 1 in capture_sizes)
        for q in self.single_request_query_lens:
            self.req_sizes[q] = [1]
        self.graphs: dict[tuple, RecordedGraph] = {}
        # The padded attention metadata each full graph was recorded with; a drafter's graphs for the
        # same descriptor reuse it (docs/invariants.md, 'Draft step metadata').
        self.metadata: dict[tuple, AttentionMetadata] = {}

    # ---- dispatch ----------------------------------------------------------------------------

    def dispatch(self, num_tokens: int, num_reqs: int, query_len: int | None) -> BatchDescriptor:
        """The descriptor a batch runs under. query_len: every request's query length if they are equal."""
        uniform = query_len is not None and (query_len in self.uniform_query_lens or
                                             (num_reqs == 1 and query_len in self.single_request_query_lens))
        runtime = self.mode.runtime_mode(uniform_decode=uniform)
        eager = BatchDescriptor(CUDAGraphMode.NONE, num_tokens, num_reqs, query_len)
        if runtime is CUDAGraphMode.FULL:
            if uniform:
                n = _round_up(num_reqs, self.req_sizes[query_len])
                if n is not None:
                    return BatchDescriptor(runtime, n * query_len, n, query_len)
            else:
                t = _round_up(num_tokens, self.token_sizes)
                if t is not None:
                    return BatchDescriptor(runtime, t, min(t, self.max_num_reqs))
        elif runtime is CUDAGraphMode.PIECEWISE:
            t = _round_up(num_tokens, self.token_sizes)
            if t is not None:
                return BatchDescriptor(runtime, t, num_reqs)
        return eager

    def capture_descriptors(self) -> list[BatchDescriptor]:
        """Every descriptor the mode can dispatch to, largest first (smaller graphs reuse the pool)."""
        descs = []
        full, piecewise = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE
        if self.mode.has_full:
            for q, sizes in self.req_sizes.items():
                descs += [BatchDescriptor(full, n * q, n, q) for n in sizes]
        if self.mode is CUDAGraphMode.FULL:
            descs += [BatchDescriptor(full, t, min(t, self.max_num_reqs)) for t in self.token_sizes]
        if self.mode.has_piecewise:
            descs += [BatchDescriptor(piecewise, t, 0) for t in self.token_sizes]
        return sorted(descs, key=lambda d: (-d.num_tokens, d.mode.name, d.query_len or 0))

    # ---- capture and replay ------------------------------------------------------------------

    def capture(self, forward: Callable[[BatchDescriptor, AttentionMetadata], Any],
                prepare: Callable[[BatchDescriptor], AttentionMetadata],
                descriptors: Sequence[BatchDescriptor] | None = None) -> None:
        """Record forward(desc, metadata) for each descriptor. prepare(desc) fills the persistent buffers
        with a batch that writes nothing and returns the padded metadata for desc (a full graph keeps
        reading it). A warm-up eager run precedes each recording (kernel compilation, workspaces)."""
        descriptors = self.capture_descriptors() if descriptors is None else descriptors
        if not descriptors:
            return
        start = time.perf_counter()
        for desc in tqdm(descriptors, desc=f"Capturing {self.name} CUDA graphs", unit="graph", leave=False):
            metadata = prepare(desc)
            forward(desc, metadata)

            def run(desc=desc, metadata=metadata):
                return forward(desc, metadata)

            if desc.mode is CUDAGraphMode.FULL:
                self.graphs[desc.key] = self.recorder.full(run, self.generator)
                self.metadata[desc.key] = metadata
            else:
                self.graphs[desc.key] = self.recorder.piecewise(run, self.splitter)
        logger.info("%s: %d graphs (%s) captured in %.1f s", self.name, len(descriptors), self.mode.name,
                    time.perf_counter() - start)

    def has_graph(self, desc: BatchDescriptor) -> bool:
        return desc.key in self.graphs

    def run(self, desc: BatchDescriptor, forward: Callable[[BatchDescriptor, AttentionMetadata], Any],
            metadata: AttentionMetadata) -> Any:
        """Replay the graph for desc, or run forward eagerly if there is none; under debug, compare a
        replay with the eager run. metadata: the step's own, which eager and piecewise attention use
        (a full graph reads the padded metadata it was recorded with, refilled by the owner)."""
        graph = self.graphs.get(desc.key)
        if graph is None:
            return forward(desc, metadata)
        recorded = self.metadata.get(desc.key)
        if recorded is not None:
            # What a backend derived from the recorded metadata belongs to an earlier step.
            recorded.backend_state.clear()
        drawn_from = self.generator.get_state() if self.debug and self.generator is not None else None
        outputs = graph.replay(metadata)
        if self.debug:
            if drawn_from is not None:
                # The eager run draws the numbers the replay drew.
                self.generator.set_state(drawn_from)
            self._check_against_eager(desc, outputs, forward, metadata)
        return outputs

    def _check_against_eager(self, desc: BatchDescriptor, replayed: Any, forward, metadata) -> None:
        # Same shapes as the replay (padded), so the same kernels run and results must match bit for bit.
        if desc.mode is CUDAGraphMode.FULL:
            metadata = self.metadata[desc.key]
        eager = forward(desc, metadata)
        for i, (r, e) in enumerate(zip(flatten_tensors(replayed), flatten_tensors(eager))):
            if not torch.equal(r, e):
                diff = torch.where(r == e, 0.0, (r.float() - e.float()).abs().nan_to_num(float("inf"))).max().item()
                raise CUDAGraphMismatchError(
                    f"{self.name}: graph replay differs from eager for {desc} (output {i}, max abs diff {diff:.3g}); "
                    "a persistent buffer the graph reads was probably reallocated or left stale. "
                    "Run with cudagraph_mode='NONE' to continue without graphs.")


def _round_up(n: int, sizes: list[int]) -> int | None:
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None
