"""Dynamic speculation: before each step, whether its requests draft, from the batch size and what steps of its kind
were measured to yield (docs/design.md, 'Dynamic speculation').

A step's decision is its kind's (StepKind) from measured tokens per second with drafts and without, per batch
bucket (measured_steps.py). The start-up table is the greedy steps' prior: a step whose requests draft d tokens each
costs StepCosts.step_seconds(d, batch) (it verifies d drafts and proposes d) and yields 1 + p_0 + ... + p_{d-1}
tokens per request, p_i being the chance that draft i is accepted (drafts 0..i all accepted); d = 0 is a plain
decode step. A bucket's first steps take the d of the most tokens per second by the table, p_i an exponential
moving average of each step's acceptance per position (SpecDecodeStats), from every draft accepted; where even
that cannot pay (a batch too large) the bucket never drafts. The table times the device and the step's launches,
not the host's work for each emitted token or the prompt chunks that share a step, so its choice is measured
against the other before it is kept.

`disable_by_batch_size` (vLLM's field) overrides it: no drafts from that many requests on.
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
    acceptance_weight: float = 0.2  # weight of one step's acceptance, or one step's measurement, in moving averages
    switch_margin: float = 0.02  # relative gain in measured tokens/s the other decision needs
    probe_interval: int = 256  # decisions of a kind and bucket between probes of the decision not in force

    def __post_init__(self) -> None:
        if not 0.0 < self.acceptance_weight <= 1.0:
            raise ConfigError("policy.acceptance_weight", f"must be in (0, 1], got {self.acceptance_weight}")
        if self.switch_margin < 0.0:
            raise ConfigError("policy.switch_margin", f"must be >= 0, got {self.switch_margin}")
        if self.probe_interval < 1:
            raise ConfigError("policy.probe_interval", f"must be >= 1, got {self.probe_interval}")


class StepKind(Enum):
    """What a step's cost with drafts and without depends on, by what its requests that yield tokens need."""

    GREEDY = "greedy"  # greedy, no grammar: the steps the start-up table times (whole-step graphs)
    GRAMMAR = "grammar"  # a request has a grammar: masks on the host (and masked drafting, mask_drafts)
    SAMPLING = "sampling"  # a request samples

    @classmethod
    def of(cls, grammar: bool, greedy: bool) -> StepKind:
        """The kind of a step whose requests that yield tokens have a grammar (some) and are greedy (all)."""
        return cls.GRAMMAR if grammar else cls.GREEDY if greedy else cls.SAMPLING


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
        self.steps_drafting = 0
        self.steps_without_drafts = 0
        s = self.settings
        self.measured_steps = {kind: MeasuredSteps(self.max_drafts, s.acceptance_weight, s.switch_margin,
                                                   s.probe_interval,
                                                   self if kind is StepKind.GREEDY else DraftWhereGreedyCould(self))
                               for kind in StepKind}

    def set_costs(self, costs: StepCosts) -> None:
        if costs.draft_counts != (0, self.max_drafts):
            raise ConfigError("speculative_config.cost_table",
                              f"has step times for {list(costs.draft_counts)} drafts per request; this engine drafts "
                              f"0 or {self.max_drafts} (all or nothing per step), so the table needs exactly those")
        self.costs = costs

    # ---- the table's estimate: the greedy steps' prior (measured_steps.StepPrior) -----------------

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

    def first_choice(self, batch: int) -> int:
        return self.best(batch)

    def drafts_could_pay(self, batch: int) -> bool:
        return self.best(batch, [1.0] * self.max_drafts) > 0

    # ---- the decision ---------------------------------------------------------------------------

    def observe_step(self, kind: StepKind, decisions: tuple[int, ...], batch: int, tokens: int,
                     seconds: float) -> None:
        """A finished step (MeasuredSteps.observe), for a dynamic policy."""
        if self.dynamic:
            self.measured_steps[kind].observe(decisions, batch, tokens, seconds)

    def choose(self, batch: int, kind: StepKind = StepKind.GREEDY) -> int:
        """The drafts per request of a step of `kind` with `batch` requests that yield tokens."""
        drafts = self._decide(batch, kind)
        if drafts:
            self.steps_drafting += 1
        else:
            self.steps_without_drafts += 1
        return drafts

    def _decide(self, batch: int, kind: StepKind) -> int:
        if self.forced is not None:
            return self.forced
        if self.disable_by_batch_size is not None and batch >= self.disable_by_batch_size:
            return 0
        if not self.dynamic or self.costs is None:
            return self.max_drafts
        return self.measured_steps[kind].choose(batch)


class DraftWhereGreedyCould:
    """The prior of grammar and sampling steps, which the table does not time: draft first, and never where even a
    greedy step whose drafts were all accepted could not pay. What such a step adds to a greedy one (a mask per
    verified position, a draw per verified row) grows with the rows it verifies, 1 + drafts per request, at least
    as fast as the tokens it can yield, so its drafts pay no better than greedy drafts at full acceptance."""

    def __init__(self, table: SpeculationPolicy):
        self.table = table

    def first_choice(self, batch: int) -> int:
        return self.table.max_drafts

    def drafts_could_pay(self, batch: int) -> bool:
        return self.table.drafts_could_pay(batch)

