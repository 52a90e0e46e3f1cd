"""The step times the dynamic speculation policy weighs (spec_decode/policy.py): seconds of one steady decode step
of the engine per batch size, by the drafts each request verifies and proposes in it (0: a plain decode step with
the drafter idle). Measured at start-up (engine/step_costs_measure.py) or read from a JSON file that save() wrote.
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path

from specserve.errors import ConfigError


@dataclass(frozen=True)
class StepCosts:
    batch_sizes: tuple[int, ...]  # ascending
    # drafts per request -> seconds of one step at each of batch_sizes
    seconds: dict[int, tuple[float, ...]]
    # What was measured: the device, model and speculator, for the reader of a saved table.
    source: str = ""

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ConfigError("speculative_config.cost_table", msg)

        sizes = self.batch_sizes
        if not sizes or any(type(b) is not int or b < 1 for b in sizes) or list(sizes) != sorted(set(sizes)):
            bad(f"batch_sizes must be distinct positive integers in ascending order, got {list(sizes)}")
        if 0 not in self.seconds or len(self.seconds) < 2:
            bad(f"needs the step times without drafts (0) and with drafts, got {sorted(self.seconds)}")
        for drafts, times in self.seconds.items():
            if type(drafts) is not int or drafts < 0:
                bad(f"drafts per request must be integers >= 0, got {drafts!r}")
            if len(times) != len(sizes) or not all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0
                                                  for t in times):
                bad(f"the times with {drafts} drafts must be {len(sizes)} positive numbers (one per batch size), "
                    f"got {list(times)}")

    @property
    def draft_counts(self) -> tuple[int, ...]:
        return tuple(sorted(self.seconds))

    def step_seconds(self, drafts: int, batch: int) -> float:
        """Seconds of a step of `batch` requests with `drafts` each: linear between the measured batch sizes, the
        nearest one's beyond them."""
        sizes, times = self.batch_sizes, self.seconds[drafts]
        i = bisect.bisect_left(sizes, batch)
        if i == 0:
            return times[0]
        if i == len(sizes):
            return times[-1]
        lo, hi = sizes[i - 1], sizes[i]
        return times[i - 1] + (times[i] - times[i - 1]) * (batch - lo) / (hi - lo)

    def to_dict(self) -> dict:
        return {"source": self.source, "batch_sizes": list(self.batch_sizes),
                "seconds": {str(d): list(t) for d, t in sorted(self.seconds.items())}}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepCosts:
        try:
            d = json.loads(Path(path).expanduser().read_text())
            return cls(tuple(d["batch_sizes"]), {int(k): tuple(v) for k, v in d["seconds"].items()},
                       d.get("source", ""))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError("speculative_config.cost_table",
                              f"{str(path)!r} is not a table of step times ({type(e).__name__}: {e}); write one "
                              "with StepCosts.save, or leave it out to measure at start-up") from e
