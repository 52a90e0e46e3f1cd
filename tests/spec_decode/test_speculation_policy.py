"""The dynamic speculation policy's decision (spec_decode/policy.py) against throughput computed by hand, its
estimate, hysteresis and probes, the step-time table and the config fields."""
from __future__ import annotations

import json

import pytest

from specserve.errors import ConfigError
from specserve.spec_decode.config import SpeculativeConfig
from specserve.spec_decode.metrics import SpecDecodeStats
from specserve.spec_decode.policy import PolicySettings, SpeculationPolicy
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


def test_hysteresis_switches_after_patience_decisions_and_not_for_a_small_gain():
    p = policy(patience=3, switch_margin=0.02)
    assert [p.choose(8) for _ in range(4)] == [3, 3, 0, 0]
    assert [p.choose(1) for _ in range(4)] == [0, 0, 3, 3]
    # Near the break-even, where no drafts yield 1% more (below the margin), it stays with drafts.
    even = SpeculationPolicy(3, dynamic=True, settings=PolicySettings(patience=1, switch_margin=0.02))
    even.set_costs(StepCosts((1, 8), {0: (1.0, 2.0), 3: (1.5, 2.0 * 2.8 * 1.01)}))
    even.acceptance = [0.8, 0.6, 0.4]
    assert even.tokens_per_second(0, 8) / even.tokens_per_second(3, 8) == pytest.approx(1.01)
    assert [even.choose(8) for _ in range(5)] == [3] * 5
    assert (p.steps_drafting, p.steps_without_drafts) == (4, 4)


def test_a_probe_drafts_once_per_interval_only_where_drafting_could_pay():
    p = policy(acceptance=(0.0, 0.0, 0.0), patience=1, probe_interval=5)
    assert p.choose(1) == 0  # switched: drafts never accepted
    assert [p.choose(1) for _ in range(10)] == [0, 0, 0, 3, 0, 0, 0, 0, 3, 0]
    # At a batch where even every draft accepted loses (8 * 4 / 6 s < 8 / 2 s), it never probes.
    never = SpeculationPolicy(3, dynamic=True, settings=PolicySettings(patience=1, probe_interval=2))
    never.set_costs(StepCosts((1, 8), {0: (1.0, 2.0), 3: (1.5, 9.0)}))
    assert [never.choose(8) for _ in range(8)] == [0] * 8


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
