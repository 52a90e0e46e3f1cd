"""One request's grammar state: an xgrammar GrammarMatcher that has accepted exactly the request's output
tokens so far (the request owns it; engine/request.py).

What must hold: the matcher moves forward only with tokens the request keeps: in accept(), or ahead of the
request in advance(), whose results accept() then hands out in order (the masks' worker thread advances a step's
tokens while the engine thread appends them: structured_output/mask_job.py). Masks are built from it once it has
accepted every token before the step (structured_output/step_masks.py for the target's, draft_masks.py for the
drafter's); fill_masks walks drafts (and the step's new tokens, for the drafter's masks) and rolls back before it
returns.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdvancedToken:
    """A token the matcher took (or refused) ahead of the request, and whether the grammar ended with it."""

    token_id: int
    allowed: bool
    ends: bool


class RequestGrammar:
    def __init__(self, matcher):
        self.matcher = matcher
        self.accepted = 0  # the tokens the matcher took: which state it is in, for masks built ahead
        self._advanced: deque[AdvancedToken] = deque()  # advance()'s results that accept() has not handed out
        self._ended = False

    def advance(self, tokens: Sequence[int]) -> None:
        """Move the matcher past tokens the request is about to append (through accept(), in the same order), up
        to the first the grammar refuses or that ends it. Tokens advanced but never appended (the request ended
        before them) are never rolled back: the request is done."""
        m = self.matcher
        for token in tokens:
            allowed = m.accept_token(token)
            ends = allowed and m.is_terminated()
            self.accepted += allowed
            self._advanced.append(AdvancedToken(token, allowed, ends))
            if ends or not allowed:
                return

    def accept(self, token_id: int) -> bool:
        """Advance past a token the request keeps; False when the grammar does not allow it (a masked
        step never yields one). A token advance() took is not taken again: its result is handed out."""
        if self._advanced:
            ahead = self._advanced.popleft()
            if ahead.token_id != token_id:
                raise RuntimeError(f"the grammar advanced past token {ahead.token_id} but the request appends "
                                   f"{token_id}: a step's tokens reached the grammar and the request differently")
            self._ended = ahead.ends
            return ahead.allowed
        if not self.matcher.accept_token(token_id):
            return False
        self.accepted += 1
        self._ended = self.matcher.is_terminated()
        return True

    @property
    def terminated(self) -> bool:
        """The grammar is complete and the last token accept() handed out was a stop token: the request ends."""
        return self._ended

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
