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
        self._cover_positions(num_drafted)
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < num_accepted)

    def _cover_positions(self, num_positions: int) -> None:
        grow = num_positions - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow

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
            "num_emitted": self.num_emitted,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_per_position": self.acceptance_per_position,
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
        }

    @classmethod
    def from_dict(cls, d: dict) -> SpecDecodeStats:
        """The statistics as_dict gave."""
        return cls(d["num_steps"], d["num_drafted"], d["num_accepted"], d["num_emitted"],
                   list(d["accepted_per_position"]), list(d["drafted_per_position"]))

    def add(self, other: SpecDecodeStats) -> None:
        """Count other's steps too (the statistics of several sequences together)."""
        self.num_steps += other.num_steps
        self.num_drafted += other.num_drafted
        self.num_accepted += other.num_accepted
        self.num_emitted += other.num_emitted
        self._cover_positions(len(other.drafted_per_position))
        for i, (d, a) in enumerate(zip(other.drafted_per_position, other.accepted_per_position)):
            self.drafted_per_position[i] += d
            self.accepted_per_position[i] += a
