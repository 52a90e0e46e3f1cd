"""The dynamic speculation policy's prior for greedy steps (spec_decode/policy.py) against throughput computed by
hand, its estimate, the measurements that overrule it, the step-time table and the config fields."""
from __future__ import annotations

import json

import pytest

from specserve.errors import ConfigError
from specserve.spec_decode.config import SpeculativeConfig
from specserve.spec_decode.metrics import SpecDecodeStats
from specserve.spec_decode.policy import PolicySettings, SpeculationPolicy, StepKind
from specserve.spec_decode.step_costs import StepCosts

# A plain step: 1 s at batch 1, 2 s at batch 8; a step with 3 drafts: 1.5 s and 6 s.
COSTS = StepCosts((1, 8), {0: (1.0, 2.0), 3: (1.5, 6.0)})


def policy(acceptance=(0.8, 0.6, 0.4), **settings) -> SpeculationPolicy:
    p = SpeculationPolicy(3, dynamic=True, settings=PolicySettings(**settings))
    p.set_costs(COSTS)
    p.acceptance = list(acceptance)
    return p


def step_stats(drafted: list[int], accepted: list[int]) -> SpecDecodeStats:
    return SpecDecodeStats(drafted_per_position=drafted, accepted_per_position=accepted, num_steps=1)


def test_step_times_interpolate_between_measured_batch_sizes():
    assert COSTS.step_seconds(0, 1) == 1.0 and COSTS.step_seconds(3, 8) == 6.0
    assert COSTS.step_seconds(0, 4) == pytest.approx(1.0 + 3 / 7)
    assert COSTS.step_seconds(3, 4) == pytest.approx(1.5 + 4.5 * 3 / 7)
    assert COSTS.step_seconds(3, 100) == 6.0  # past the largest: its time


def test_the_decision_is_the_best_hand_computed_throughput():
    p = policy()  # 1 + 0.8 + 0.6 + 0.4 = 2.8 tokens per request per step with drafts
    assert p.expected_tokens(3) == pytest.approx(2.8) and p.expected_tokens(0) == 1.0
    # batch 1: 1 / 1 s plain, 2.8 / 1.5 s with drafts
    assert p.tokens_per_second(0, 1) == pytest.approx(1.0)
    assert p.tokens_per_second(3, 1) == pytest.approx(2.8 / 1.5)
    assert p.best(1) == 3
    # batch 4: 4 / (1 + 3/7) = 2.8 plain, 4 * 2.8 / (1.5 + 4.5 * 3/7) = 3.267 with drafts
    assert p.tokens_per_second(0, 4) == pytest.approx(2.8)
    assert p.tokens_per_second(3, 4) == pytest.approx(4 * 2.8 / (1.5 + 4.5 * 3 / 7))
    assert p.best(4) == 3
    # batch 8: 8 / 2 = 4 plain, 8 * 2.8 / 6 = 3.73 with drafts
    assert p.best(8) == 0
    # Every draft rejected: drafts never pay, since a step with them is slower.
    assert policy(acceptance=(0, 0, 0)).best(1) == 0


def test_the_estimate_is_a_moving_average_of_each_steps_acceptance_per_position():
    p = policy(acceptance=(1.0, 1.0, 1.0), acceptance_weight=0.25)
    p.observe(step_stats([4, 4, 4], [2, 1, 0]))  # rates 0.5, 0.25, 0
    assert p.acceptance == pytest.approx([1 - 0.25 * 0.5, 1 - 0.25 * 0.75, 1 - 0.25 * 1.0])
    p.observe(step_stats([2], [2]))  # only position 0 drafted: the others keep their estimate
    assert p.acceptance == pytest.approx([0.875 + 0.25 * 0.125, 0.8125, 0.75])


def test_a_greedy_bucket_starts_from_the_table_and_keeps_what_measures_faster():
    """The table's choice is a bucket's first (batch 1: drafts; batch 8: none), then the other is probed, and the
    measured rates decide: here steps with drafts measure slower than the table says, so batch 1 stops drafting."""
    p = policy(probe_interval=50)
    assert p.first_choice(1) == 3 and p.first_choice(8) == 0
    previous, decisions = 3, []
    for _ in range(20):
        d = p.choose(1)
        p.observe_step(StepKind.GREEDY, (d, previous), 1, 1 if previous == 0 else 3, 1.0 if d == 0 else 4.0)
        decisions.append(d)
        previous = d
    assert decisions[:3] == [3, 3, 3] and decisions[-5:] == [0] * 5
    assert p.measured_steps[StepKind.GREEDY].buckets[1].current == 0
    assert p.choose(8) == 0 and (p.steps_drafting, p.steps_without_drafts) == (decisions.count(3), 21 - decisions.count(3))


def test_where_drafting_could_not_pay_even_fully_accepted_a_bucket_never_drafts():
    # At batch 8 every draft accepted still loses (8 * 4 / 9 s < 8 / 2 s): no draft, no probe.
    never = SpeculationPolicy(3, dynamic=True, settings=PolicySettings(probe_interval=2))
    never.set_costs(StepCosts((1, 8), {0: (1.0, 2.0), 3: (1.5, 9.0)}))
    assert [never.choose(8) for _ in range(8)] == [0] * 8 and not never.drafts_could_pay(8)
    # At batch 1 it could: every draft rejected, the table's first choice is none, and drafting is probed.
    rejected = policy(acceptance=(0.0, 0.0, 0.0), probe_interval=2)
    assert rejected.first_choice(1) == 0 and rejected.drafts_could_pay(1)
    decisions = []
    for _ in range(8):
        decisions.append(rejected.choose(1))
        rejected.observe_step(StepKind.GREEDY, (decisions[-1],) * 2, 1, 1, 1.0)
    assert decisions[:3] == [0, 0, 0] and 3 in decisions


def test_without_dynamic_every_step_drafts_below_disable_by_batch_size():
    static = SpeculationPolicy(3)
    assert [static.choose(b) for b in (1, 64, 512)] == [3, 3, 3]
    capped = SpeculationPolicy(3, disable_by_batch_size=8)
    assert [capped.choose(b) for b in (1, 7, 8, 100)] == [3, 3, 0, 0]
    dynamic = policy(acceptance=(1.0, 1.0, 1.0))
    dynamic.disable_by_batch_size = 2
    assert dynamic.choose(2) == 0 and dynamic.choose(1) == 3


def test_a_cost_table_round_trips_and_bad_ones_are_config_errors(tmp_path):
    path = tmp_path / "costs.json"
    COSTS.save(path)
    assert StepCosts.load(path) == COSTS
    with pytest.raises(ConfigError, match="exactly those"):
        SpeculationPolicy(5, dynamic=True).set_costs(COSTS)  # measured for 3 drafts
    (tmp_path / "bad.json").write_text(json.dumps({"batch_sizes": [1, 8], "seconds": {"0": [1.0, -2.0],
                                                                                       "3": [1.0, 2.0]}}))
    with pytest.raises(ConfigError, match="positive numbers"):
        StepCosts.load(tmp_path / "bad.json")
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(ConfigError) as e:
        StepCosts.load(tmp_path / "junk.json")
    assert e.value.field == "speculative_config.cost_table"
    with pytest.raises(ConfigError, match="ascending"):
        StepCosts((8, 1), {0: (1.0, 2.0), 3: (1.0, 2.0)})


@pytest.mark.parametrize("extra,field", [
    ({"dynamic": "yes"}, "speculative_config.dynamic"),
    ({"cost_table": "costs.json"}, "speculative_config.cost_table"),  # without dynamic
    ({"dynamic": True, "cost_table": "/nonexistent/costs.json"}, "speculative_config.cost_table"),
    ({"disable_by_batch_size": 0}, "speculative_config.disable_by_batch_size"),
    ({"disable_by_batch_size": 2.5}, "speculative_config.disable_by_batch_size"),
])
def test_bad_dynamic_fields_are_config_errors(extra, field):
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, **extra})
    assert e.value.field == field


@pytest.mark.parametrize("kind", [StepKind.SAMPLING, StepKind.GRAMMAR])
def test_steps_the_table_does_not_time_draft_first_but_never_where_greedy_drafts_could_not_pay(kind):
    """A grammar or sampling step adds to a greedy one work per verified row, so where a greedy step with every
    draft accepted is slower than a plain one (batch 64 here: 4 tokens in 5 s against 1 in 1 s) such steps never
    draft; elsewhere they draft first, whatever the greedy estimate (every draft rejected here), and measure."""
    p = SpeculationPolicy(3, dynamic=True)
    p.set_costs(StepCosts((1, 64), {0: (1.0, 1.0), 3: (1.5, 5.0)}))
    p.acceptance = [0.0, 0.0, 0.0]
    assert not p.drafts_could_pay(64) and p.drafts_could_pay(1) and p.choose(1, StepKind.GREEDY) == 0
    assert [p.choose(64, kind) for _ in range(600)] == [0] * 600 and p.measured_steps[kind].buckets == {}
    assert p.choose(1, kind) == 3
