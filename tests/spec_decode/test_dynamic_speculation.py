"""End to end: dynamic speculation (spec_decode/policy.py) turns drafting off where drafts cannot pay and keeps it
where they do, and greedy output is the target's own whatever the policy decides, step by step, for chains and
trees, with asynchronous scheduling on and off."""
from __future__ import annotations

import copy

import pytest

from conftest import repetitive_prompts as prompts
from heads import save_eagle_head
from scripted_policy import scripted, timed_by_costs
from specserve import LLM, SamplingParams
from specserve.entrypoints.openai.metrics import PREFIX, EngineStatsCollector
from specserve.spec_decode.measured_steps import MIN_MEASURED, PROBE_STEPS
from specserve.spec_decode.policy import StepKind
from specserve.spec_decode.step_costs import StepCosts
from specserve.worker.cudagraph_mode import CUDAGraphMode as M
from specserve.worker.graph_recorder import EagerRecorder

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


@pytest.fixture(scope="module")
def models(tiny_llama, tmp_path_factory):
    path, hf = tiny_llama
    root = tmp_path_factory.mktemp("dynamic")
    ps = prompts(hf.config.vocab_size)
    plain = LLM(str(path), max_model_len=256)
    ref = [o.outputs[0].token_ids for o in plain.generate(ps, GREEDY, use_tqdm=False)]
    return {"path": path, "root": root, "prompts": ps, "ref": ref,
            "eagle3": str(save_eagle_head(root / "eagle3", hf.config, "eagle3", seed=2))}


def cost_table(models, name: str, plain: tuple[float, ...], drafting: tuple[float, ...], k: int = 3) -> str:
    """A step-time table at batch sizes 1, 2, 4, 8 written where speculative_config.cost_table reads it."""
    path = models["root"] / f"{name}.json"
    StepCosts((1, 2, 4, 8), {0: plain, k: drafting}).save(path)
    return str(path)


def dynamic_llm(models, table: str, forced_acceptance_prob: float, **kw) -> LLM:
    """The tiny model with a dynamic EAGLE-3 head at k=3 whose drafts are accepted with the given probability."""
    return LLM(str(models["path"]), max_model_len=256, speculative_config={
        "method": "eagle3", "model": models["eagle3"], "num_speculative_tokens": 3,
        "forced_acceptance_prob": forced_acceptance_prob, "dynamic": True, "cost_table": table}, **kw)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_every_draft_rejected_turns_drafting_off(models):
    """Forced acceptance 0 with drafting steps 30% slower: the table's prior drafts first (its estimate starts from
    every draft accepted), the steps measure fewer tokens a second with drafts than in the probe without, and the
    buckets settle on none, so a second run drafts only in buckets still measuring; the output is the target's."""
    table = cost_table(models, "slower", (1.0,) * 4, (1.3,) * 4)
    llm = dynamic_llm(models, table, forced_acceptance_prob=0.0)
    core = llm.engine.core
    policy = core.scheduler.policy
    assert tokens(llm.generate(models["prompts"], GREEDY, use_tqdm=False)) == models["ref"]
    buckets = policy.measured_steps[StepKind.GREEDY].buckets
    settled = [b for b, state in buckets.items() if state.probed]
    assert settled and all(buckets[b].current == 0 for b in settled) and max(policy.acceptance) < 0.5
    first_run, steps = llm.engine.spec_stats.num_drafted, policy.steps_without_drafts
    assert tokens(llm.generate(models["prompts"], GREEDY, use_tqdm=False)) == models["ref"]
    assert llm.engine.spec_stats.num_drafted - first_run < first_run and policy.steps_without_drafts > steps
    stats = core.stats()
    assert stats.spec_steps_without_drafts == policy.steps_without_drafts > stats.spec_steps_drafting > 0


def test_every_draft_accepted_with_cheap_drafts_keeps_drafting(models, monkeypatch):
    """Forced acceptance 1 with drafts nearly free (the steps timed by the table): the buckets keep drafting, and
    steps without drafts are only the probes of none (PROBE_STEPS a bucket)."""
    table = cost_table(models, "cheap", (1.0,) * 4, (1.1,) * 4)
    timed_by_costs(monkeypatch)
    llm = dynamic_llm(models, table, forced_acceptance_prob=1.0)
    llm.generate(models["prompts"], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    policy = llm.engine.core.scheduler.policy
    buckets = policy.measured_steps[StepKind.GREEDY].buckets
    assert all(state.current == 3 for state in buckets.values()) and policy.acceptance == [1.0, 1.0, 1.0]
    assert policy.steps_without_drafts <= PROBE_STEPS * len(buckets) < policy.steps_drafting
    # Every step after a prefill that verified drafts verified all 3.
    stats = llm.engine.spec_stats
    assert stats.num_accepted == stats.num_drafted == 3 * stats.num_steps > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("drafts", ["chain", "tree"])
def test_drafting_on_and_off_step_by_step_equals_no_speculation(models, drafts, async_scheduling):
    """Every switch: a step that verifies drafts but proposes none, one that proposes after a plain step, runs of
    each; with chunked prefill, prefix hits and preemption in the mix."""
    spec = {"method": "eagle3", "model": models["eagle3"], "dynamic": True,
            "cost_table": cost_table(models, "any", (1.0,) * 4, (1.5,) * 4)}
    spec.update({"num_speculative_tokens": 3} if drafts == "chain" else {"speculative_token_tree": TREE})
    llm = LLM(str(models["path"]), max_model_len=256, speculative_config=spec, max_num_batched_tokens=48,
              num_kv_blocks=17, block_size=16, async_scheduling=async_scheduling)
    scripted(llm, [3, 3, 0, 3, 0, 0, 3])
    ps = models["prompts"]
    llm.generate(ps[:2], GREEDY, use_tqdm=False)  # later prompts hit the prefix cache
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    assert tokens(outs) == models["ref"]
    policy = llm.engine.core.scheduler.policy
    assert policy.steps_drafting > 0 and policy.steps_without_drafts > 0 and llm.engine.spec_stats.num_drafted > 0
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "no preemption in the mix"
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


@pytest.mark.parametrize("drafts", ["chain", "tree"])
def test_steps_kept_from_drafting_decode_in_the_whole_plain_step(models, drafts):
    """With graphs recorded (the CPU stand-in), a step that drafts nothing and verifies nothing decodes in the whole
    plain step's graph, as an engine without a speculator would, and the output is the target's."""
    spec = {"method": "eagle3", "model": models["eagle3"], "dynamic": True,
            "cost_table": cost_table(models, "any", (1.0,) * 4, (1.5,) * 4)}
    spec.update({"num_speculative_tokens": 3} if drafts == "chain" else {"speculative_token_tree": TREE})
    llm = LLM(str(models["path"]), max_model_len=256, speculative_config=spec, max_num_seqs=4,
              cudagraph_capture_sizes=[1, 2, 4])
    runner = llm.engine.runner
    runner.capture_graphs(M.FULL_AND_PIECEWISE, EagerRecorder(), llm.engine.attention_backend)
    replays = []
    run = runner.plain_step_graphs.run
    runner.plain_step_graphs.run = lambda desc, fn, md: replays.append(desc.num_reqs) or run(desc, fn, md)
    scripted(llm, [3, 0, 0, 0, 3, 3, 0, 0])
    assert tokens(llm.generate(models["prompts"][:3], GREEDY, use_tqdm=False)) == models["ref"][:3]
    assert 4 in replays and llm.engine.spec_stats.num_drafted > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_drafting_follows_the_batch_size_and_output_is_unchanged(models, async_scheduling):
    """The target drafting for itself (every draft accepted), with drafts that pay up to 3 requests and not from 4
    (even all accepted: 5 tokens in 6 s against 1 in 1 s): requests that finish one after another shrink the batch
    from 6, so the policy turns drafting on mid-generation (and measures whether it pays). The drafter drafted
    nothing while all six ran, so its cache lacks the tokens of those steps (docs/design.md, 'Dynamic speculation':
    the drafter's cache), but it holds their prompts."""
    table = cost_table(models, "small_batches", (1.0,) * 4, (1.2, 1.2, 6.0, 6.0), k=4)
    spec = {"method": "draft_model", "model": str(models["path"]), "num_speculative_tokens": 4, "dynamic": True,
            "cost_table": table}
    ps = models["prompts"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 12, 16, 48, 56, 64)]
    want = tokens(LLM(str(models["path"]), max_model_len=256).generate(ps, params, use_tqdm=False))
    llm = LLM(str(models["path"]), max_model_len=256, speculative_config=spec, async_scheduling=async_scheduling)
    assert tokens(llm.generate(ps, params, use_tqdm=False)) == want
    policy = llm.engine.core.scheduler.policy
    assert policy.steps_without_drafts > 0 and policy.steps_drafting > 0
    # Batches of 5 and 6 never drafted (nor were measured); the smaller ones drafted first.
    buckets = policy.measured_steps[StepKind.GREEDY].buckets
    assert 8 not in buckets and {1, 2} & set(buckets) and not policy.drafts_could_pay(5)
    # The drafter's prefill ran over the prompts though no step drafted (Drafting.PREFILL_ONLY); only the tokens of
    # the steps without drafts are missing from its cache.
    stats = llm.engine.spec_stats
    assert stats.num_accepted > stats.num_drafted / 4


def test_step_times_are_measured_at_start_up_and_leave_nothing_behind(models):
    llm = LLM(str(models["path"]), max_model_len=256, max_num_seqs=4, speculative_config={
        "method": "eagle3", "model": models["eagle3"], "num_speculative_tokens": 3, "dynamic": True})
    core = llm.engine.core
    costs = core.scheduler.policy.costs
    assert costs.batch_sizes == (1, 2, 4) and costs.draft_counts == (0, 3)
    assert all(t > 0 for times in costs.seconds.values() for t in times)
    stats = core.stats()
    assert (stats.spec_num_drafted, stats.num_generated_tokens, stats.spec_steps_drafting,
            stats.spec_steps_without_drafts) == (0, 0, 0, 0)
    assert core.scheduler.policy.acceptance == [1.0, 1.0, 1.0] and not core.has_unfinished_requests()
    assert tokens(llm.generate(models["prompts"], GREEDY, use_tqdm=False)) == models["ref"]


def test_prometheus_counts_steps_with_and_without_drafts(models):
    table = cost_table(models, "slower", (1.0,) * 4, (1.3,) * 4)
    llm = dynamic_llm(models, table, forced_acceptance_prob=0.0)
    llm.generate(models["prompts"], GREEDY, use_tqdm=False)
    stats = llm.engine.core.stats()

    class Server:
        pass

    server = Server()
    server.stats, server.replica_stats = stats, [stats]
    samples = {s.name: s.value for family in EngineStatsCollector(server).collect() for s in family.samples
               if not s.labels}
    assert samples[PREFIX + "spec_decode_steps_drafting_total"] == stats.spec_steps_drafting > 0
    assert samples[PREFIX + "spec_decode_steps_without_drafts_total"] == stats.spec_steps_without_drafts > 0


def test_grammar_steps_stop_drafting_where_their_measured_drafts_do_not_pay(models):
    """Requests under a JSON schema with every draft rejected: a grammar step that drafts costs more host time
    (masked drafting, depth by depth) and yields no more tokens, so once both decisions are measured the policy
    keeps grammar steps from drafting, although the table (drafts nearly free) would draft; the output is the
    constrained output without speculation."""
    from schemas import SCHEMAS

    ps = models["prompts"][:2]
    params = SamplingParams(temperature=0, max_tokens=40, structured_output={"kind": "json_schema",
                                                                              "value": SCHEMAS[0]})
    want = tokens(LLM(str(models["path"]), max_model_len=256).generate(ps, params, use_tqdm=False))
    table = cost_table(models, "nearly_free", (1.0,) * 4, (1.01,) * 4)
    llm = dynamic_llm(models, table, forced_acceptance_prob=0.0)
    assert tokens(llm.generate(ps, params, use_tqdm=False)) == want
    policy = llm.engine.core.scheduler.policy
    state = policy.measured_steps[StepKind.GRAMMAR].buckets[2]
    assert state.current == 0 and state.rates[0].tokens_per_second > state.rates[3].tokens_per_second
    assert policy.choose(2, StepKind.GRAMMAR) == 0 and policy.measured_steps[StepKind.GREEDY].buckets == {}


def test_sampling_steps_are_decided_from_their_own_measurements(models):
    """Requests at temperature 1: the table, timed on greedy steps, is no prior for a sampling step, so the policy
    measures both decisions of such steps (drafting first, then a probe of none) in their own bucket, and greedy
    steps keep out of it. Which decision then wins depends
    on the host's times; test_measured_steps.py shows the decision from controlled times."""
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    table = cost_table(models, "nearly_free", (1.0,) * 4, (1.01,) * 4)
    llm = dynamic_llm(models, table, forced_acceptance_prob=0.0)
    assert all(len(t) == 40 for t in tokens(llm.generate(models["prompts"][:2], params, use_tqdm=False)))
    policy = llm.engine.core.scheduler.policy
    state = policy.measured_steps[StepKind.SAMPLING].buckets[2]
    assert state.probed and all(state.rates[d].count >= MIN_MEASURED for d in (0, 3))
    assert policy.measured_steps[StepKind.GRAMMAR].buckets == {}
    measured = copy.deepcopy(policy.measured_steps)
    assert tokens(llm.generate(models["prompts"][:2], GREEDY, use_tqdm=False)) == models["ref"][:2]
    assert all(policy.measured_steps[kind].buckets == measured[kind].buckets
               for kind in (StepKind.SAMPLING, StepKind.GRAMMAR))


def test_only_steady_steps_are_measured(models):
    """A step with a prompt chunk, and the step after it (whose host time holds the chunk's under asynchronous
    scheduling), measure nothing: a prompt chunk costs the same whichever the decision. The others are measured."""
    llm = dynamic_llm(models, cost_table(models, "any", (1.0,) * 4, (1.5,) * 4), forced_acceptance_prob=0.5)
    scheduler = llm.engine.core.scheduler
    outs, measured = [], []
    schedule, observe = scheduler.schedule, scheduler.policy.observe_step
    scheduler.schedule = lambda: outs.append(schedule()) or outs[-1]
    scheduler.policy.observe_step = lambda *step: measured.append(step) or observe(*step)
    ps = models["prompts"]
    llm.generate(ps[:2] + [p + p for p in ps[2:4]], GREEDY, use_tqdm=False)
    steps = [o for o in outs if o.scheduled]
    decodes = [all(s.samples and s.num_new_tokens == 1 + len(s.spec_token_ids) for s in o.scheduled) for o in steps]
    assert not all(decodes) and any(decodes)
    assert [o.steady for o in steps] == [d and i > 0 and decodes[i - 1] for i, d in enumerate(decodes)]
    assert 0 < len(measured) == sum(o.steady for o in steps)


def test_a_steps_time_covers_the_engines_whole_loop(models):
    """Under asynchronous scheduling a step's measured time runs from its launch to the next launch, so the
    caller's work on the outputs between two steps (here made 30 ms a step) counts: that work grows with the
    tokens a step emits, and leaving it out would favour the decision that emits more a step."""
    import time

    llm = dynamic_llm(models, cost_table(models, "any", (1.0,) * 4, (1.5,) * 4), forced_acceptance_prob=0.5,
                      async_scheduling=True)
    processor, policy = llm.engine.processor, llm.engine.core.scheduler.policy
    process, observe, measured = processor.process, policy.observe_step, []
    processor.process = lambda *a, **kw: time.sleep(0.03) or process(*a, **kw)
    policy.observe_step = lambda *step: measured.append(step[-1]) or observe(*step)
    llm.generate(models["prompts"][:2], GREEDY, use_tqdm=False)
    assert measured and min(measured) >= 0.03


def test_a_step_left_in_flight_between_calls_measures_nothing(models):
    """Under asynchronous scheduling a step can be launched for requests that its predecessor's tokens then finish
    (every draft accepted here, so the step in flight reaches max_tokens); generate returns with it in flight and
    the next call completes it. Its time from launch to that call is the
    caller's idle time (here 0.3 s): measured, it would swamp the moving averages of its decision."""
    import time

    llm = dynamic_llm(models, cost_table(models, "any", (1.0,) * 4, (1.5,) * 4), forced_acceptance_prob=1.0,
                      async_scheduling=True)
    core, policy = llm.engine.core, llm.engine.core.scheduler.policy
    observe, measured, left_in_flight = policy.observe_step, [], 0
    policy.observe_step = lambda *step: measured.append(step[-1]) or observe(*step)
    for p in models["prompts"][:4]:
        llm.generate([p], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        left_in_flight += core._inflight is not None
        time.sleep(0.3)
    assert left_in_flight and measured and max(measured) < 0.3


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_is_measured_with_the_decisions_its_work_holds(models, async_scheduling):
    """Its own and the step before's (whose drafts it verifies), and under asynchronous scheduling the one before
    that too, whose drafts the step before verified while this step's time waited for it."""
    llm = dynamic_llm(models, cost_table(models, "any", (1.0,) * 4, (1.5,) * 4), forced_acceptance_prob=0.5,
                      async_scheduling=async_scheduling)
    policy = llm.engine.core.scheduler.policy
    observe, decisions = policy.observe_step, []
    policy.observe_step = lambda *step: decisions.append(step[1]) or observe(*step)
    llm.generate(models["prompts"][:2], GREEDY, use_tqdm=False)
    assert decisions and {len(d) for d in decisions} == {3 if async_scheduling else 2}
