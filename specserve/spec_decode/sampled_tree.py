"""Trees of drafts at temperature > 0: children drawn from the head, verified by recursive rejection sampling.

A greedy request's tree holds the head's top guesses and its walk follows the target's argmax (tree_verify.py).
A sampling request's would accept little that way, so its children are drawn instead: the r-th child of a node
is the r-th draw, without replacement, from the head's distribution q there (its logits under the request's
temperature, top-k, top-p and min-p), the draws taken as the top of q / Exponential(1) noise (Gumbel-top-k, the
order in which sequential draws without replacement come). Verification is recursive rejection sampling
without replacement (Jeon et al., 2024, 'Recursive Speculative Decoding'): at a node with target distribution
p, the children x_1.. are tested in order; x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), and on
its rejection p_{i+1} = norm(max(p_i - q_i, 0)) and q_{i+1} = q_i without x_i, renormalised. An accepted child
continues the walk from its own node; when every child is rejected (or there is none), one token is drawn from
the last p_i and the request stops. Each emitted token is then distributed as the target's own.

What must hold:
- The q a child was drawn from is the q verification reads: q is kept in bfloat16 (a row per node that has
  children, per request: TreeDraws.node_probs), and the draws are made from that rounded copy too.
- A draw exists only while q has mass left: a node's children past its support repeat its first child's token,
  which verification skips (q without the first child has no mass there), and a rejected token has no mass in
  the p it leaves (p_i(x) < q_i(x) for a rejected x): so the token a request stops with is never one of its
  node's tried children, and retrace_tree (tree_verify.py) walks the same path from the emitted tokens alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.sample.sampler import SamplingBatch, exponential_noise, repeated_rows_probs
from specserve.spec_decode.tree_verify import TreeTables

# q is kept in this type; the draws and the verification both read the rounded values (module docstring).
NODE_PROBS_DTYPE = torch.bfloat16


@dataclass
class TreeSampling:
    """The drafting side: what a batch's guesses are drawn with, for each depth's parents. [n] tensors each."""

    greedy: torch.Tensor  # bool: the request drafts its top guesses
    temperature: torch.Tensor  # float32, 1 on greedy rows
    rows: torch.Tensor  # int64: each request's row of node_probs
    node_probs: torch.Tensor  # [max requests + 1, tables.num_prob_slots, V] NODE_PROBS_DTYPE (TreeDraws)
    tables: TreeTables
    generator: torch.Generator | None  # for the requests without a seed of their own
    # The batch, where some request draws with more than its temperature and the engine's generator (top-k,
    # top-p, min-p, a seed: SamplingBatch.temperature_only), whose filters and generators q and the noise then
    # take, eagerly; None for draws a CUDA graph can record.
    filtered: SamplingBatch | None = None

    def guesses(self, logits: torch.Tensor, k: int, nodes: range, *, use_triton: bool | None = None) -> torch.Tensor:
        """[n * m, k]: after each of the m nodes of one depth (logits [n * m, V], request-major), the k children
        of a greedy request's node (the top guesses) or k draws without replacement from a sampling request's
        q, which is kept for the nodes that have children. Without filters, on CUDA, three Triton launches
        (kernels/tree_draws.py); torch ops elsewhere (use_triton forces either where there are no filters)."""
        n = self.rows.shape[0]
        m = logits.shape[0] // n
        slots = self.tables.level_prob_slots[self.tables.tree.depths[nodes.start]]
        if self.filtered is None and (logits.is_cuda if use_triton is None else use_triton):
            from specserve.kernels.tree_draws import draw_children
            dest = torch.full((n, m), -1, dtype=torch.int64, device=logits.device)
            if slots is not None:
                dest[:, slots.columns] = self.rows[:, None] * self.tables.num_prob_slots + slots.slots[None, :]
            return draw_children(logits, self.temperature, self.greedy, k, dest.view(-1), self.node_probs,
                                 self.generator)
        if self.filtered is None:
            q, generators = (logits / self.temperature.repeat_interleave(m)[:, None]).softmax(dim=-1), []
        else:
            q = repeated_rows_probs(logits, self.filtered, m)
            generators = [g for g in self.filtered.generators for _ in range(m)]
        kept = q.to(NODE_PROBS_DTYPE)
        # One top-k for both kinds of rows: a greedy row's q is softmax(logits), whose top is the logits' top.
        drawn = kept.float() / exponential_noise(tuple(q.shape), generators, self.generator, q.device)
        top_scores, top = torch.where(self.greedy.repeat_interleave(m)[:, None], q, drawn).topk(k, dim=-1)
        if slots is not None:
            self.node_probs[self.rows[:, None], slots.slots[None, :]] = (
                kept.view(n, m, -1).index_select(1, slots.columns))
        # Past q's support a draw scores 0: it repeats the first draw, which verification then skips.
        return torch.where(top_scores > 0, top, top[:, :1])


class TreeDraws:
    """The kept distributions, and the persistent inputs of the drafter's sampled tree graphs, which draw the
    children of a batch whose requests draw with their temperature alone (TreeSampling.filtered None). The
    draws come from the engine's generator, registered with each graph (worker/graph_recorder.py), so every
    replay draws new numbers as the eager passes would."""

    def __init__(self, max_num_reqs: int, tables: TreeTables, vocab_size: int, device: torch.device,
                 generator: torch.Generator | None):
        self.tables = tables
        self.generator = generator
        # One row per running request, and a spare one that a padded graph's rows write into.
        self.node_probs = torch.zeros(max_num_reqs + 1, tables.num_prob_slots, vocab_size, dtype=NODE_PROBS_DTYPE,
                                      device=device)
        self.spare_row = max_num_reqs
        self.greedy = torch.ones(max_num_reqs, dtype=torch.bool, device=device)
        self.temperature = torch.ones(max_num_reqs, dtype=torch.float32, device=device)
        self.rows = torch.full((max_num_reqs,), self.spare_row, dtype=torch.int64, device=device)

    def eager(self, batch: SamplingBatch, rows: torch.Tensor) -> TreeSampling:
        """The sampling of the n requests of batch (rows [n]) drafted pass by pass."""
        return TreeSampling(batch.greedy, batch.temperature, rows, self.node_probs, self.tables, self.generator,
                            None if batch.temperature_only else batch)

    def stage(self, batch: SamplingBatch, rows: torch.Tensor) -> None:
        """A graph's inputs for the n requests of batch (the rows past them are left as they are)."""
        n = rows.shape[0]
        self.greedy[:n].copy_(batch.greedy)
        self.temperature[:n].copy_(batch.temperature)
        self.rows[:n].copy_(rows)

    def in_graph(self, n: int, num_reqs: torch.Tensor) -> TreeSampling:
        """The sampling a graph padded to n requests records, reading the staged inputs; num_reqs ([1] on the
        device) holds how many are real: the padded rows, whatever they hold, keep their q in the spare row."""
        real = torch.arange(n, device=num_reqs.device) < num_reqs
        return TreeSampling(self.greedy[:n], self.temperature[:n], torch.where(real, self.rows[:n], self.spare_row),
                            self.node_probs, self.tables, self.generator)


@dataclass
class SampledWalk:
    """Recursive rejection sampling over n trees, [n, ...] each."""

    accepted: torch.Tensor  # [n] int64: drafts accepted
    path: torch.Tensor  # [n, D + 1] int64: tree indices of the root and each accepted draft, 0 past them
    tokens: torch.Tensor  # [n, D + 1] int64: the accepted drafts, then the token drawn at the stop, -1 past it


def walk_sampled_trees(target_probs: torch.Tensor, node_tokens: torch.Tensor, num_drafts: torch.Tensor,
                       node_probs: torch.Tensor, tables: TreeTables, uniform: torch.Tensor,
                       noise: torch.Tensor) -> SampledWalk:
    """Recursive rejection sampling (module docstring) of n trees. target_probs [n, W, V]: the target's
    distribution after each tree index up to the last one verified; node_tokens [n, N + 1]: each index's token
    (column 0 not read); num_drafts [n]: a tree cut to its first num_drafts drafts; node_probs
    [n, num_prob_slots, V]: q at each node with children; uniform [n, N + 1]: one draw in [0, 1) per tree index,
    read by the test of that child; noise [n, V]: Exponential(1), for the token drawn where the request stops."""
    n, depth = node_tokens.shape[0], tables.tree.depth
    device = node_tokens.device
    rows = torch.arange(n, device=device)
    current = torch.zeros(n, dtype=torch.int64, device=device)
    accepted = torch.zeros(n, dtype=torch.int64, device=device)
    path = torch.zeros(n, depth + 1, dtype=torch.int64, device=device)
    tokens = torch.full((n, depth + 1), -1, dtype=torch.int64, device=device)
    walking = torch.ones(n, dtype=torch.bool, device=device)
    # A node of the last depth has no children: its round only draws the bonus token.
    for d in range(1, depth + 2):
        p = target_probs[rows, current]
        slot = tables.prob_slots[current]
        q = node_probs[rows, slot.clamp(min=0)].float() * (slot >= 0)[:, None]
        q = _normalised(q)
        found = torch.zeros(n, dtype=torch.bool, device=device)
        chosen = current.clone()
        kids = tables.children[current]
        for r in range(kids.shape[1]):
            child = kids[:, r]
            at = child.clamp(min=0)[:, None]
            x = node_tokens.gather(1, at)
            qx, px = q.gather(1, x).squeeze(1), p.gather(1, x).squeeze(1)
            tried = walking & ~found & (child >= 0) & (child <= num_drafts) & (qx > 0)
            # u < min(1, p / q) without the division.
            taken = tried & (uniform.gather(1, at).squeeze(1) * qx < px)
            refused = (tried & ~taken)[:, None]
            p = torch.where(refused, _residual(p, q, x), p)
            q = torch.where(refused, _normalised(q.scatter(1, x, 0.0)), q)
            found |= taken
            chosen = torch.where(taken, child, chosen)
        stops = walking & ~found
        walking &= found
        # Round d emits the request's d-th token: the child it accepts, or a draw from what p is left.
        emitted = torch.where(walking, node_tokens.gather(1, chosen[:, None]).squeeze(1), (p / noise).argmax(dim=1))
        tokens[:, d - 1] = torch.where(stops | walking, emitted, tokens[:, d - 1])
        if d <= depth:
            current = torch.where(walking, chosen, current)
            path[:, d] = torch.where(walking, current, 0)
            accepted += walking.long()
    return SampledWalk(accepted, path, tokens)


def _normalised(x: torch.Tensor) -> torch.Tensor:
    """x / its row sums; a row without mass stays zero."""
    total = x.sum(dim=1, keepdim=True)
    return torch.where(total > 0, x / total.clamp_min(torch.finfo(x.dtype).tiny), x)


def _residual(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) after x was refused (x keeps no mass: p(x) < q(x)). Without mass left (p equal to q up
    to rounding), p without x."""
    residual = (p - q).clamp_min(0.0)
    return torch.where(residual.sum(dim=1, keepdim=True) > 0, _normalised(residual), _normalised(p.scatter(1, x, 0.0)))


def walked_targets(walk: SampledWalk, argmax: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """[n, W]: a target token per tree index under which tree_verify's walk takes each sampling request's path of
    `walk` (and emits its tokens), and each greedy request's own walk on `argmax` [n, W]: a sampling request's
    index on its path holds the next token it emits (the accepted child's, then the drawn one at the stop).
    Passing through verify_tree keeps one walk for the cache moves and the outputs."""
    table = argmax.clone()
    # Last to first, so that the root, where every padded path entry points, is written last.
    for d in range(walk.path.shape[1] - 1, -1, -1):
        at = walk.path[:, d:d + 1]
        mine = ~greedy & (d <= walk.accepted)
        table.scatter_(1, at, torch.where(mine, walk.tokens[:, d], table.gather(1, at).squeeze(1))[:, None])
    return table


def sampled_tree_targets(target_probs: torch.Tensor, argmax: torch.Tensor, greedy: torch.Tensor,
                         input_ids: torch.Tensor, index: torch.Tensor, num_drafts: torch.Tensor,
                         node_probs: torch.Tensor, rows: torch.Tensor, tables: TreeTables, uniform: torch.Tensor,
                         noise: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """[n, W]: walked_targets of walk_sampled_trees for n requests whose trees' first W indices were verified
    (target_probs [n, W, V], argmax [n, W]; greedy [n] bool): each index's token is input_ids[index[:, j]]
    (index [n, W]), each request's q is its row of node_probs (rows [n]), and uniform is [n, W]. One Triton
    launch on CUDA (kernels/sampled_tree.py), torch ops elsewhere (use_triton forces either)."""
    if target_probs.is_cuda if use_triton is None else use_triton:
        from specserve.kernels.sampled_tree import sampled_tree_targets_triton
        return sampled_tree_targets_triton(target_probs, argmax, greedy, input_ids, index, num_drafts, node_probs,
                                           rows, tables, uniform, noise)
    # The walk reads every child's column; those past the verified ones are never tested.
    past = tables.tree.num_nodes + 1 - index.shape[1]
    node_tokens = input_ids[torch.cat([index, index[:, -1:].expand(-1, past)], dim=1)]
    walk = walk_sampled_trees(target_probs, node_tokens, num_drafts, node_probs.index_select(0, rows), tables,
                              torch.cat([uniform, uniform.new_ones(uniform.shape[0], past)], dim=1), noise)
    return walked_targets(walk, argmax, greedy)
