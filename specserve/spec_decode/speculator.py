"""What every speculator gets after the target's forward, and what it returns."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.attention.metadata import AttentionMetadata
from specserve.sample.sampler import SamplingBatch
from specserve.structured_output.draft_masks import DraftMasks
from specserve.worker.kv_layout import KVCacheLayout
from specserve.worker.step_path import Drafting


@dataclass
class DraftInput:
    """The target step just run, seen by a device speculator proposing the next drafts; everything
    per request is on the device, so proposing needs no host sync (the accepted counts stay there).

    The first group of fields covers all T tokens the target ran; the second
    the n requests to draft for (those that produced tokens this step).
    """

    # The target ran T real tokens padded to descriptor.num_tokens (T_pad) for its CUDA graph; padded
    # tokens are token 0 at position 0 writing nowhere. Its input ids and positions stay in the runner's
    # persistent buffers, which drafters are given once at construction. The runner has written the
    # token after each position into the drafter's own next_ids buffer (draft_inputs.py), zeros up to T_pad.
    # (final hidden states [T_pad, H], auxiliary hidden states [T_pad, H] each): a graph's static outputs
    # when the target replayed one
    target_out: tuple
    descriptor: object  # the target's BatchDescriptor; a drafter's prefill graph for it reuses its state
    metadata: AttentionMetadata  # the target's, reused by the draft prefill

    num_reqs: int  # n
    last_token_indices: torch.Tensor  # [n] index into T of each request's last accepted token
    # Persistent [max_num_reqs] buffer; rows < n hold the position of each last accepted token.
    base_positions: torch.Tensor
    max_base_position: int  # an upper bound of those positions, known on the host
    last_tokens: torch.Tensor  # [n] the newest token of each request
    # Persistent [max_num_reqs, max_blocks] buffer; rows < n are the drafting requests' block tables.
    block_table: torch.Tensor
    rows: torch.Tensor  # [n] each request's row in the draft-probability buffer
    # The drafting requests' sampling parameters; None on a rank > 0 of a sharded drafter, which picks no draft
    # of its own but the argmax (docs/design.md, 'Tensor parallelism').
    sampling: SamplingBatch | None
    # How the drafts are made (worker/step_path.py): in one of the drafter's graphs, or pass by pass.
    drafting: Drafting
    # Trees of drafts: the cache moves of the accepted nodes (tree_verify.kv_moves), which the drafter applies
    # to its own cache after its prefill wrote the tree's slots.
    kv_moves: tuple[torch.Tensor, torch.Tensor] | None = None
    # A step with a grammar request (Drafting.masked): the grammar masks of each depth's drafts.
    masks: DraftMasks | None = None
    # A drafter sharded over the tensor-parallel ranks, in a step whose drafts are not all the argmax (or a tree's
    # top guesses) of unmasked logits (a request samples a chain's drafts, or a grammar masks them): rank 0 picks
    # each draft and broadcasts it, and the other ranks draft on from rank 0's. Argmax drafts and top guesses
    # need no broadcast: every rank computes the same logits.
    shared_picks: bool = False


class Speculator:
    """Base of the proposers. `draft_probs` is None for proposers without a distribution (n-gram).

    A device speculator (on_device) drafts in the same launch as the target step, from device
    tensors: propose() returns [n, k] draft ids. It owns a persistent `next_ids` buffer
    [max_num_tokens] that the runner fills before propose(). A host speculator drafts from the tokens once they are
    back on the host: propose_from_contexts() returns up to k drafts per context."""

    num_speculative_tokens: int
    on_device: bool = True
    draft_probs: torch.Tensor | None = None
    aux_hidden_layers: tuple[int, ...] = ()
    uses_hidden_states: bool = False
    # The drafter's own KV cache layers, over the target's blocks; None for a proposer without a cache. The
    # runner sizes the pool with them counted and hands the cache over with bind_kv_cache.
    kv_layout: KVCacheLayout | None = None

    def propose(self, inp: DraftInput) -> torch.Tensor:
        raise NotImplementedError

    def propose_from_contexts(self, contexts: list[list[int]]) -> list[list[int]]:
        raise NotImplementedError

    def forget(self, request_id: str) -> None:
        """A request finished or was preempted: drop any per-request state."""

    def reset(self) -> None:
        """Every request forgotten: the per-request state of a speculator just built (and its graphs captured)."""

    def has_drafting_graph(self, num_reqs: int) -> bool:
        """Whether a device speculator drafts for num_reqs requests in one recorded graph."""
        return False

    def has_sampled_tree_graph(self, num_reqs: int) -> bool:
        """Whether a tree drafter draws the children of num_reqs requests that sample in one recorded graph."""
        return False

    def release_graphs(self) -> None:
        """Drop any recorded CUDA graphs (ModelRunner.release_graphs)."""

    def bind_kv_cache(self, stack: torch.Tensor | None) -> None:
        """Take the cache allocated for kv_layout ([layers, 2, blocks + 1, ...], KVCacheLayout.allocate), or
        None to let it go."""
        raise NotImplementedError(f"{type(self).__name__} has no KV cache")
