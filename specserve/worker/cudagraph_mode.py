"""CUDA graph modes (same names and meaning as vLLM's) and what each runs per batch kind: docs/design.md,
'Graph modes'."""
from __future__ import annotations

from enum import Enum


class CUDAGraphMode(Enum):
    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"

    def runtime_mode(self, uniform_decode: bool) -> CUDAGraphMode:
        """How a batch runs: NONE (eager), PIECEWISE or FULL. uniform_decode: every request has the
        same query length, 1 (decode) or 1 + k (verifying k drafts)."""
        if self in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            return self
        if uniform_decode:
            return CUDAGraphMode.FULL
        return CUDAGraphMode.PIECEWISE if self is CUDAGraphMode.FULL_AND_PIECEWISE else CUDAGraphMode.NONE

    @property
    def has_full(self) -> bool:
        return self in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)

    @property
    def has_piecewise(self) -> bool:
        return self in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)

    def for_draft_decode(self) -> CUDAGraphMode:
        """Draft decode steps never run PIECEWISE: a mode with full graphs gives FULL_DECODE_ONLY, any other
        NONE. Piecewise padding would give a one-token draft step more tokens than requests, and attention would
        read stale rows for the extra ones (docs/invariants.md, 'Draft decode is never piecewise')."""
        return CUDAGraphMode.FULL_DECODE_ONLY if self.has_full else CUDAGraphMode.NONE
