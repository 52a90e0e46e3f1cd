"""Dynamic speculation: before each step, whether its requests draft, from the batch size, the measured acceptance
and the step times (docs/design.md, 'Dynamic speculation').

A step whose requests draft d tokens each costs StepCosts.step_seconds(d, batch) in steady state (it verifies d
drafts and proposes d) and yields 1 + p_0 + ... + p_{d-1} tokens per request, p_i being the chance that draft i
is accepted (drafts 0..i all accepted); d = 0 is a plain decode step. The policy picks the d of the most tokens
per second, p_i an exponential moving average of each step's acceptance per position (SpecDecodeStats).

- It starts from every draft accepted, so a fresh engine drafts and measures; a draft count that cannot pay even
  then (a batch too large) is never tried.
- Hysteresis: it leaves its current choice only for one that yields `switch_margin` more, `patience` decisions in
  a row, so acceptance noise near the break-even does not make it flap.
- While it does not draft it measures nothing, so after `probe_interval` such decisions in a row it drafts for one
  step, if drafting could pay at all at that batch size: acceptance that recovered is seen again.
- A step the table does not time (OffTable: a grammar request's, or a sampling request's) is decided from the
  tokens per second such steps were measured to yield with drafts and without (measured_steps.py).
- `disable_by_batch_size` (vLLM's field) overrides it: no drafts from that many requests on.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from specserve.errors import ConfigError
from specserve.spec_decode.measured_steps import MeasuredSteps
from specserve.spec_decode.metrics import SpecDecodeStats
from specserve.spec_decode.step_costs import StepCosts


@dataclass(frozen=True)
class PolicySettings:
    acceptance_weight: float = 0.2  # weight of one step's acceptance in the moving average
    switch_margin: float = 0.02  # relative gain in tokens/s another choice needs
    patience: int = 4  # decisions in a row another choice must win by switch_margin
    probe_interval: int = 256  # decisions without drafts before one probing step drafts

    def __post_init__(self) -> None:
        if not 0.0 < self.acceptance_weight <= 1.0:
            raise ConfigError("policy.acceptance_weight", f"must be in (0, 1], got {self.acceptance_weight}")
        if self.switch_margin < 0.0:
            raise ConfigError("policy.switch_margin", f"must be >= 0, got {self.switch_margin}")
        if self.patience < 1 or self.probe_interval < 1:
            raise ConfigError("policy.patience", f"patience ({self.patience}) and probe_interval "
                              f"({self.probe_interval}) must be >= 1")


class OffTable(Enum):
    """A step the start-up table does not time (it times greedy steps without grammars), by what takes it off."""

    GRAMMAR = "grammar"  # a request that yields tokens has a grammar: masks on the host, masked drafting
    SAMPLING = "sampling"  # a request that yields tokens samples: verification and drafting outside the whole step

    @classmethod
    def of(cls, grammar: bool, greedy: bool) -> OffTable | None:
        """The kind of a step whose requests that yield tokens have a grammar (some) and are greedy (all)."""
        return cls.GRAMMAR if grammar else None if greedy else cls.SAMPLING


class SpeculationPolicy:
    """Decides each step's drafts per request: max_drafts (k, or a tree's depth) or 0. Without `dynamic` it
    always drafts (below disable_by_batch_size); with it, once set_costs gave it the step times."""

    def __init__(self, max_drafts: int, dynamic: bool = False, disable_by_batch_size: int | None = None,
                 settings: PolicySettings = PolicySettings()):
        self.max_drafts = max_drafts
        self.dynamic = dynamic
        self.disable_by_batch_size = disable_by_batch_size
        self.settings = settings
        self.costs: StepCosts | None = None
        # Set while the step times are measured: every decision is this.
        self.forced: int | None = None
        self.reset()

    def reset(self) -> None:
        """Forget every measurement and decision (after the start-up's scratch steps)."""
        self.acceptance = [1.0] * self.max_drafts
        self.current = self.max_drafts
        self._challenger: int | None = None
        self._wins = 0
        self._idle = 0
        self.steps_drafting = 0
        self.steps_without_drafts = 0
        s = self.settings
        # Steps the table does not time decide from their own measured rates, each kind apart (measured_steps.py).
        self.measured_steps = {kind: MeasuredSteps(self.max_drafts, s.acceptance_weight, s.switch_margin,
                                                   s.probe_interval) for kind in OffTable}

    def set_costs(self, costs: StepCosts) -> None:
        if costs.draft_counts != (0, self.max_drafts):
            raise ConfigError("speculative_config.cost_table",
                              f"has step times for {list(costs.draft_counts)} drafts per request; this engine drafts "
                              f"0 or {self.max_drafts} (all or nothing per step), so the table needs exactly those")
        self.costs = costs

    # ---- the estimate ---------------------------------------------------------------------------

    def observe(self, step: SpecDecodeStats) -> None:
        """One step's verifications: move each position's acceptance towards the step's."""
        w = self.settings.acceptance_weight
        for i, (drafted, accepted) in enumerate(zip(step.drafted_per_position, step.accepted_per_position)):
            if drafted and i < self.max_drafts:
                self.acceptance[i] += w * (accepted / drafted - self.acceptance[i])

    def expected_tokens(self, drafts: int, acceptance: list[float] | None = None) -> float:
        """Tokens a request gains per step with this many drafts."""
        return 1.0 + sum((self.acceptance if acceptance is None else acceptance)[:drafts])

    def tokens_per_second(self, drafts: int, batch: int, acceptance: list[float] | None = None) -> float:
        return batch * self.expected_tokens(drafts, acceptance) / self.costs.step_seconds(drafts, batch)

    def best(self, batch: int, acceptance: list[float] | None = None) -> int:
        """The draft count of the most tokens per second (the fewest drafts among equals)."""
        return max(self.costs.draft_counts, key=lambda d: (self.tokens_per_second(d, batch, acceptance), -d))

    # ---- the decision ---------------------------------------------------------------------------

    def observe_off_table_step(self, kind: OffTable, drafts: int, previous_drafts: int, batch: int, tokens: int,
                               seconds: float) -> None:
        """A finished step the table does not time (MeasuredSteps.observe), for a dynamic policy."""
        if self.dynamic:
            self.measured_steps[kind].observe(drafts, previous_drafts, batch, tokens, seconds)

    def choose(self, batch: int, off_table: OffTable | None = None) -> int:
        """The drafts per request of a step of `batch` requests that yield tokens; off_table: the kind of step it
        is where the table does not time it."""
        drafts = self._decide(batch, off_table)
        if drafts:
            self.steps_drafting += 1
        else:
            self.steps_without_drafts += 1
        return drafts

    def _decide(self, batch: int, off_table: OffTable | None) -> int:
        if self.forced is not None:
            return self.forced
        if self.disable_by_batch_size is not None and batch >= self.disable_by_batch_size:
            return 0
        if not self.dynamic or self.costs is None:
            return self.max_drafts
        if off_table is not None:
            return self.measured_steps[off_table].choose(batch)
        s = self.settings
        best = self.best(batch)
        gain = self.tokens_per_second(best, batch) / self.tokens_per_second(self.current, batch)
        if best != self.current and gain > 1.0 + s.switch_margin:
            self._wins = self._wins + 1 if best == self._challenger else 1
            self._challenger = best
        else:
            self._wins, self._challenger = 0, None
        if self._wins >= s.patience:
            self.current, self._wins, self._challenger, self._idle = best, 0, None, 0
        if self.current:
            return self.current
        if self.best(batch, [1.0] * self.max_drafts):
            self._idle += 1
            if self._idle >= s.probe_interval:
                self._idle = 0
                return self.max_drafts
        return 0
