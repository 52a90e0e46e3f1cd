"""Each running request's KV block ids, kept in one row of a host array across steps.

A request's block list only grows while it runs (a block every block_size
tokens) and is dropped whole when the request finishes or is preempted, when
its row is cleared. So a step appends the few ids added since the last one,
and the step's table is one gather of its requests' rows, instead of
converting every request's whole list of Python ints every step.
"""
from __future__ import annotations

import numpy as np


class HostBlockTable:
    def __init__(self, max_rows: int, max_blocks_per_row: int):
        self.table = np.zeros((max_rows, max_blocks_per_row), dtype=np.int64)
        self.lengths = [0] * max_rows  # ids held per row; a Python list, read once per request per step

    def sync(self, row: int, block_ids: list[int]) -> None:
        """Bring row up to date with the request's block list (the KV cache manager's, which only grows)."""
        held = self.lengths[row]
        n = len(block_ids)
        if n > held:
            self.table[row, held:n] = block_ids[held:]
            self.lengths[row] = n

    def clear(self, row: int) -> None:
        self.table[row, :self.lengths[row]] = 0
        self.lengths[row] = 0

    def gather(self, rows: list[int]) -> np.ndarray:
        """The block table of a step whose requests hold `rows`, in that order ([len(rows), longest row],
        zeros past each row's end)."""
        width = max(self.lengths[r] for r in rows)
        return self.table[rows, :width]
