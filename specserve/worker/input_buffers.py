"""The runner's persistent device buffers: allocated once, rewritten every step.

A later CUDA graph reads these exact tensors, so nothing here is ever
reallocated; a step copies its inputs in and passes views on. Rows past the
live batch are reset to values that are always safe to read (design.md 4.5).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from specserve.attention.metadata import PAD_SLOT_ID, AttentionMetadata


class InputBuffers:
    def __init__(self, max_num_reqs: int, max_num_tokens: int, max_blocks_per_req: int, device: torch.device):
        self.device = device
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(max_num_tokens, dtype=i64, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=i64, device=device)
        self.slot_mapping = torch.full((max_num_tokens,), PAD_SLOT_ID, dtype=i64, device=device)
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=i32, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=i32, device=device)
        self.block_table = torch.zeros(max_num_reqs, max_blocks_per_req, dtype=i32, device=device)
        self.logits_indices = torch.zeros(max_num_tokens, dtype=i64, device=device)
        # One row per request whose inputs follow from the previous step's device outputs (inflight_inputs.py).
        self.inflight = torch.zeros(max_num_reqs, 5, dtype=i32, device=device)
        pin = device.type == "cuda"
        # Host staging copies, pinned on CUDA so the uploads are asynchronous. Two sets, one per step in
        # turn: with asynchronous scheduling the host fills step N+1's while step N's copies may still be
        # queued (step N-1 is done by then, so its set is free).
        self._host = [{
            name: torch.zeros_like(buf, device="cpu").pin_memory() if pin else torch.zeros_like(buf, device="cpu")
            for name, buf in self.__dict__.items() if isinstance(buf, torch.Tensor)
        } for _ in range(2)]
        self._staging = 0

    def upload(self, name: str, values: np.ndarray) -> torch.Tensor:
        """Copy values into the front of buffer `name`; returns the view holding them."""
        n = values.shape[0]
        host = self._host[self._staging][name][:n]
        host.numpy()[...] = values
        dev = getattr(self, name)[:n]
        dev.copy_(host, non_blocking=True)
        return dev

    def prepare(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        block_rows: list[list[int]],
        block_size: int,
    ) -> AttentionMetadata:
        self._staging ^= 1
        num_reqs, num_tokens = len(query_lens), len(input_ids)
        qsl = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(query_lens, out=qsl[1:])
        table = np.zeros((num_reqs, self.block_table.shape[1]), dtype=np.int32)
        for i, row in enumerate(block_rows):
            table[i, : len(row)] = row
        req_of_token = np.repeat(np.arange(num_reqs), query_lens)
        block_idx = positions // block_size
        slots = table[req_of_token, block_idx].astype(np.int64) * block_size + positions % block_size

        self.upload("input_ids", input_ids)
        self.upload("positions", positions)
        self.upload("slot_mapping", slots)
        self.upload("query_start_loc", qsl)
        self.upload("seq_lens", seq_lens.astype(np.int32))
        self.upload("block_table", table)
        self._pad_rows(num_reqs, num_tokens, int(qsl[-1]))
        metadata = self.padded_metadata(num_reqs, num_tokens, int(query_lens.max()), int(seq_lens.max()))
        if self.device.type == "cpu":
            # The buffers are host memory: the reference backend reads them as corrected in place for
            # requests whose inputs come from the previous step (asynchronous scheduling).
            return metadata
        # The host copies this step already has, for the reference backend's per-request loop.
        return replace(metadata, query_start_loc_cpu=torch.from_numpy(qsl),
                       seq_lens_cpu=torch.from_numpy(seq_lens.astype(np.int32)))

    def _pad_rows(self, num_reqs: int, num_tokens: int, last_end: int) -> None:
        # Padded requests are empty (start = end = last real end, no cached tokens) and padded
        # tokens write nowhere and read token 0 at position 0, so a kernel or graph that reads past
        # the live batch sees in-range no-ops whatever the buffers held before.
        self.query_start_loc[num_reqs + 1:].fill_(last_end)
        self.seq_lens[num_reqs:].zero_()
        self.slot_mapping[num_tokens:].fill_(PAD_SLOT_ID)
        self.input_ids[num_tokens:].zero_()
        self.positions[num_tokens:].zero_()

    def reset(self) -> None:
        """An empty batch in every row (before a capture, and after it: nothing stale survives)."""
        self.query_start_loc[0] = 0
        self._pad_rows(0, 0, 0)

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
        )
