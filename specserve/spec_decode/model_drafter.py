"""Drafting with a model (an EAGLE head or a small draft LM): one prefill, then one token per step.

The prefill runs over exactly the tokens the target just ran, with the
target's attention metadata, not rebuilt (docs/design.md, 'Draft prefill').
Each later draft step has one query token per request and gets its own
metadata, rebuilt on the device by prepare_draft_step (positions and seq_lens
advance, a fresh slot per request; padded rows as in docs/invariants.md,
'Padded rows'). Draft probabilities are kept in one persistent float32 buffer,
one row per running request, for the rejection sampler of the next step
(docs/invariants.md, 'Draft logits'). The drafter's CUDA graphs, and the
bodies of those that draft every token at once, are in drafter_graphs.py.
"""
from __future__ import annotations

import torch

from specserve.attention.metadata import AttentionMetadata
from specserve.distributed.communication import broadcast_from_rank0
from specserve.sample.argmax import greedy_argmax
from specserve.spec_decode.pick_scatter import PickScatter
from specserve.sample.sampler import filtered_probs, sample_from_probs
from specserve.spec_decode.eagle_inputs import DraftStepBuffers, prepare_draft_step
from specserve.spec_decode.drafter_graphs import DrafterGraphs
from specserve.spec_decode.speculator import DraftInput, Speculator
from specserve.spec_decode.sampled_tree import TreeDraws, TreeSampling
from specserve.spec_decode.tree_drafting import draft_tree
from specserve.spec_decode.tree_verify import TreeTables
from specserve.structured_output.draft_masks import DraftMasks, mask_draft_logits
from specserve.worker.cudagraph import BatchDescriptor, CUDAGraphManager
from specserve.worker.cudagraph_mode import CUDAGraphMode
from specserve.worker.step_path import Drafting


class ModelDrafter(DrafterGraphs, Speculator):
    # Whether the prefill yields draft 1 (EAGLE heads); a draft model's prefill only fills its cache.
    first_draft_from_prefill = True

    def __init__(self, k: int, vocab_size: int, max_num_reqs: int, max_num_tokens: int, block_size: int,
                 max_position: int, device: torch.device, generator: torch.Generator,
                 target_input_ids: torch.Tensor, target_positions: torch.Tensor, feedback_size: int | None = None,
                 dtype: torch.dtype = torch.float32, tree_tables: TreeTables | None = None):
        self.num_speculative_tokens = k
        # Draft a tree instead of a chain (tree_drafting.py); EAGLE heads only.
        self.tree_tables = tree_tables
        self.block_size = block_size
        self.max_position = max_position
        self.device = device
        self.generator = generator
        # The distributions sampled drafts came from, one row per running request, for the next step's
        # verification: a chain's at each draft (float32, rejection_sampler.py), a tree's at each node that has
        # children (sampled_tree.py).
        self.draft_probs = (torch.zeros(max_num_reqs, k, vocab_size, dtype=torch.float32, device=device)
                            if tree_tables is None else None)
        self.tree_draws = (TreeDraws(max_num_reqs, tree_tables, vocab_size, device, generator)
                           if tree_tables is not None else None)
        self.step_buffers = DraftStepBuffers.allocate(max_num_reqs, device)
        # Persistent inputs: the target's own buffers, the token after each target position, the
        # tokens and fed-back hidden states of a decode step.
        self.target_input_ids = target_input_ids
        self.target_positions = target_positions
        self.next_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.decode_tokens = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.feedback = (torch.zeros(max_num_reqs, feedback_size, dtype=dtype, device=device)
                         if feedback_size else None)
        # The prefill's hidden state at each request's last accepted token, from which the greedy loop's
        # graph drafts token 1.
        self.first_hidden = (torch.zeros(max_num_reqs, feedback_size, dtype=dtype, device=device)
                             if feedback_size and self.first_draft_from_prefill else None)
        # The buffers above with one row per request, which a padded decode or loop graph reads past n.
        self._request_rows = [t for t in (self.decode_tokens, self.feedback, self.first_hidden) if t is not None]
        self.prefill_graphs: CUDAGraphManager | None = None
        self.decode_graphs: CUDAGraphManager | None = None
        # Greedy batches draft every token, argmax included, in one graph per padded batch size.
        self.greedy_loop_graphs: CUDAGraphManager | None = None
        # A tree's passes in one graph per padded batch size (steps that do not run the runner's whole step).
        self.tree_graphs: CUDAGraphManager | None = None
        # The same for batches with a request that samples its children (sampled_tree.TreeDraws), where the
        # draws can be recorded.
        self.sampled_tree_graphs: CUDAGraphManager | None = None
        self._loop_inputs: tuple[torch.Tensor, torch.Tensor] | None = None  # (base positions, block table)
        # Requests of the last propose(): rows at or past it of _request_rows hold zeros.
        self._rows_in_use = -1

    # Subclasses. prefill_forward runs over the first num_tokens target tokens and returns
    # (hidden states for draft-1 logits, hidden states to feed back), either None for a drafter without them;
    # decode_hidden returns (hidden states for the logits, hidden states to feed back or None).
    def prefill_forward(self, num_tokens: int, target_out: tuple, metadata: AttentionMetadata):
        raise NotImplementedError

    def decode_hidden(self, tokens, feedback, positions, metadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, V] over the target vocabulary."""
        raise NotImplementedError

    def greedy_tokens(self, hidden: torch.Tensor, captured: bool = False) -> torch.Tensor:
        """compute_logits(hidden).argmax(-1); drafters override it with a cheaper path to the same tokens.
        captured: the call is being recorded into a CUDA graph (see greedy_argmax)."""
        return greedy_argmax(self.compute_logits(hidden), captured)

    def top_tokens(self, hidden: torch.Tensor, k: int, scatter: PickScatter | None = None) -> torch.Tensor:
        """[n, k]: the k likeliest next tokens of each row, best first (trees of drafts); with scatter, sent where
        it says, returning its out."""
        top = self.compute_logits(hidden).topk(k, dim=-1).indices
        return top if scatter is None else scatter.apply(top)

    def tree_pass(self, tokens, feedback, parent_rows, positions, metadata, k: int,
                  scatter: PickScatter) -> tuple[torch.Tensor, torch.Tensor]:
        """(scatter's out, fed-back states): the pass over one depth's drafts of a tree (tokens), each reading
        its parent's state feedback[parent_rows], then the k likeliest guesses after each, sent where scatter
        says (tree_drafting.py). Drafters override it to fuse the gather and the guesses into the pass."""
        for_logits, fed_back = self.decode_hidden(tokens, feedback.index_select(0, parent_rows), positions, metadata)
        return self.top_tokens(for_logits, k, scatter), fed_back

    def move_kv(self, source: torch.Tensor, dest: torch.Tensor) -> None:
        """Copy the drafter's cache slots source to dest (tree_verify.move_kv), for trees of drafts."""
        raise NotImplementedError(f"{type(self).__name__} does not draft trees")

    def greedy_decode_step(self, tokens, feedback, positions, metadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the next greedy drafts, hidden states to feed back or None): decode_hidden, then greedy_tokens,
        inside the greedy loop's graph; drafters override it to fuse the two."""
        hidden, feedback = self.decode_hidden(tokens, feedback, positions, metadata)
        return self.greedy_tokens(hidden, captured=True), feedback

    # ---- state and forwards -------------------------------------------------------------------

    def reset(self) -> None:
        for rows in self._request_rows:
            rows.zero_()
        for probs in (self.draft_probs, self.tree_draws and self.tree_draws.node_probs):
            if probs is not None:
                probs.zero_()
        self._rows_in_use = -1

    @property
    def num_loop_steps(self) -> int:
        """Decode steps after the prefill: k - 1 when the prefill drafts, else k."""
        return self.num_speculative_tokens - int(self.first_draft_from_prefill)

    def models(self) -> list[torch.nn.Module]:
        raise NotImplementedError

    def _prefill(self, desc: BatchDescriptor, metadata: AttentionMetadata, target_out: tuple):
        return self.prefill_forward(desc.num_tokens, target_out, metadata)

    def _decode(self, desc: BatchDescriptor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Pure in its inputs (the fed-back state is copied back by the caller), so a debug re-run
        # sees what the replay saw.
        n = desc.num_reqs
        feedback = self.feedback[:n] if self.feedback is not None else None
        hidden, fed_back = self.decode_hidden(self.decode_tokens[:n], feedback, self.step_buffers.positions[:n],
                                              metadata)
        return self.compute_logits(hidden), fed_back

    def _decode_metadata(self, desc: BatchDescriptor, block_table: torch.Tensor, max_seq_len: int) -> AttentionMetadata:
        n, buf = desc.num_reqs, self.step_buffers
        return AttentionMetadata(
            num_reqs=n, num_tokens=n, max_query_len=1, max_seq_len=max_seq_len,
            query_start_loc=buf.query_start_loc[: n + 1], seq_lens=buf.seq_lens[:n],
            block_table=block_table[:n], slot_mapping=buf.slot_mapping[:n],
            # The reference backend loops on the host; it runs on the CPU, where these are the same memory.
            query_start_loc_cpu=buf.query_start_loc[: n + 1], seq_lens_cpu=buf.seq_lens[:n],
        )

    # ---- proposing ----------------------------------------------------------------------------

    def prefill(self, desc: BatchDescriptor, target_out: tuple, metadata: AttentionMetadata):
        """The prefill over the step's tokens (the target ran them as desc), from its graph where one is recorded:
        each token's keys and values into the drafter's cache, and (for_logits, fed_back) at every token. A step
        that drafts nothing but ran prompt tokens runs it alone (Drafting.PREFILL_ONLY); the inputs are gathered
        first (draft_inputs.py)."""

        def run(d: BatchDescriptor, md: AttentionMetadata):
            return self._prefill(d, md, target_out)

        graphs = self.prefill_graphs
        return graphs.run(desc, run, metadata) if graphs else run(desc, metadata)

    @torch.inference_mode()
    def propose(self, inp: DraftInput) -> torch.Tensor:
        """[n, k] drafts (a chain) or [n, N] (a tree): the prefill, then the drafts as inp.drafting says."""
        n, k = inp.num_reqs, self.num_speculative_tokens
        desc = inp.descriptor
        for_logits, fed_back = self.prefill(desc, inp.target_out, inp.metadata)
        last = inp.last_token_indices
        if n != self._rows_in_use:
            # Rows past n are padding for a full decode graph: in-range token ids, finite hidden states.
            # Only rows below n are written until n changes, so they stay so until then.
            for rows in self._request_rows:
                rows[n:].zero_()
            self._rows_in_use = n
        if inp.drafting in (Drafting.TREE_PASSES, Drafting.MASKED_TREE_PASSES):
            return self._draft_tree(for_logits, fed_back, last, inp.kv_moves, inp.base_positions, inp.block_table,
                                    masks=inp.masks, shared_picks=inp.shared_picks, sampling=self._tree_sampling(inp))
        if inp.drafting in (Drafting.TREE_GRAPH, Drafting.SAMPLED_TREE_GRAPH):
            if inp.kv_moves is not None:
                self.move_kv(*inp.kv_moves)
            self._keep_feedback(n, fed_back, last)
            self._seed_greedy_loop(n, for_logits, last, inp.last_tokens)
            if inp.drafting is Drafting.TREE_GRAPH:
                return self._replay_for(self.tree_graphs, n, self._tree_in_graph)
            self.tree_draws.stage(inp.sampling, inp.rows)
            return self._replay_for(self.sampled_tree_graphs, n, self._sampled_tree_in_graph)
        drafts: list[torch.Tensor] = []
        current = inp.last_tokens
        self._keep_feedback(n, fed_back, last)
        if inp.drafting is Drafting.GREEDY_LOOP_GRAPH:
            self._seed_greedy_loop(n, for_logits, last, current)
            return self._replay_for(self.greedy_loop_graphs, n, self._greedy_loop)
        if for_logits is not None:
            h = for_logits.index_select(0, last)
            current = (self.greedy_tokens(h) if self._argmax_picks(inp)
                       else self._pick(self.compute_logits(h), inp, 0))
            drafts.append(current)
        step = 1
        while len(drafts) < k:
            self.decode_tokens[:n].copy_(current)
            prepare_draft_step(step, n, inp.base_positions, inp.block_table, self.block_size, self.max_position,
                               self.step_buffers)
            logits, fed_back = self._run_decode_step(n, step, inp)
            if fed_back is not None:
                self.feedback[:n].copy_(fed_back[:n])
            current = self._pick(logits[:n], inp, len(drafts))
            drafts.append(current)
            step += 1
        return torch.stack(drafts, dim=1)

    def propose_greedy_in_graph(self, desc: BatchDescriptor, target_out: tuple, metadata: AttentionMetadata,
                                num_reqs: torch.Tensor, last_token_indices: torch.Tensor,
                                last_tokens: torch.Tensor) -> torch.Tensor:
        """propose() of a greedy batch that the target ran as the full graph for desc, for recording inside the
        runner's whole-step graph: [desc.num_reqs, k] drafts. The batch is padded to desc.num_reqs; num_reqs
        ([1] on the device) holds how many rows are real, and rows past it of last_token_indices and
        last_tokens hold 0, so every padded row reads in-range values (docs/invariants.md, 'Padded rows')."""
        n = desc.num_reqs
        for_logits, fed_back = self._prefill(desc, metadata, target_out)
        last = last_token_indices[:n]
        self._keep_feedback(n, fed_back, last)
        self._seed_greedy_loop(n, for_logits, last, last_tokens[:n])
        self.step_buffers.num_reqs.copy_(num_reqs)
        loop = self.greedy_loop_graphs
        loop_desc = loop.dispatch(n, n, 1)
        return self._greedy_loop(loop_desc, loop.metadata[loop_desc.key])

    def propose_tree_in_graph(self, desc: BatchDescriptor, target_out: tuple, metadata: AttentionMetadata,
                              kv_moves: tuple[torch.Tensor, torch.Tensor], num_reqs: torch.Tensor,
                              last_token_indices: torch.Tensor, base_positions: torch.Tensor,
                              block_table: torch.Tensor, out: torch.Tensor,
                              sampling: TreeSampling | None = None) -> None:
        """propose() of a tree for a batch the target ran as the full graph for desc, inside the runner's whole
        tree step: the [desc.num_reqs, N] drafts into out. num_reqs ([1] on the device) holds how many rows are
        real; the padded ones draft nothing and write no cache slot. sampling: a sampled step's draws
        (TreeDraws.in_graph); None: every request's top guesses."""
        for_logits, fed_back = self._prefill(desc, metadata, target_out)
        self._draft_tree(for_logits, fed_back, last_token_indices[:desc.num_reqs], kv_moves, base_positions,
                         block_table, num_reqs, out, sampling=sampling)

    def _draft_tree(self, for_logits: torch.Tensor, fed_back: torch.Tensor, last: torch.Tensor,
                    kv_moves: tuple[torch.Tensor, torch.Tensor] | None, base_positions: torch.Tensor,
                    block_table: torch.Tensor, num_reqs: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, masks: DraftMasks | None = None,
                    shared_picks: bool = False, sampling: TreeSampling | None = None) -> torch.Tensor:
        """After the prefill: the verified trees' cache moves in the drafter's cache (its prefill wrote the tree
        slots), then the next tree from the prefill's states at each last accepted token (masked by the
        grammars along its paths where masks are given; each depth's guesses rank 0's with shared_picks; a
        sampling request's children drawn with sampling)."""
        if kv_moves is not None:
            self.move_kv(*kv_moves)
        return draft_tree(self, self.tree_tables, for_logits.index_select(0, last), fed_back.index_select(0, last),
                          base_positions, block_table, num_reqs, out, masks, shared_picks, sampling)

    def _tree_sampling(self, inp: DraftInput) -> TreeSampling | None:
        """How a batch with a request that samples draws its trees' children; None where every request drafts
        its top guesses (a greedy batch, or a rank > 0 of a sharded drafter, which takes rank 0's)."""
        if inp.sampling is None or inp.sampling.all_greedy:
            return None
        return self.tree_draws.eager(inp.sampling, inp.rows)

    def _keep_feedback(self, n: int, fed_back: torch.Tensor | None, last: torch.Tensor) -> None:
        """The prefill's state to feed back at each request's last accepted token, into the decode steps' rows."""
        if self.feedback is not None and fed_back is not None:
            torch.index_select(fed_back, 0, last, out=self.feedback[:n])

    def _seed_greedy_loop(self, n: int, for_logits: torch.Tensor | None, last: torch.Tensor,
                          last_tokens: torch.Tensor) -> None:
        """What the greedy loop drafts from, rows < n: the prefill's hidden state at each last accepted token
        where the prefill drafts, else the last tokens themselves."""
        if self.first_hidden is not None:
            torch.index_select(for_logits, 0, last, out=self.first_hidden[:n])
        else:
            self.decode_tokens[:n].copy_(last_tokens)

    def _run_decode_step(self, n: int, step: int, inp: DraftInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        graphs = self.decode_graphs
        desc = graphs.dispatch(n, n, 1) if graphs else BatchDescriptor(CUDAGraphMode.NONE, n, n, 1)
        if desc.mode is CUDAGraphMode.FULL:
            metadata = graphs.metadata[desc.key]
        else:
            max_seq = min(inp.max_base_position + step, self.max_position - 1) + 1
            metadata = self._decode_metadata(desc, inp.block_table, max_seq)
        return graphs.run(desc, self._decode, metadata) if graphs else self._decode(desc, metadata)

    @staticmethod
    def _argmax_picks(inp: DraftInput) -> bool:
        """Whether every draft is the argmax of the unmasked logits, which every rank of a sharded drafter
        computes alike."""
        return inp.masks is None and (inp.sampling.all_greedy if inp.sampling is not None else not inp.shared_picks)

    def _pick(self, logits: torch.Tensor, inp: DraftInput, j: int) -> torch.Tensor:
        """Draft j of each request: argmax for greedy requests, else a sample from q kept for verification.
        In a grammar step the logits are masked with each request's grammar state after its drafts before j
        first, so q is the masked, renormalised distribution the draft is really drawn from: rejection
        sampling is exact only with the q the draft came from. With shared_picks rank 0's drafts are
        broadcast, and a rank > 0 (sampling None) takes them."""
        b = inp.sampling
        if b is None:
            tokens = logits.argmax(dim=-1)
            return broadcast_from_rank0(tokens) if inp.shared_picks else tokens
        if inp.masks is not None:
            logits = mask_draft_logits(logits, inp.masks.masks(range(j, j + 1)))
        tokens = logits.argmax(dim=-1)
        if not b.all_greedy:
            q = filtered_probs(logits, b)
            tokens = torch.where(b.greedy, tokens, sample_from_probs(q, b.generators, self.generator))
            self.draft_probs[:, j].index_copy_(0, inp.rows, q)
        if inp.masks is not None:
            inp.masks.follow(tokens[:, None])
        return broadcast_from_rank0(tokens) if inp.shared_picks else tokens
