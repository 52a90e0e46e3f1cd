"""The draft vocabulary: the target tokens the head can propose.

A head drafts from the tokens the target actually emits most, so its lm_head
covers a fraction of the target vocabulary at a fraction of the cost. Draft
id i maps to the i-th smallest chosen target id, stored as EAGLE-3 does:
d2t[i] = target_id - i (so target = draft + d2t[draft]) and t2d, a mask over
the target vocabulary marking the chosen ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftVocab:
    draft_to_target: torch.Tensor  # [draft_vocab_size] int64, ascending target ids
    target_vocab_size: int
    coverage: float  # share of the counted tokens that are in the draft vocabulary

    @property
    def size(self) -> int:
        return self.draft_to_target.shape[0]

    @property
    def d2t(self) -> torch.Tensor:
        return self.draft_to_target - torch.arange(self.size)

    @property
    def t2d(self) -> torch.Tensor:
        return torch.zeros(self.target_vocab_size, dtype=torch.bool).index_fill_(0, self.draft_to_target, True)

    @property
    def target_to_draft(self) -> torch.Tensor:
        """[target_vocab_size] int64: each target id's draft id, -1 for ids outside the draft vocabulary."""
        out = torch.full((self.target_vocab_size,), -1, dtype=torch.int64)
        return out.index_copy_(0, self.draft_to_target, torch.arange(self.size))


def _token_counts(token_lists: list[list[int]], target_vocab_size: int) -> torch.Tensor:
    flat = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.int64)
    return torch.bincount(flat, minlength=target_vocab_size)


def _vocab(chosen: torch.Tensor, counts: torch.Tensor) -> DraftVocab:
    total = int(counts.sum())
    coverage = float(counts[chosen].sum()) / total if total else 0.0
    return DraftVocab(chosen, counts.numel(), coverage)


def build_draft_vocab(token_lists: list[list[int]], target_vocab_size: int, draft_vocab_size: int) -> DraftVocab:
    """The draft_vocab_size most frequent ids in token_lists; ties, and slots no token filled, go to lower ids."""
    counts = _token_counts(token_lists, target_vocab_size)
    # A stable sort keeps equal counts in id order.
    return _vocab(torch.argsort(-counts, stable=True)[:draft_vocab_size].sort().values, counts)


def given_draft_vocab(draft_to_target: torch.Tensor, token_lists: list[list[int]],
                      target_vocab_size: int) -> DraftVocab:
    """A vocabulary fixed beforehand (an initial head's), with its coverage of token_lists."""
    return _vocab(draft_to_target, _token_counts(token_lists, target_vocab_size))
