"""Recording a forward as CUDA graphs: one whole graph (FULL) or pieces split at attention (PIECEWISE).

PIECEWISE by hand: the model's attention backend is wrapped in an
AttentionSplitter. While a piecewise graph is recorded, each attention call
ends the current piece, runs attention eagerly (on capture-time dummy
metadata, which writes and reads nothing) and starts the next piece; the call
(its static q/k/v tensors and output) is remembered. A replay then runs
piece 0, attention 0 on the step's live metadata, piece 1, ... so attention
sees each step's real num_reqs and lengths while everything else is replayed.

EagerRecorder is the CPU stand-in for torch.cuda.CUDAGraph (docs/design.md,
'Testing without a GPU'):
"replay" re-runs the recorded function, so the manager's dispatch, padding
and mode rules are tested without a GPU.
"""
from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from specserve.attention.metadata import AttentionMetadata


@dataclass
class _AttentionCall:
    method: str  # "forward" (writes the cache, then attends) or "attend" (the model wrote the cache)
    args: tuple
    kwargs: dict
    out: torch.Tensor  # static: the next piece reads it


class AttentionSplitter:
    """Wraps the attention backend every layer calls. Calls pass through, except that while a
    piecewise graph is recorded the hooks end and start pieces around each call, and while
    `live_metadata` is set every call gets it in place of the metadata it was given."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.hooks: tuple[Callable[[], None], Callable[[_AttentionCall], None]] | None = None
        self.live_metadata: AttentionMetadata | None = None

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self._call("forward", args, kwargs)

    def attend(self, *args, **kwargs) -> torch.Tensor:
        return self._call("attend", args, kwargs)

    def _call(self, method: str, args: tuple, kwargs: dict) -> torch.Tensor:
        if self.live_metadata is not None:
            args, kwargs = self._with_live_metadata(args, kwargs)
        if self.hooks is not None:
            self.hooks[0]()
        out = getattr(self.inner, method)(*args, **kwargs)
        if self.hooks is not None:
            self.hooks[1](_AttentionCall(method, args, kwargs, out))
        return out

    def _with_live_metadata(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def live(a):
            return self.live_metadata if isinstance(a, AttentionMetadata) else a

        return tuple(map(live, args)), {k: live(v) for k, v in kwargs.items()}

    def replay_call(self, call: _AttentionCall, metadata: AttentionMetadata) -> None:
        self.live_metadata = metadata
        try:
            args, kwargs = self._with_live_metadata(call.args, call.kwargs)
        finally:
            self.live_metadata = None
        call.out.copy_(getattr(self.inner, call.method)(*args, **kwargs))

    def install(self, model: torch.nn.Module) -> None:
        """Route every attention module of `model` through this splitter (in place of an earlier splitter of the
        same backend, whose graphs were released)."""
        for module in model.modules():
            backend = getattr(module, "backend", None)
            if backend is self.inner or (isinstance(backend, AttentionSplitter) and backend.inner is self.inner):
                module.backend = self


class RecordedGraph:
    """A recorded forward: replay() runs it on whatever the static inputs now hold."""

    def __init__(self, replay: Callable[[AttentionMetadata | None], None], outputs: Any, num_graphs: int):
        self._replay = replay
        self.outputs = outputs
        self.num_graphs = num_graphs

    def replay(self, live_metadata: AttentionMetadata | None = None) -> Any:
        self._replay(live_metadata)
        return self.outputs


class CudaGraphRecorder:
    """Records into torch.cuda.CUDAGraph objects, all in one memory pool shared by every graph of the
    engine (docs/design.md, 'Batch descriptors and padding'); graphs are captured largest first so smaller
    ones reuse that memory."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def full(self, fn: Callable[[], Any], generator: torch.Generator | None = None) -> RecordedGraph:
        """fn recorded; a generator it draws from is registered, so that each replay advances it as fn does."""
        graph = torch.cuda.CUDAGraph()
        if generator is not None:
            graph.register_generator_state(generator)
        with _no_collection(), torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            outputs = fn()
        return RecordedGraph(lambda _md: graph.replay(), outputs, 1)

    def piecewise(self, fn: Callable[[], Any], splitter: AttentionSplitter) -> RecordedGraph:
        pieces: list[torch.cuda.CUDAGraph] = []
        calls: list[_AttentionCall] = []

        def begin_piece() -> None:
            pieces.append(torch.cuda.CUDAGraph())
            pieces[-1].capture_begin(pool=self.pool)

        def after_attention(call: _AttentionCall) -> None:
            # The call ran eagerly between two captures; the next piece reads its output tensor.
            calls.append(call)
            begin_piece()

        torch.cuda.synchronize(self.device)
        with _no_collection(), torch.cuda.stream(self.stream):
            begin_piece()
            splitter.hooks = (lambda: pieces[-1].capture_end(), after_attention)
            try:
                outputs = fn()
            finally:
                splitter.hooks = None
            pieces[-1].capture_end()
        torch.cuda.synchronize(self.device)

        def replay(metadata: AttentionMetadata | None) -> None:
            assert metadata is not None, "a piecewise replay needs the step's live attention metadata"
            for i, piece in enumerate(pieces):
                piece.replay()
                if i < len(calls):
                    splitter.replay_call(calls[i], metadata)

        return RecordedGraph(replay, outputs, len(pieces))

    def memory_in_use(self) -> int:
        # Cached blocks outside the graph pool are released first, so a difference of two readings
        # counts what the graphs hold (their pool cannot be released while they live).
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)


@contextmanager
def _no_collection():
    """No cyclic garbage collection while a graph records: collecting an engine dropped earlier in the process
    frees its CUDA graphs, which the driver refuses during a capture, and the capture is lost ("operation not
    permitted when stream is capturing (function reset)"). The garbage waits for the next collection, after
    the capture (a collection before every capture would slow a start-up that records hundreds)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class EagerRecorder:
    """CPU stand-in for CudaGraphRecorder: replay re-runs the function on the same static inputs."""

    def __init__(self):
        self.recorded: list[str] = []

    def full(self, fn: Callable[[], Any], generator: torch.Generator | None = None) -> RecordedGraph:
        self.recorded.append("full")
        outputs = fn()

        def replay(_md) -> None:
            _copy_into(outputs, fn())

        return RecordedGraph(replay, outputs, 1)

    def piecewise(self, fn: Callable[[], Any], splitter: AttentionSplitter) -> RecordedGraph:
        self.recorded.append("piecewise")
        calls: list[_AttentionCall] = []
        splitter.hooks = (lambda: None, calls.append)
        try:
            outputs = fn()
        finally:
            splitter.hooks = None

        def replay(metadata: AttentionMetadata | None) -> None:
            assert metadata is not None, "a piecewise replay needs the step's live attention metadata"
            splitter.live_metadata = metadata
            try:
                _copy_into(outputs, fn())
            finally:
                splitter.live_metadata = None

        return RecordedGraph(replay, outputs, len(calls) + 1)

    def memory_in_use(self) -> int:
        return 0


def _copy_into(static: Any, fresh: Any) -> None:
    for s, f in zip(flatten_tensors(static), flatten_tensors(fresh)):
        s.copy_(f)


def flatten_tensors(outputs: Any) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if outputs is None:
        return []
    return [t for o in outputs for t in flatten_tensors(o)]
