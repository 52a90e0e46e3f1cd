"""One request's grammar state: an xgrammar GrammarMatcher that has accepted exactly the request's output
tokens so far (the request owns it; engine/request.py).

What must hold: when a step that samples the request is launched, the matcher has accepted every output
token before it (requests with a grammar are scheduled synchronously, Request.needs_host_tokens), so the
masks fill_masks writes are those of the tokens the step really continues from. fill_masks walks the step's
drafts and rolls back before it returns: the matcher moves forward only in accept(), with tokens the
request keeps.
"""
from __future__ import annotations

import torch


class RequestGrammar:
    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    def accept(self, token_id: int) -> bool:
        """Advance past a token the request keeps; False when the grammar does not allow it (a masked
        step never yields one)."""
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the request ends."""
        return self.matcher.is_terminated()

    def fill_masks(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> None:
        """Write the allowed tokens of the position after the current tokens into bitmask[first_row], and of
        the position after draft j into bitmask[first_row + 1 + j], for the drafts the grammar allows in order.
        Rows past the first draft it refuses (or past a draft that ends the grammar) keep what they hold: the
        verification rejects that draft, so no token is taken from a later position."""
        m = self.matcher
        m.fill_next_token_bitmask(bitmask, first_row)
        walked = 0
        for j, token in enumerate(drafts):
            if m.is_terminated() or not m.accept_token(token):
                break
            walked += 1
            if m.is_terminated():
                break
            m.fill_next_token_bitmask(bitmask, first_row + 1 + j)
        if walked:
            m.rollback(walked)
