"""One request's grammar state: an xgrammar GrammarMatcher that has accepted exactly the request's output
tokens so far (the request owns it; engine/request.py).

What must hold: the matcher moves forward only in accept(), with tokens the request keeps; a step's masks
(structured_output/step_masks.py) are built from it once it has accepted every token before the step, and walk
the step's drafts and roll back before the step samples.
"""
from __future__ import annotations


class RequestGrammar:
    def __init__(self, matcher):
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance past a token the request keeps; False when the grammar does not allow it (a masked
        step never yields one)."""
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the request ends."""
        return self.matcher.is_terminated()
