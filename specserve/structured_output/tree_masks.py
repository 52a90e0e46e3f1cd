"""A step's verification masks for trees of drafts: each request's tree walked in one xgrammar call
(GrammarMatcher.traverse_draft_tree: the walk, each node's fill and the rollback in C++), the requests spread over
the threads that fill_threads.py gives the step's rows (the call releases the GIL).

What must hold: the rows are RequestGrammar.fill_masks' for the same tree, row for row; step_masks.py reads them so.
xgrammar writes a node it does not walk into (its draft refused, or a stop token that ends the grammar) as a row
allowing nothing, where fill_masks leaves the row as it was (allowing every token: the samplers read it, though no
walk is accepted into it). Such a node is one whose draft its parent's row does not allow, or a stop token: those
rows are set to allow every token again. A node below such a node is never walked and keeps its row.
"""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import numpy as np
import torch

from specserve.structured_output import fill_threads as thread_table
from specserve.structured_output.request_grammar import RequestGrammar


def fill_tree_masks(grammars: Sequence[RequestGrammar], host: torch.Tensor, first_rows: Sequence[int],
                    drafts: Sequence[Sequence[int]], parents: Sequence[int]) -> None:
    """grammars[i]'s masks along its tree of drafts[i] (node j >= 1 is drafts[i][j - 1], a child of parents[j]; a
    request with fewer drafts has the tree's first nodes) into host[first_rows[i] + j], j = 0 .. len(drafts[i]).
    The rows must allow every token before the call; a grammar already ended leaves its rows so."""
    live = [i for i, g in enumerate(grammars) if not g.terminated]
    if not live:
        return
    walks = [_Walk(grammars[i].matcher, host[first_rows[i]:first_rows[i] + len(drafts[i]) + 1], drafts[i],
                   tuple(parents[:len(drafts[i]) + 1])) for i in live]
    threads = min(thread_table.fill_threads(sum(w.nodes for w in walks)), len(walks))
    if threads == 1:
        _traverse(walks)
    else:
        chunks = [walks[t::threads] for t in range(threads)]
        pending = [_pool(threads - 1).submit(_traverse, chunk) for chunk in chunks[1:]]
        _traverse(chunks[0])
        for p in pending:
            p.result()
    _allow_all_past_the_walks(host, [first_rows[i] for i in live], [drafts[i] for i in live], parents,
                              grammars[live[0]].matcher.stop_token_ids)


class _Walk:
    """One request's call: the tree as xgrammar takes it (each node's first child and next sibling, -1 for none)."""

    def __init__(self, matcher, rows: torch.Tensor, drafts: Sequence[int], parents: tuple[int, ...]):
        self.matcher, self.rows, self.nodes = matcher, rows, len(parents)
        self.first_child, self.next_sibling = _links(parents)
        self.tokens = torch.tensor([0, *drafts], dtype=torch.int64)


def _traverse(walks: list[_Walk]) -> None:
    for w in walks:
        w.matcher.traverse_draft_tree(w.first_child, w.next_sibling, w.tokens, w.rows)


@cache
def _links(parents: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    first_child, next_sibling = [-1] * len(parents), [-1] * len(parents)
    for j in range(len(parents) - 1, 0, -1):  # children in index order, as fill_masks visits them
        next_sibling[j], first_child[parents[j]] = first_child[parents[j]], j
    return torch.tensor(first_child, dtype=torch.int64), torch.tensor(next_sibling, dtype=torch.int64)


@cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="specserve-tree-masks")


def _allow_all_past_the_walks(host: torch.Tensor, first_rows: list[int], drafts: list[Sequence[int]],
                              parents: Sequence[int], stop_tokens: Sequence[int]) -> None:
    """Rows of nodes whose draft their parent's row refuses, or that end the grammar, allow every token again."""
    child, parent, token = [], [], []
    for first, ds in zip(first_rows, drafts):
        for j, t in enumerate(ds, start=1):
            child.append(first + j)
            parent.append(first + parents[j])
            token.append(t)
    if not child:
        return
    rows = host.numpy().view(np.uint32)
    token = np.asarray(token, dtype=np.int64)
    allowed = (rows[np.asarray(parent), token >> 5] >> (token & 31).astype(np.uint32)) & 1
    reset = np.asarray(child)[(allowed == 0) | np.isin(token, np.asarray(stop_tokens, dtype=np.int64))]
    rows[reset] = np.uint32(0xFFFFFFFF)
