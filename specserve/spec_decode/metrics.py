"""Acceptance statistics of speculative decoding, per request and engine-wide."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_steps: int = 0  # verification steps (each emits accepted + 1 tokens)
    num_drafted: int = 0
    num_accepted: int = 0
    num_emitted: int = 0  # accepted + bonus tokens over all steps
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_emitted += num_accepted + 1
        grow = num_drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < num_accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step (accepted + bonus)."""
        return self.num_emitted / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def as_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_per_position": self.acceptance_per_position,
        }
