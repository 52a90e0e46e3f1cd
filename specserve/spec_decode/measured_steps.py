"""Dynamic speculation from measurements: whether a step drafts, from the tokens per second steps of its kind were
measured to yield with drafts and without (docs/design.md, 'Dynamic speculation').

What a step costs with drafts and without is more than its forward passes: the host's work for each token it
emits, prompt chunks that join a batch, and, for two kinds of step, more again (policy.StepKind): a grammar step,
whose host builds a mask for every verified position (and, with masked drafts, drafts depth by depth, waiting for
each depth's drafts; docs/design.md, 'Structured output'); and a step with a request that samples. Where that
outweighs what the drafts gain, drafting makes requests slower than no speculation. So the policy measures instead
of predicting: each step's time (under asynchronous scheduling from its launch to the next, the whole loop of the
engine and its caller; launch to results otherwise) and the tokens it emitted, as moving averages per decision
(drafts or none) and batch bucket (batch sizes up to the next power of two), and it takes the decision of the more
tokens a second.

What must hold:
- A measurement counts only where every step whose work it holds made the same decision: a step's tokens come
  from the drafts the step before proposed and its time from the drafts it proposes and verifies; under
  asynchronous scheduling its time also waits for the step before, which verified the drafts of the one before
  that. So the first step after a switch, and under asynchronous scheduling the second, measures neither decision
  (a plain step's time would hold the verification of the drafts before the switch). A probe of the other
  decision therefore lasts PROBE_STEPS steps.
- A bucket starts from its prior's first choice (the start-up table's, for greedy steps; drafting otherwise),
  measures it, then probes the other decision; after that the decision in force is kept and the other probed
  every `probe_interval` steps of the kind and bucket, so a change in either is seen again, that interval doubling
  with each probe (up to MAX_BACKOFF times) until the decision changes, since a probe of a slower decision costs. Where
  the prior says drafts cannot pay even were every draft accepted, the bucket never drafts.
- The decisions are compared once a probe, when its measurements are in, and a probe measures the other decision
  afresh. A drafting step's tokens vary with what the drafts guess; a plain step's hardly do. Compared at every
  step, the moving average of the decision in force against the other's last probe, drafting lost to every dip
  in its tokens and none never dipped; a decision dropped on a dip then kept that dip in its average, which
  probes only slowly moved. Either kept buckets from drafting where drafting was faster
  (tests/spec_decode/test_measured_steps.py simulates both).
- Only steady steps are measured (the caller's choice: Scheduler.update measures steps of decodes and
  verifications alone, after another such step), since a prompt chunk's time is the same whichever the decision.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

# Measurements a decision needs in a bucket before it is compared.
MIN_MEASURED = 3
# Steps a probe of the other decision lasts: its first two are not measured under asynchronous scheduling (see
# above).
PROBE_STEPS = MIN_MEASURED + 2
# The longest wait between probes, in probe_intervals.
MAX_BACKOFF = 8


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
    interval: int  # decisions between probes (MeasuredSteps.choose backs it off)
    probe_left: int = 0  # steps of the running probe of the other decision
    since_probe: int = 0  # decisions since the last probe ended
    probed: bool = False  # whether the other decision was ever probed here
    compare_pending: bool = False  # a probe's measurements are awaited, to compare the decisions once they are in
    rates: dict[int, MeasuredRate] = field(default_factory=dict)


def bucket_of(batch: int) -> int:
    """Batch sizes up to the next power of two share their measurements."""
    return 1 << max(batch - 1, 0).bit_length()


class StepPrior(Protocol):
    """What a kind of step's decisions start from before they are measured."""

    def first_choice(self, batch: int) -> int:
        """Drafts per request a bucket's first steps take."""

    def drafts_could_pay(self, batch: int) -> bool:
        """Whether drafts could pay at this batch size were every draft accepted."""


class DraftFirst:
    """The prior of steps nothing predicts: draft, and measure."""

    def __init__(self, max_drafts: int):
        self.max_drafts = max_drafts

    def first_choice(self, batch: int) -> int:
        return self.max_drafts

    def drafts_could_pay(self, batch: int) -> bool:
        return True


class MeasuredSteps:
    """The decisions of one kind of step for a policy drafting `max_drafts` or none."""

    def __init__(self, max_drafts: int, weight: float, switch_margin: float, probe_interval: int,
                 prior: StepPrior | None = None):
        self.max_drafts = max_drafts
        self.weight = weight  # of one step's measurement in the moving averages
        self.switch_margin = switch_margin
        self.probe_interval = probe_interval
        self.prior = prior if prior is not None else DraftFirst(max_drafts)
        self.buckets: dict[int, BucketState] = {}

    def choose(self, batch: int) -> int:
        """Drafts per request for a step of this kind with `batch` requests that yield tokens."""
        if not self.prior.drafts_could_pay(batch):
            return 0
        state = self.buckets.get(bucket_of(batch))
        if state is None:
            state = self.buckets[bucket_of(batch)] = BucketState(self.prior.first_choice(batch), self.probe_interval)
        other = self.max_drafts - state.current
        if state.probe_left:
            state.probe_left -= 1
            return other
        if not self._measured(state, state.current):
            return state.current
        if not state.probed or state.since_probe >= state.interval:
            if state.probed:
                # A probe costs where the other decision is slower: each one doubles the wait for the next, up to
                # MAX_BACKOFF times probe_interval, until a change of decision starts over.
                state.interval = min(2 * state.interval, MAX_BACKOFF * self.probe_interval)
            state.probe_left, state.since_probe, state.probed = PROBE_STEPS - 1, 0, True
            state.rates.pop(other, None)
            state.compare_pending = True
            return other
        state.since_probe += 1
        # The probe's last measurements arrive a step or two after it ends (the steps complete later).
        if state.compare_pending and self._measured(state, other):
            state.compare_pending = False
            if state.rates[other].tokens_per_second > (
                    state.rates[state.current].tokens_per_second * (1.0 + self.switch_margin)):
                state.current, state.interval, state.since_probe = other, self.probe_interval, 0
        return state.current

    def observe(self, decisions: tuple[int, ...], batch: int, tokens: int, seconds: float) -> None:
        """A finished step of this kind: its decision and those of the steps before whose work its measurement
        holds (the latest first), its batch (requests that yielded tokens), the tokens it emitted and its time."""
        state = self.buckets.get(bucket_of(batch))
        # A bucket that never drafts (its prior says drafts cannot pay) has no decision to measure.
        if len(set(decisions)) != 1 or seconds <= 0 or state is None:
            return
        state.rates.setdefault(decisions[0], MeasuredRate()).record(tokens, seconds, self.weight)

    def _measured(self, state: BucketState, drafts: int) -> bool:
        rate = state.rates.get(drafts)
        return rate is not None and rate.count >= MIN_MEASURED
