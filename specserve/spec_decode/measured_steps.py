"""Dynamic speculation in the steps the start-up table does not time: whether such a step drafts, from the
tokens per second steps of its kind were measured to yield with drafts and without (docs/design.md, 'Dynamic
speculation').

The start-up table (step_costs.py) times greedy steps without grammars, which run as whole-step graphs. Two kinds
of step cost more, and differently with drafts (policy.OffTable): a grammar step, whose host builds a mask for
every verified position and drafts depth by depth, waiting for each depth's drafts (docs/design.md, 'Structured
output'); and a step with a request that samples, which verifies and drafts outside the whole-step graph. What
that costs depends on the grammar, the batch and the host's CPU, and where it outweighs what the drafts gain,
drafting makes those requests slower than no speculation. So for these steps the policy measures instead of
predicting: each one's host time (the EngineCore.step call that launched it, which includes the waits for the
device and for the step before) and the tokens it emitted, as moving averages per decision (drafts or none)
and batch bucket (batch sizes up to the next power of two), and it takes the decision of the more tokens a
second.

What must hold:
- A measurement counts only where the step before made the same decision: a step's tokens come from the drafts
  the step before proposed and its time from the drafts it proposes, so the first step after a switch measures
  neither decision. A probe of the other decision therefore lasts PROBE_STEPS steps.
- Drafting is measured first (the default decision), then none; after that the decision in force is kept and
  the other probed every `probe_interval` steps of the kind and bucket, so a change in either is seen again.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Measurements a decision needs in a bucket before it is compared.
MIN_MEASURED = 3
# Steps a probe of the other decision lasts: its first is not measured (see above).
PROBE_STEPS = MIN_MEASURED + 1


@dataclass
class MeasuredRate:
    """Moving averages of a decision's tokens and seconds a step."""

    tokens: float = 0.0
    seconds: float = 0.0
    count: int = 0

    def record(self, tokens: int, seconds: float, weight: float) -> None:
        if self.count == 0:
            self.tokens, self.seconds = float(tokens), seconds
        else:
            self.tokens += weight * (tokens - self.tokens)
            self.seconds += weight * (seconds - self.seconds)
        self.count += 1

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class BucketState:
    current: int  # the decision in force: drafts per request
    probe_left: int = 0  # steps of the running probe of the other decision
    since_probe: int = 0  # decisions since the last probe ended
    probed: bool = False  # whether the other decision was ever probed here
    rates: dict[int, MeasuredRate] = field(default_factory=dict)


def bucket_of(batch: int) -> int:
    """Batch sizes up to the next power of two share their measurements."""
    return 1 << max(batch - 1, 0).bit_length()


class MeasuredSteps:
    """The decisions of one kind of step for a policy drafting `max_drafts` or none."""

    def __init__(self, max_drafts: int, weight: float, switch_margin: float, probe_interval: int):
        self.max_drafts = max_drafts
        self.weight = weight  # of one step's measurement in the moving averages
        self.switch_margin = switch_margin
        self.probe_interval = probe_interval
        self.buckets: dict[int, BucketState] = {}

    def choose(self, batch: int) -> int:
        """Drafts per request for a step of this kind with `batch` requests that yield tokens."""
        state = self.buckets.setdefault(bucket_of(batch), BucketState(self.max_drafts))
        other = self.max_drafts - state.current
        if state.probe_left:
            state.probe_left -= 1
            return other
        if not self._measured(state, state.current):
            return state.current
        if not state.probed or state.since_probe >= self.probe_interval:
            state.probe_left, state.since_probe, state.probed = PROBE_STEPS - 1, 0, True
            return other
        state.since_probe += 1
        # The probe's last measurements arrive a step or two after it ends (the steps complete later).
        if self._measured(state, other) and state.rates[other].tokens_per_second > (
                state.rates[state.current].tokens_per_second * (1.0 + self.switch_margin)):
            state.current = other
        return state.current

    def observe(self, drafts: int, previous_drafts: int, batch: int, tokens: int, seconds: float) -> None:
        """A finished step of this kind: its decision and the one of the step before it, its batch (requests that
        yielded tokens), the tokens it emitted and its host time."""
        if drafts != previous_drafts or seconds <= 0:
            return
        state = self.buckets.setdefault(bucket_of(batch), BucketState(self.max_drafts))
        state.rates.setdefault(drafts, MeasuredRate()).record(tokens, seconds, self.weight)

    def _measured(self, state: BucketState, drafts: int) -> bool:
        rate = state.rates.get(drafts)
        return rate is not None and rate.count >= MIN_MEASURED
