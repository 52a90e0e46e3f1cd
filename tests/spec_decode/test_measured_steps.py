"""Dynamic speculation from measurements (spec_decode/measured_steps.py): from measured tokens and seconds, with the
measurements arriving a step late as the engine's do, it settles on the decision of the more tokens a second,
probes the other periodically, ignores the steps right after a switch, and keeps batch buckets apart; and the
policy keeps each kind of step apart (greedy, grammar, sampling)."""
from __future__ import annotations

import random

import pytest

from specserve.spec_decode.measured_steps import MIN_MEASURED, PROBE_STEPS, MeasuredSteps, bucket_of
from specserve.spec_decode.policy import PolicySettings, SpeculationPolicy, StepKind
from specserve.spec_decode.step_costs import StepCosts

K = 3


def run(steps: MeasuredSteps, n: int, batch: int, tokens_with_drafts: float, seconds: dict[int, float]) -> list[int]:
    """n decisions of an engine under asynchronous scheduling, whose steps complete a step late: a step's tokens
    come from the drafts the step before proposed (tokens_with_drafts a request, else 1), its time holds its own
    work and that of the two steps before it (the mean of their decisions' seconds)."""
    decisions, pending = [], None
    for _ in range(n):
        d = steps.choose(batch)
        if pending is not None:
            steps.observe(*pending)
        recent = (d, *([0, 0] + decisions)[:-3:-1])  # this step's decision and the two before, the latest first
        tokens = batch * (tokens_with_drafts if recent[1] else 1.0)
        pending = (recent, batch, round(tokens), sum(seconds[r] for r in recent) / 3)
        decisions.append(d)
    return decisions


def test_drafting_that_pays_is_kept_after_one_probe_of_none():
    steps = MeasuredSteps(K, weight=0.2, switch_margin=0.02, probe_interval=50)
    d = run(steps, 400, 8, tokens_with_drafts=2.75, seconds={K: 1.5, 0: 1.0})
    first_none = d.index(0)
    # Drafting is measured first (its measurements a step late), then none for one probe.
    assert MIN_MEASURED <= first_none <= MIN_MEASURED + 3 and d[first_none:first_none + PROBE_STEPS] == [0] * PROBE_STEPS
    state = steps.buckets[8]
    assert state.current == K
    assert state.rates[K].tokens_per_second == pytest.approx(8 * 2.75 / 1.5)
    assert state.rates[0].tokens_per_second == pytest.approx(8 / 1.0)
    # Later probes of none, PROBE_STEPS long, come after probe_interval decisions, then twice and four times that,
    # as each one changes nothing.
    starts = [i for i in range(len(d)) if d[i] == 0 and (i == 0 or d[i - 1] == K)]
    assert all(d[i:i + PROBE_STEPS] == [0] * PROBE_STEPS for i in starts) and d.count(0) == PROBE_STEPS * len(starts)
    assert [b - a - PROBE_STEPS for a, b in zip(starts, starts[1:])] == [50, 100, 200]


def test_drafting_that_does_not_pay_is_dropped_and_probed_again():
    steps = MeasuredSteps(K, weight=0.2, switch_margin=0.02, probe_interval=50)
    d = run(steps, 200, 64, tokens_with_drafts=1.2, seconds={K: 3.0, 0: 1.0})
    state = steps.buckets[64]
    assert state.current == 0
    assert state.rates[0].tokens_per_second > state.rates[K].tokens_per_second
    tail = d[40:]
    # Once settled, drafting returns only as probes: runs of PROBE_STEPS, probe_interval apart.
    runs = [len(r) for r in "".join("k" if x else "." for x in tail).split(".") if r]
    assert runs and all(r == PROBE_STEPS for r in runs[:-1]) and len(runs) <= len(tail) // 50 + 1
    assert sum(tail) / K / len(tail) < 0.1


def test_a_change_of_decision_starts_the_probes_backing_off_again():
    steps = MeasuredSteps(K, weight=0.5, switch_margin=0.02, probe_interval=20)
    run(steps, 200, 8, tokens_with_drafts=2.75, seconds={K: 1.5, 0: 1.0})
    state = steps.buckets[8]
    assert state.current == K and state.interval == 160  # probes 20, 40 and 80 decisions apart so far
    # The drafts stop paying: drafting is kept until the probe of none that was due, which measures none afresh;
    # none takes over once that probe's measurements are in, and the probes of drafting come 20 and 40 decisions
    # apart again.
    due = state.interval - state.since_probe
    d = "".join("k" if x else "." for x in run(steps, 260, 8, tokens_with_drafts=1.0, seconds={K: 1.5, 0: 1.0}))
    assert d.index(".") == due and d[due:due + PROBE_STEPS] == "." * PROBE_STEPS
    switched = d.index(".", due + PROBE_STEPS)  # the decision that switched, a step or two after the probe
    assert switched - due - PROBE_STEPS <= 2
    assert state.current == 0 and d[switched:].startswith("." * 21 + "k" * PROBE_STEPS + "." * 40 + "k" * PROBE_STEPS)


def noisy_run(steps: MeasuredSteps, n: int, acceptance: tuple[float, ...], seconds: dict[int, float],
              seed: int) -> float:
    """The share of n decisions at batch 1 that drafted, where a step's tokens after drafts are 1 + the drafts
    accepted in a row (each with its probability in `acceptance`) and every step's time varies by a few percent,
    as a real head's and host's do; the measurements arrive as in run."""
    rng = random.Random(seed)
    drafted, decisions, pending = 0, [], None
    for _ in range(n):
        d = steps.choose(1)
        if pending is not None:
            steps.observe(*pending)
        recent = (d, *([0, 0] + decisions)[:-3:-1])
        tokens = 1 + (next((i for i, p in enumerate(acceptance) if rng.random() >= p), len(acceptance)) if recent[1]
                      else 0)
        pending = (recent, 1, tokens, sum(seconds[r] for r in recent) / 3 * rng.lognormvariate(0, 0.05))
        drafted += d > 0
        decisions.append(d)
    return drafted / n


@pytest.mark.parametrize("seconds_with_drafts, drafting", [(1.45, True), (2.36, False)],
                         ids=["drafting 1.3x faster", "drafting 0.8x as fast"])
def test_the_faster_decision_is_kept_when_drafts_accept_unevenly(seconds_with_drafts, drafting):
    """Drafts accepted 2 tokens a step on average, 1 to 6 from step to step: where that makes drafting 1.3x as fast
    as none the policy drafts on most steps, and where 0.8x on few. Compared at every step against none's steady
    rate, drafting lost on every dip in its tokens and drafted on 3-15% of steps in the first case (four seeds)."""
    acceptance = (0.57, 0.45, 0.4, 0.35, 0.3)  # mean tokens a step 1.99
    shares = [noisy_run(MeasuredSteps(5, weight=0.2, switch_margin=0.02, probe_interval=256), 20_000, acceptance,
                        {5: seconds_with_drafts, 0: 0.95}, seed) for seed in range(4)]
    assert (sum(shares) / 4 > 0.9) if drafting else (sum(shares) / 4 < 0.1)


def test_a_step_after_a_switch_measures_nothing():
    """Nor the second one under asynchronous scheduling, whose time waits for the step after the switch."""
    steps = MeasuredSteps(K, weight=0.5, switch_margin=0.0, probe_interval=10)
    steps.observe((K, K, K), 4, 100, 1.0)  # a bucket no decision was taken in: nothing to measure
    assert 4 not in steps.buckets
    assert steps.choose(4) == K
    for recent in ((K, 0), (0, K), (K, 0, 0), (K, K, 0), (0, K, K), (0, 0, K)):
        steps.observe(recent, 4, 100, 1.0)
    assert not steps.buckets[4].rates
    steps.observe((K, K, K), 4, 12, 2.0)
    steps.observe((K, K), 4, 4, 2.0)
    rate = steps.buckets[4].rates[K]
    assert (rate.tokens, rate.seconds, rate.count) == (8.0, 2.0, 2)


def test_batch_sizes_up_to_a_power_of_two_share_a_bucket():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]
    steps = MeasuredSteps(K, weight=0.2, switch_margin=0.02, probe_interval=50)
    run(steps, 60, 3, tokens_with_drafts=1.0, seconds={K: 2.0, 0: 1.0})
    assert steps.buckets[4].current == 0
    assert run(steps, MIN_MEASURED, 5, tokens_with_drafts=1.0, seconds={K: 2.0, 0: 1.0}) == [K] * MIN_MEASURED


@pytest.mark.parametrize("kind", list(StepKind))
def test_the_policy_decides_each_kind_of_step_from_its_own_measurements_only_when_dynamic(kind):
    """Steps of one kind measured slower with drafts stop drafting, though the table says drafting always pays;
    the other kinds keep their own measurements and start from drafting."""
    costs = StepCosts((1, 64), {0: (1.0, 1.0), K: (1.1, 1.1)})  # the table says drafting always pays
    policy = SpeculationPolicy(K, dynamic=True, settings=PolicySettings(probe_interval=50))
    policy.set_costs(costs)
    for _ in range(30):
        d = policy.choose(64, kind)
        policy.observe_step(kind, (d, d), 64, 64, 1.0 if d == 0 else 5.0)
    assert policy.measured_steps[kind].buckets[64].current == 0 and policy.choose(64, kind) == 0
    for other in StepKind:
        if other is not kind:
            assert policy.measured_steps[other].buckets == {} and policy.choose(64, other) == K
    static = SpeculationPolicy(K)
    static.observe_step(kind, (0, 0), 64, 64, 1.0)
    assert static.choose(64, kind) == K and static.measured_steps[kind].buckets == {}


def test_a_steps_kind_is_its_grammar_first_then_whether_it_samples():
    assert StepKind.of(grammar=True, greedy=True) is StepKind.of(grammar=True, greedy=False) is StepKind.GRAMMAR
    assert StepKind.of(grammar=False, greedy=False) is StepKind.SAMPLING
    assert StepKind.of(grammar=False, greedy=True) is StepKind.GREEDY
