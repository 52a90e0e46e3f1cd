"""Learning rate: linear warm-up, then cosine decay to a floor."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# The decay ends at this share of the peak rather than at zero, so the last steps still learn.
FLOOR = 0.1


@dataclass
class WarmupCosine:
    peak: float
    warmup_steps: int
    total_steps: int
    # Whether total_steps was already cut to fit the time budget (a resumed run must not cut it again).
    fitted: bool = False

    def lr(self, step: int) -> float:
        """The rate for optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return self.peak * (step + 1) / self.warmup_steps
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        return self.peak * (FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * progress)))

    def state_dict(self) -> dict:
        return asdict(self)
