"""Where a pick of ranked columns goes when it builds a level of a tree of drafts (tree_drafting.py).

Kept apart from the pick kernel (argmax.py) so that the torch path, which CPU installs without Triton
run, can use it too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PickScatter:
    """Where pick_chunks sends the picks instead of returning them as [rows, top]: rows come in groups of `group`
    (the parents of one request's tree level, tree_drafting.py), and pick `rank` of a group's row p goes to
    column dest[p * top + rank] (-1: nowhere) of the group's row of out, and offset columns further in also.
    columns is the same map the other way: out's column j takes pick columns[j] of its group's flattened picks."""

    dest: torch.Tensor  # [group * top] int64
    columns: torch.Tensor  # [width] int64
    group: int
    out: torch.Tensor  # [groups, width] int64, contiguous
    also: torch.Tensor  # [groups, >= offset + width] int64, unit column stride
    offset: int

    def apply(self, picks: torch.Tensor) -> torch.Tensor:
        """The scatter in torch ops, of picks [rows, top] (the CPU path and the kernel's reference); returns out."""
        torch.index_select(picks.reshape(self.out.shape[0], -1), 1, self.columns, out=self.out)
        self.also[:, self.offset:self.offset + self.out.shape[1]] = self.out
        return self.out
