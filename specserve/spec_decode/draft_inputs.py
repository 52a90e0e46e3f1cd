"""What a device drafter needs from the target step just run, gathered in one kernel.

After verification the accepted counts exist only on the device. From them and
the step's inputs the drafter needs, per drafting request i (batch row b):

    last[i]          = base[i] + accepted[b]        index of its last accepted token
    last_tokens[i]   = tokens[b, accepted[b]]       the token the step emitted last
    base_positions[i] = positions[last[i]]
    block_table[i]   = the step's block-table row b

and per token t of the step the token after it, for the draft prefill:

    next_ids[t] = input_ids[t + 1]                  (input_ids[0] for the last token)
    next_ids[last[i]] = last_tokens[i]              a drafting request's newest token
    next_ids[end - 1] = the prompt's next token     a prompt chunk that does not sample
    next_ids[T:pad_to] = 0                          padding of the drafter's graph
    last[i] = last_tokens[i] = 0                    R <= i < pad_reqs: a padded graph's rows

Each scheduled request is one program, which owns its tokens, so the overrides
need no ordering between programs. The host stages one DraftRequest row per
scheduled request as StagedExtra.DRAFT_REQUESTS, which the kernel finds through
the staged array's header (staged_inputs.py), with T; base[i] is
first + count - 1 - drafts_verified. So the launch is the same every step, and
a graph can hold it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.worker.staged_inputs import NUM_TOKENS, StagedExtra, header_extra


@dataclass(frozen=True)
class DraftRequest:
    """What the drafter's gather needs of one scheduled request; its fields, in order, are the columns of its
    staged row (draft_request_rows), which the kernels read by position."""

    first: int  # its first token in the step
    count: int  # its tokens in the step
    drafting_index: int  # its row among the requests that draft, or -1: a prompt chunk that does not sample
    drafts_verified: int
    next_prompt_token: int  # a chunk that does not sample: the prompt's token after it; else 0


REQUEST_COLUMNS = 5


def draft_request_rows(requests: Sequence[DraftRequest]) -> np.ndarray:
    """The staged form of requests: int64 [len(requests), REQUEST_COLUMNS]."""
    return np.array([(r.first, r.count, r.drafting_index, r.drafts_verified, r.next_prompt_token)
                     for r in requests], dtype=np.int64).reshape(-1, REQUEST_COLUMNS)


def gather_draft_inputs_torch(staged: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                              input_ids: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                              pad_to: int, pad_reqs: int, next_ids: torch.Tensor, last: torch.Tensor,
                              last_tokens: torch.Tensor, base_positions: torch.Tensor,
                              draft_block_table: torch.Tensor) -> None:
    """The gather in torch ops (the CPU path and the kernel's reference)."""
    requests = header_extra(staged, StagedExtra.DRAFT_REQUESTS, REQUEST_COLUMNS)
    num_tokens = int(staged[NUM_TOKENS])
    first, count, slot, drafts, next_prompt = requests.unbind(1)
    batch_rows = torch.arange(requests.shape[0], device=requests.device)
    drafting = slot >= 0
    b, i = batch_rows[drafting], slot[drafting]
    acc = accepted[b]
    last_idx = first[drafting] + count[drafting] - 1 - drafts[drafting] + acc
    emitted = tokens[b, acc]
    next_ids[:num_tokens] = torch.roll(input_ids[:num_tokens], -1)
    chunk = ~drafting
    next_ids[(first + count - 1)[chunk]] = next_prompt[chunk]
    next_ids[last_idx] = emitted
    next_ids[num_tokens:pad_to] = 0
    last[i] = last_idx
    last_tokens[i] = emitted
    base_positions[i] = positions[last_idx]
    draft_block_table[i] = block_table[b]
    last[requests.shape[0]:pad_reqs] = 0
    last_tokens[requests.shape[0]:pad_reqs] = 0


def gather_draft_inputs(staged: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                        input_ids: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                        pad_to: int, pad_reqs: int, next_ids: torch.Tensor, last: torch.Tensor,
                        last_tokens: torch.Tensor, base_positions: torch.Tensor, draft_block_table: torch.Tensor,
                        max_rows: int, *, use_triton: bool | None = None) -> None:
    """Fill the drafter's inputs (see the module docstring). staged: the step's staged array (int64), whose
    header locates the R request rows and holds T; max_rows >= R bounds the grid (a graph records it once);
    accepted [>= R], tokens [>= R, k + 1]: the step's outputs by batch row; input_ids, positions, block_table:
    the step's persistent inputs; the rest are outputs (next_ids over [0, pad_to), the others at each drafting
    request's index, and last, last_tokens zero over [R, pad_reqs)). One Triton launch on CUDA, torch ops
    elsewhere (use_triton forces either; tests run the kernel under TRITON_INTERPRET=1)."""
    if use_triton is None:
        use_triton = input_ids.is_cuda
    if use_triton:
        from specserve.kernels.draft_inputs import gather_draft_inputs_triton

        gather_draft_inputs_triton(staged, accepted, tokens, input_ids, positions, block_table, pad_to, pad_reqs,
                                   next_ids, last, last_tokens, base_positions, draft_block_table, max_rows)
    else:
        gather_draft_inputs_torch(staged, accepted, tokens, input_ids, positions, block_table, pad_to, pad_reqs,
                                  next_ids, last, last_tokens, base_positions, draft_block_table)


def follow_tree_paths_torch(path_tokens: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                            slots: torch.Tensor, positions: torch.Tensor, next_ids: torch.Tensor, last: torch.Tensor,
                            base_positions: torch.Tensor) -> None:
    """follow_tree_paths in torch ops (the CPU path and the kernel's reference)."""
    depth = torch.arange(path_tokens.shape[1], device=path_tokens.device)
    on_path = depth[None, :] <= accepted[:, None]
    end = accepted[:, None]
    last_index = path_tokens.gather(1, end)
    # Past the path, the last node's entry again: the same index written with the same value.
    next_ids[torch.where(on_path, path_tokens, last_index).flatten()] = torch.where(
        on_path, tokens, tokens.gather(1, end)).flatten()
    last[slots] = last_index.squeeze(1)
    base_positions[slots] = positions[last_index.squeeze(1)]


def follow_tree_paths(path_tokens: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor,
                      positions: torch.Tensor, next_ids: torch.Tensor, last: torch.Tensor,
                      base_positions: torch.Tensor, *, use_triton: bool | None = None) -> None:
    """After gather_draft_inputs, the drafter's inputs of requests that verified trees of drafts: their
    accepted tokens are not consecutive in the step, but at the token indices path_tokens [n, D + 1] (root,
    then each accepted draft). The token after path node d is emitted token d (tokens [n, D + 1]: the
    accepted drafts, then the bonus token), and the last accepted token is path node accepted. slots [n]:
    each request's drafting index. One Triton launch on CUDA, torch ops elsewhere (use_triton forces
    either; tests run the kernel under TRITON_INTERPRET=1)."""
    if use_triton is None:
        use_triton = path_tokens.is_cuda
    if use_triton:
        from specserve.kernels.draft_inputs import follow_tree_paths_triton

        follow_tree_paths_triton(path_tokens, accepted, tokens, slots, positions, next_ids, last, base_positions)
    else:
        follow_tree_paths_torch(path_tokens, accepted, tokens, slots, positions, next_ids, last, base_positions)
