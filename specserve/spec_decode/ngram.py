"""N-gram (prompt lookup) proposer: draft the tokens that followed the last n-gram before.

Find the longest n in [min_n, max_n] such that the context's last n tokens
occurred earlier, and among those occurrences take the earliest, as vLLM does.
The draft is the up to k tokens that followed that occurrence, fewer if the
context ends first. An occurrence may overlap the suffix itself (in "a a a" the
2-gram "a a" at position 0 is followed by "a") but must end before the last
token, so at least one token follows it.

Rather than comparing every window for every n, the search first keeps the
positions holding the last token (one vectorized pass over the context), then
extends all those candidates backwards together, one token per step, up to
max_n: tens of microseconds for a 4k-token numpy context (converting a
Python list of that length costs more than the search).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(token_ids: np.ndarray | Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k draft tokens for the context `token_ids`; [] when no n-gram matches."""
    _check_ngram_range(min_n, max_n)
    tokens = np.asarray(token_ids)
    if k <= 0 or len(tokens) < 2:
        return []
    # ends[c] is where candidate c's continuation starts: tokens[ends[c] - 1] == tokens[-1].
    ends = np.flatnonzero(tokens[:-1] == tokens[-1]) + 1
    if len(ends) == 0:
        return []
    lengths = _suffix_match_lengths(tokens, ends, max_n)
    longest = lengths.max()
    if longest < min_n:
        return []
    start = ends[np.argmax(lengths == longest)]  # argmax finds the first, i.e. earliest, hit
    return tokens[start:start + k].tolist()


def _suffix_match_lengths(tokens: np.ndarray, ends: np.ndarray, max_n: int) -> np.ndarray:
    """For each end e, the largest m <= max_n with tokens[e - m:e] == tokens[-m:]."""
    lengths = np.ones(len(ends), dtype=np.int64)  # the last token matches by construction
    still_matching = np.ones(len(ends), dtype=bool)
    # Since e <= len - 1, an occurrence can only be extended back by len - 2 tokens.
    for back in range(1, min(max_n, len(tokens) - 1)):
        positions = ends - 1 - back
        still_matching &= positions >= 0
        still_matching &= tokens[np.maximum(positions, 0)] == tokens[-1 - back]
        lengths += still_matching
    return lengths


def _check_ngram_range(min_n: int, max_n: int) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")


class NgramProposer:
    """Proposes up to k draft tokens per request by prompt lookup (see module docstring)."""

    def __init__(self, min_n: int, max_n: int, k: int):
        _check_ngram_range(min_n, max_n)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.min_n = min_n
        self.max_n = max_n
        self.k = k

    def propose(self, contexts: Sequence[np.ndarray | Sequence[int]]) -> list[list[int]]:
        """One draft list per context (prompt + generated tokens); empty where nothing matches."""
        return [propose_ngram(tokens, self.min_n, self.max_n, self.k) for tokens in contexts]
