"""A model drafter's CUDA graphs (spec_decode/model_drafter.py), each through a CUDAGraphManager
(worker/cudagraph.py) as the runner's are, on the engine's one pool.

- The prefill's, recorded for every descriptor the target records and in the same mode, reading the
  target's static outputs and, for full graphs, the very metadata the target's graph was recorded with
  (docs/invariants.md, 'Draft step metadata').
- The decode steps', FULL_DECODE_ONLY or NONE, never piecewise (docs/invariants.md, 'Draft decode is never
  piecewise'); a decode graph writes its float32 draft logits during replay.
- For a chain, the greedy loop's: every draft of a greedy batch in one graph per padded batch size. For a
  tree, the tree's: all its passes in one graph per padded batch size; and, unless the drafter is sharded (whose
  sampled children rank 0 alone draws), the sampled tree's, whose children a request that samples draws from
  the head with the engine's generator (spec_decode/sampled_tree.py).

All of them read only the drafter's persistent buffers. Which one a step replays is its StepPath's
decision (worker/step_path.py, DraftInput.drafting).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specserve.attention.metadata import AttentionMetadata
from specserve.spec_decode.eagle_inputs import prepare_draft_step
from specserve.spec_decode.tree_drafting import draft_tree
from specserve.worker.cudagraph import BatchDescriptor, CUDAGraphManager


class DrafterGraphs:
    """ModelDrafter's graph capture and graph bodies (mixed into ModelDrafter, whose state they use)."""

    def capture_graphs(self, target_graphs: CUDAGraphManager, splitter, recorder, sizes: Sequence[int], debug: bool,
                       target_prepare: Callable[[BatchDescriptor], AttentionMetadata],
                       base_positions: torch.Tensor, block_table: torch.Tensor, sharded: bool) -> None:
        for model in self.models():
            splitter.install(model)
        max_reqs = self.step_buffers.max_num_reqs
        self.prefill_graphs = CUDAGraphManager(
            "draft prefill", target_graphs.mode, sizes, max_reqs, self.next_ids.shape[0],
            target_graphs.uniform_query_lens, recorder, debug, splitter, target_graphs.single_request_query_lens)

        def prefill_prepare(desc: BatchDescriptor) -> AttentionMetadata:
            self.next_ids.zero_()
            metadata = target_prepare(desc)
            # A full graph reads the attention state the target's graph was recorded with, not a rebuilt one
            # (docs/invariants.md, 'Draft step metadata').
            return target_graphs.metadata.get(desc.key, metadata)

        def prefill(desc: BatchDescriptor, metadata: AttentionMetadata):
            return self._prefill(desc, metadata, target_graphs.graphs[desc.key].outputs)

        self.prefill_graphs.capture(prefill, prefill_prepare, target_graphs.capture_descriptors())
        self._loop_inputs = (base_positions, block_table)
        decode_mode = target_graphs.mode.for_draft_decode()

        def decode_prepare(desc: BatchDescriptor) -> AttentionMetadata:
            for rows in self._request_rows:
                rows.zero_()
            prepare_draft_step(1, 0, base_positions, block_table, self.block_size, self.max_position,
                               self.step_buffers)
            return self._decode_metadata(desc, block_table, self.max_position)

        def loop_prepare(desc: BatchDescriptor) -> AttentionMetadata:
            # No request is real while recording: nothing is written to the cache.
            self.step_buffers.num_reqs.zero_()
            return decode_prepare(desc)

        if self.tree_tables is not None:
            # A tree drafts in passes of its own (tree_drafting.py), all of them one graph a batch size: eager,
            # the passes' forty-odd launches would cost the host several decode steps' time at each prefill.
            self.tree_graphs = CUDAGraphManager("draft tree", decode_mode, sizes, max_reqs, max_reqs, (1,),
                                                recorder, debug)
            self.tree_graphs.capture(self._tree_in_graph, loop_prepare)
            if not sharded:
                self.sampled_tree_graphs = CUDAGraphManager("draft sampled tree", decode_mode, sizes, max_reqs,
                                                            max_reqs, (1,), recorder, debug, generator=self.generator)
                self.sampled_tree_graphs.capture(self._sampled_tree_in_graph, loop_prepare)
            self._rows_in_use = -1
            return
        self.decode_graphs = CUDAGraphManager("draft decode", decode_mode, sizes, max_reqs, max_reqs, (1,), recorder,
                                              debug)
        self.decode_graphs.capture(self._decode, decode_prepare)
        if self.num_loop_steps > 0 or self.first_hidden is not None:
            self.greedy_loop_graphs = CUDAGraphManager(
                "draft greedy loop", self.decode_graphs.mode, sizes, max_reqs, max_reqs, (1,), recorder, debug)
            self.greedy_loop_graphs.capture(self._greedy_loop, loop_prepare)
        self._rows_in_use = -1  # the captures wrote the buffers' every row

    def has_drafting_graph(self, num_reqs: int) -> bool:
        """Whether the drafts of num_reqs requests can replay one graph: a tree's passes, or a greedy chain."""
        return _has_graph(self.greedy_loop_graphs if self.tree_tables is None else self.tree_graphs, num_reqs)

    def has_sampled_tree_graph(self, num_reqs: int) -> bool:
        return _has_graph(self.sampled_tree_graphs, num_reqs)

    def release_graphs(self) -> None:
        self.prefill_graphs = self.decode_graphs = self.greedy_loop_graphs = self.tree_graphs = None
        self.sampled_tree_graphs = None
        self._loop_inputs = None

    def _replay_for(self, graphs: CUDAGraphManager, n: int, forward) -> torch.Tensor:
        """The drafts of n requests from the graph of graphs for n (a loop or a tree), which reads n from the
        device."""
        self.step_buffers.num_reqs.fill_(n)
        desc = graphs.dispatch(n, n, 1)
        return graphs.run(desc, forward, graphs.metadata[desc.key])[:n]

    def _greedy_loop(self, desc: BatchDescriptor, metadata: AttentionMetadata) -> torch.Tensor:
        """Every draft of a greedy batch: [n, k]. Draft 1 from first_hidden where the prefill drafts (else
        the loop starts from decode_tokens), then each decode step, metadata rebuilt on the device before
        each (docs/invariants.md, 'Draft step metadata'). Reads num_reqs from its device buffer, so one
        recording serves every batch padded to desc.num_reqs."""
        n = desc.num_reqs
        base_positions, block_table = self._loop_inputs
        feedback = self.feedback[:n] if self.feedback is not None else None
        drafts = []
        if self.first_hidden is not None:
            drafts.append(self.greedy_tokens(self.first_hidden[:n], captured=True))
        tokens = drafts[0] if drafts else self.decode_tokens[:n]
        for step in range(1, self.num_loop_steps + 1):
            prepare_draft_step(step, self.step_buffers.num_reqs, base_positions, block_table, self.block_size,
                               self.max_position, self.step_buffers)
            # Whatever a backend derived from the metadata belongs to the step before (the graph manager
            # clears it once per replay, and this loop runs several steps in one).
            metadata.backend_state.clear()
            tokens, feedback = self.greedy_decode_step(tokens, feedback, self.step_buffers.positions[:n], metadata)
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)

    def _tree_in_graph(self, desc: BatchDescriptor, metadata: AttentionMetadata, sampled: bool = False
                       ) -> torch.Tensor:
        """A tree of drafts for each request, [n, N], from first_hidden and feedback (the prefill's states at
        each last accepted token); each depth builds its own metadata on the device, so the recorded one is
        not read. num_reqs is read from its device buffer: one recording serves every batch padded to n.
        sampled: a batch with a request that samples, whose sampling TreeDraws.stage wrote."""
        n = desc.num_reqs
        base_positions, block_table = self._loop_inputs
        num_reqs = self.step_buffers.num_reqs
        return draft_tree(self, self.tree_tables, self.first_hidden[:n], self.feedback[:n], base_positions,
                          block_table, num_reqs, sampling=self.tree_draws.in_graph(n, num_reqs) if sampled else None)

    def _sampled_tree_in_graph(self, desc: BatchDescriptor, metadata: AttentionMetadata) -> torch.Tensor:
        return self._tree_in_graph(desc, metadata, sampled=True)


def _has_graph(graphs: CUDAGraphManager | None, num_reqs: int) -> bool:
    """Whether graphs recorded one that num_reqs requests, one token each, replay."""
    return graphs is not None and graphs.has_graph(graphs.dispatch(num_reqs, num_reqs, 1))
