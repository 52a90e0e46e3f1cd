"""Drafting with a model (an EAGLE head or a small draft LM): one prefill, then one token per step.

The prefill runs over exactly the tokens the target just ran, with the
target's attention metadata (design.md 4.6: no rebuild before the draft
prefill). Each later draft step has one query token per request and gets its
own metadata, rebuilt on the device by prepare_draft_step (positions and
seq_lens advance, a fresh slot per request; padded rows as design.md 4.5).
Draft probabilities are kept in one persistent float32 buffer, one row per
running request, for the rejection sampler of the next step (seed #37639).
"""
from __future__ import annotations

import torch

from specserve.attention.metadata import AttentionMetadata
from specserve.sample.sampler import filtered_probs, sample_from_probs
from specserve.spec_decode.eagle_inputs import DraftStepBuffers, prepare_draft_step
from specserve.spec_decode.speculator import DraftInput, Speculator


class ModelDrafter(Speculator):
    def __init__(self, k: int, vocab_size: int, max_num_reqs: int, block_size: int, max_position: int,
                 device: torch.device, generator: torch.Generator):
        self.num_speculative_tokens = k
        self.block_size = block_size
        self.max_position = max_position
        self.device = device
        self.generator = generator
        self.draft_probs = torch.zeros(max_num_reqs, k, vocab_size, dtype=torch.float32, device=device)
        self.step_buffers = DraftStepBuffers.allocate(max_num_reqs, device)

    # Subclasses: the prefill returns (logits for draft 1 or None, feedback hidden states [n, H] or None);
    # a decode step returns (logits [n, V], feedback).
    def prefill(self, inp: DraftInput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        raise NotImplementedError

    def decode(self, tokens, feedback, positions, metadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    @torch.inference_mode()
    def propose(self, inp: DraftInput) -> list[list[int]]:
        n, k = len(inp.requests), self.num_speculative_tokens
        drafts: list[torch.Tensor] = []
        logits, feedback = self.prefill(inp)
        current = inp.last_tokens
        if logits is not None:
            current = self._pick(logits, inp, 0)
            drafts.append(current)
        step = 1
        while len(drafts) < k:
            metadata = self._step_metadata(inp, step)
            positions = self.step_buffers.positions[:n]
            logits, feedback = self.decode(current, feedback, positions, metadata)
            current = self._pick(logits, inp, len(drafts))
            drafts.append(current)
            step += 1
        table = torch.stack(drafts, dim=1).tolist()
        return [row[:m] for row, m in zip(table, inp.max_drafts)]

    def _pick(self, logits: torch.Tensor, inp: DraftInput, j: int) -> torch.Tensor:
        """Draft j of each request: argmax for greedy requests, else a sample from q kept for verification."""
        b = inp.sampling
        tokens = logits.argmax(dim=-1)
        if not b.all_greedy:
            q = filtered_probs(logits, b)
            tokens = torch.where(b.greedy, tokens, sample_from_probs(q, b.generators, self.generator))
            self.draft_probs[:, j].index_copy_(0, inp.rows, q)
        return tokens

    def _step_metadata(self, inp: DraftInput, step: int) -> AttentionMetadata:
        n = len(inp.requests)
        buf = self.step_buffers
        prepare_draft_step(step, n, inp.base_positions, inp.block_table, self.block_size, self.max_position, buf)
        max_seq = min(max(inp.base_positions_cpu) + step, self.max_position - 1) + 1
        return AttentionMetadata(
            num_reqs=n, num_tokens=n, max_query_len=1, max_seq_len=max_seq,
            query_start_loc=buf.query_start_loc[: n + 1], seq_lens=buf.seq_lens[:n],
            block_table=inp.block_table[:n], slot_mapping=buf.slot_mapping[:n],
            # The reference backend loops on the host; on CPU these are the same memory.
            query_start_loc_cpu=buf.query_start_loc[: n + 1], seq_lens_cpu=buf.seq_lens[:n],
        )
