"""The runner's persistent device buffers: allocated once, rewritten every step.

A later CUDA graph reads these exact tensors, so nothing here is ever
reallocated; a step stages its inputs in one copy (staged_inputs.py), which
spread() then writes into the buffers, eagerly or inside a whole-step graph.
Rows past the live batch are reset to values that are always safe to read
(docs/invariants.md, 'Padded rows').
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from specserve.attention.metadata import PAD_SLOT_ID, AttentionMetadata
from specserve.config import EngineConfig
from specserve.spec_decode.config import MAX_DRAFT_TOKENS
from specserve.spec_decode.tree import DraftTree
from specserve.transfer import to_device
from specserve.worker.staged_inputs import (HEADER_SLOTS, MASKED, StagedExtra, StagedLayout, pack_step_inputs,
                                            scatter_staged_inputs)


class TokenBitmaskBuffer:
    """Grammar masks, one row of xgrammar's layout (int32, ceil(vocab / 32) words) per logits row: the host
    fills fillable() (pinned on CUDA) and copy() queues the rows to `device`. The target's buffer is read by
    the greedy graphs (worker/target_graphs.py) under `switch`, the staged header's MASKED; the drafter's by
    each masked draft depth (structured_output/draft_masks.py).

    What must hold: the host writes the pinned rows only after the last copy from them has run, which
    fillable() waits for (usually long done: a grammar step completes the step before it, a draft depth reads
    back the drafts picked under the masks before); rows of `device` past a step's own hold earlier masks
    and are read only for padded rows, whose tokens no request takes."""

    def __init__(self, device: torch.Tensor, host: torch.Tensor, switch: torch.Tensor | None = None):
        self.device = device
        self.host = host
        self.switch = switch  # [1] int64, a view of the staged header (the target's buffer)
        self._copied = torch.cuda.Event() if device.is_cuda else None

    def fillable(self) -> torch.Tensor:
        """The host rows, once the last copy from them has run."""
        if self._copied is not None:
            self._copied.synchronize()
        return self.host

    def allow_all(self, start: int, stop: int) -> None:
        """Host rows start..stop allow every token. Through numpy, on this thread: torch would spread the fill over
        its intra-op threads, which then contend with xgrammar's fill threads for the host's CPUs."""
        self.host.numpy()[start:stop] = -1

    def copy(self, rows: int, first: int = 0) -> torch.Tensor:
        """rows rows of host from first, on their way to the device (queued behind the work already there)."""
        part = slice(first, first + rows)
        if self.host is not self.device:
            self.device[part].copy_(self.host[part], non_blocking=True)
            if self._copied is not None:
                self._copied.record()
        return self.device[part]

    def take_rows(self, rows: list[int], source: "TokenBitmaskBuffer", source_rows: list[int]) -> None:
        """Device rows `rows` become source's device rows `source_rows`, once copy() has queued the host rows: where
        host and device rows are one memory (a CPU engine) through numpy as allow_all; otherwise a gather on the
        device queued behind that copy (the host rows at `rows` stay as they were, and source's device rows must
        hold until it runs, which stream order gives)."""
        if self.host is self.device:
            self.host.numpy()[rows] = source.host.numpy()[source_rows]
            return
        self.device.index_copy_(0, to_device(rows, self.device.device),
                                source.device.index_select(0, to_device(source_rows, self.device.device)))


class InputBuffers:
    @classmethod
    def for_engine(cls, config: EngineConfig, tree: DraftTree | None, max_blocks_per_req: int, vocab_size: int,
                   device: torch.device) -> InputBuffers:
        """The buffers an engine's steps need: its batch limits, its drafts (a chain or tree) and their masks."""
        spec = config.speculative_config
        # Extras a step stages beside its inputs, per request at most: the in-flight row (5), sampling or
        # verification indices (k + 4), the drafter's request row (5) and its rows (2); and one value of
        # alignment padding per extra.
        extras = config.max_num_seqs * (16 + MAX_DRAFT_TOKENS) + 16
        # A grammar mask row per verified token: 1 + the drafts of each request.
        bitmask_rows = config.max_num_seqs * (1 + (spec.num_draft_tokens if spec else 0))
        # The drafter's mask rows a request: a chain keeps one a draft (the next step verifies them), a tree
        # one a node of its widest level.
        draft_rows = 0 if spec is None else spec.num_draft_tokens if tree is None else max(
            len(tree.level(d)) for d in range(tree.depth))
        return cls(config.max_num_seqs, config.max_num_batched_tokens, max_blocks_per_req, device,
                   extra_capacity=extras, trees=tree is not None, bitmask_rows=bitmask_rows,
                   draft_bitmask_rows=config.max_num_seqs * draft_rows, vocab_size=vocab_size)

    def __init__(self, max_num_reqs: int, max_num_tokens: int, max_blocks_per_req: int, device: torch.device,
                 extra_capacity: int = 0, trees: bool = False, bitmask_rows: int = 0, draft_bitmask_rows: int = 0,
                 vocab_size: int = 0):
        """bitmask_rows: the most logits rows a step masks (its requests' verified tokens), of vocab_size
        tokens each; draft_bitmask_rows: the most a draft depth masks (its requests' nodes at that depth)."""
        self.device = device
        # Whether steps may verify trees of drafts: the metadata then carries each token's tree bits.
        self.trees = trees
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(max_num_tokens, dtype=i64, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=i64, device=device)
        self.slot_mapping = torch.full((max_num_tokens,), PAD_SLOT_ID, dtype=i64, device=device)
        self.tree_bits = torch.full((max_num_tokens,), -1, dtype=i64, device=device)
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=i32, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=i32, device=device)
        self.block_table = torch.zeros(max_num_reqs, max_blocks_per_req, dtype=i32, device=device)
        # One step's host arrays, packed (staged_inputs.py); extra_capacity bounds the caller's extras.
        capacity = 4 * max_num_tokens + max_num_reqs * (2 + max_blocks_per_req) + extra_capacity
        self.staged = torch.zeros(capacity, dtype=i64, device=device)
        pin = device.type == "cuda"
        # Host staging copies, pinned on CUDA so the copy is asynchronous. Two, used in turn: with
        # asynchronous scheduling the host fills step N+1's while step N's copy may still be queued. A step
        # that samples nothing is never waited for, so the host may come back to a buffer whose copy has not
        # run yet: each buffer's copy records an event that its next filling waits for (usually done).
        self._host = [torch.zeros(capacity, dtype=i64, pin_memory=pin) for _ in range(2)]
        self._copied = [torch.cuda.Event() for _ in range(2)] if pin else None
        # Looked up once: looking the stream up costs as much host time as recording the event.
        self._stream = torch.cuda.current_stream(device) if pin else None
        self._staging = 0
        self._layout: StagedLayout | None = None
        self.token_bitmask = _bitmask_buffer(bitmask_rows, vocab_size, device, self.staged[MASKED:MASKED + 1])
        self.draft_bitmask = _bitmask_buffer(draft_bitmask_rows, vocab_size, device)

    def prepare(
        self,
        input_ids: np.ndarray,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        table: np.ndarray,
        block_size: int,
        extras: dict[StagedExtra, np.ndarray] | None = None,
        tree_shift: np.ndarray | None = None,
        tree_bits: np.ndarray | None = None,
        masked: bool = False,
    ) -> AttentionMetadata:
        """Stage the step's inputs (and the caller's extra int64 arrays, read back with staged_extra()) and copy
        them to the device at once; spread() then writes them into the persistent buffers. Returns the step's
        metadata.
        Each request's query is its last query_lens[i] positions before seq_lens[i]; table[i] holds its
        block ids. A token of a tree of drafts keeps its cache slot but sits tree_shift[t] positions earlier
        (its index in the tree minus its depth), and tree_bits[t] says which of the tree it sees. masked: the step
        fills token_bitmask with its grammar masks, which the greedy graphs then apply."""
        self._staging ^= 1
        num_reqs, num_tokens = len(query_lens), len(input_ids)
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        req_of_token = np.repeat(np.arange(num_reqs), query_lens)
        # Token t of request r sits at position seq_lens[r] - query_lens[r] + (t - qsl[r]).
        positions = np.arange(num_tokens) + (seq_lens - qsl[1:])[req_of_token]
        slots = table[req_of_token, positions // block_size] * block_size + positions % block_size
        if tree_shift is not None:
            positions = positions - tree_shift
        host = self._host[self._staging]
        if self._copied is not None:
            self._copied[self._staging].synchronize()
        layout = pack_step_inputs(host.numpy(), input_ids, positions, slots, seq_lens, qsl[1:], table, extras or {},
                                  tree_bits, masked)
        self.staged[:layout.size].copy_(host[:layout.size], non_blocking=True)
        if self._copied is not None:
            self._copied[self._staging].record(self._stream)
        self._layout = layout
        metadata = self.padded_metadata(num_reqs, num_tokens, int(query_lens.max()), int(seq_lens.max()))
        if self.device.type == "cpu":
            # The buffers are host memory: the reference backend reads them as corrected in place for
            # requests whose inputs come from the previous step (asynchronous scheduling).
            return metadata
        # The host copies this step already has, for the reference backend's per-request loop.
        return replace(metadata, query_start_loc_cpu=torch.from_numpy(qsl.astype(np.int32)),
                       seq_lens_cpu=torch.from_numpy(seq_lens.astype(np.int32)))

    def spread(self) -> None:
        """Write the staged step into the persistent buffers, padding included (one launch, the same every
        step: the sizes come from the staged header)."""
        scatter_staged_inputs(self.staged, self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
                              self.query_start_loc, self.block_table, tree_bits=self.tree_bits if self.trees else None)

    def staged_extra(self, extra: StagedExtra) -> torch.Tensor:
        """The device copy of `extra` as the last prepare() staged it, in its shape (int64)."""
        offset, shape, size = self._layout.extras[extra]
        return self.staged[offset:offset + size].view(shape)

    def reset(self) -> None:
        """An empty batch in every row (before a capture, and after it: nothing stale survives), and an empty
        step staged, which a recorded spread() turns into that same empty batch."""
        self.staged[:HEADER_SLOTS].zero_()
        self.query_start_loc.zero_()
        self.seq_lens.zero_()
        self.slot_mapping.fill_(PAD_SLOT_ID)
        self.input_ids.zero_()
        self.positions.zero_()
        self.tree_bits.fill_(-1)

    def padded_metadata(self, num_reqs: int, num_tokens: int, max_query_len: int, max_seq_len: int) -> AttentionMetadata:
        """Metadata over the first num_reqs rows and num_tokens tokens of the buffers, whatever they hold:
        each step's own, and what a full CUDA graph records once and keeps reading."""
        return AttentionMetadata(
            num_reqs=num_reqs, num_tokens=num_tokens, max_query_len=max_query_len, max_seq_len=max_seq_len,
            query_start_loc=self.query_start_loc[: num_reqs + 1], seq_lens=self.seq_lens[:num_reqs],
            block_table=self.block_table[:num_reqs], slot_mapping=self.slot_mapping[:num_tokens],
            # Only the reference backend reads these, and graphs with it run on the CPU stand-in alone,
            # where device and host memory are one.
            query_start_loc_cpu=self.query_start_loc[: num_reqs + 1], seq_lens_cpu=self.seq_lens[:num_reqs],
            tree_bits=self.tree_bits[:num_tokens] if self.trees else None,
        )


def _bitmask_buffer(rows: int, vocab_size: int, device: torch.device,
                    switch: torch.Tensor | None = None) -> TokenBitmaskBuffer:
    """rows x ceil(vocab_size / 32) words, every token allowed; on the CPU the device's memory is the host's."""
    bitmask = torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32, device=device)
    host = torch.full_like(bitmask, -1, device="cpu").pin_memory() if bitmask.is_cuda else bitmask
    return TokenBitmaskBuffer(bitmask, host, switch)
