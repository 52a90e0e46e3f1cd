"""One request's grammar state: an xgrammar GrammarMatcher that has accepted exactly the request's output
tokens so far (the request owns it; engine/request.py).

What must hold: the matcher moves forward only in accept(), with tokens the request keeps. Masks are built
from it once it has accepted every token before the step (structured_output/step_masks.py for the target's,
draft_masks.py for the drafter's); fill_masks walks drafts (and the step's new tokens, for the drafter's masks)
and rolls back before it returns.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


class RequestGrammar:
    def __init__(self, matcher):
        self.matcher = matcher
        self.accepted = 0  # the tokens accept() took: which state the matcher is in, for masks built ahead

    def accept(self, token_id: int) -> bool:
        """Advance past a token the request keeps; False when the grammar does not allow it (a masked
        step never yields one)."""
        if not self.matcher.accept_token(token_id):
            return False
        self.accepted += 1
        return True

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the request ends."""
        return self.matcher.is_terminated()

    def walk(self, tokens: Sequence[int]) -> int:
        """Accept tokens on the matcher (not the request's: the caller rolls them back) up to the first the
        grammar refuses or that follows its end; returns how many it took. The path is open (a mask may be
        built after it) when it took them all and the grammar has not ended."""
        m, taken = self.matcher, 0
        for token in tokens:
            if m.is_terminated() or not m.accept_token(token):
                break
            taken += 1
        return taken

    def fill_masks(self, bitmask: torch.Tensor, first_row: int, drafts: Sequence[int],
                   parents: Sequence[int] | None = None, nodes: Sequence[int] | None = None,
                   prefix: Sequence[int] = ()) -> None:
        """Write the tokens allowed after each node of a tree of drafts into bitmask[first_row + r], r the
        node's place in `nodes` (default: every node, row r for node r).

        Node 0 is the state after the request's tokens and then `prefix`; node j >= 1 is drafts[j - 1], a child
        of node parents[j] (< j; parents None: a chain, the child of node j - 1). A node whose path the grammar
        refuses, or ends (a stop token), keeps its row as it is: a verification rejects that path before it,
        and a drafter's pick there is never accepted."""
        m = self.matcher
        num_nodes = len(drafts) + 1
        rows = {node: r for r, node in enumerate(range(num_nodes) if nodes is None else nodes)}
        children: list[list[int]] = [[] for _ in range(num_nodes)]
        # Only nodes on the way to a row are walked.
        needed = [node in rows for node in range(num_nodes)]
        for j in range(num_nodes - 1, 0, -1):
            parent = j - 1 if parents is None else parents[j]
            children[parent].append(j)
            needed[parent] |= needed[j]

        def visit(node: int) -> None:
            if node in rows:
                m.fill_next_token_bitmask(bitmask, first_row + rows[node])
            for child in reversed(children[node]):
                if needed[child] and m.accept_token(drafts[child - 1]):
                    if not m.is_terminated():
                        visit(child)
                    m.rollback(1)

        walked = self.walk(prefix)
        if walked == len(prefix) and not m.is_terminated():
            visit(0)
        if walked:
            m.rollback(walked)
