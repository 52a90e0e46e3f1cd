"""The runner and the EAGLE drafter under every graph mode, with the CPU stand-in for CUDA graphs:
dispatch reaches the graphs it should, padded rows are harmless, nothing stale survives, and the
debug check catches a replay that differs from eager."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from heads import save_eagle_head
from step_drafts import recorded_drafts
from specserve import LLM, SamplingParams
from specserve.worker.cudagraph import CUDAGraphMismatchError
from specserve.worker.cudagraph_mode import CUDAGraphMode as M
from specserve.worker.graph_recorder import EagerRecorder

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
GRAPH_MODES = [M.PIECEWISE, M.FULL, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE]


@pytest.fixture(scope="module")
def case(tiny_llama, tmp_path_factory):
    path, hf = tiny_llama
    rng = random.Random(5)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(rng.randint(2, 40))] for _ in range(7)]
    plain = LLM(str(path), max_model_len=256)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    head = save_eagle_head(tmp_path_factory.mktemp("g") / "eagle3", hf.config, "eagle3", seed=4)
    return path, prompts, ref, head


def graphed_llm(case, mode: M, k: int = 3) -> tuple[LLM, list]:
    path, _, _, head = case
    llm = LLM(str(path), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64],
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": k})
    engine = llm.engine
    engine.runner.capture_graphs(mode, EagerRecorder(), engine.attention_backend)
    used = []
    runner, spec = engine.runner, engine.runner.speculator
    for name, mgr in (("target", runner.graphs), ("prefill", spec.prefill_graphs), ("decode", spec.decode_graphs),
                      ("loop", spec.greedy_loop_graphs), ("whole", runner.whole_step_graphs)):
        original = mgr.run

        def run(desc, forward, metadata, _original=original, _name=name, _mgr=mgr):
            used.append((_name, desc.mode if _mgr.has_graph(desc) else M.NONE))
            return _original(desc, forward, metadata)

        mgr.run = run
    return llm, used


def outputs(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("mode", GRAPH_MODES, ids=lambda m: m.name)
def test_graph_modes_keep_greedy_output_and_dispatch_as_designed(case, mode):
    _, prompts, ref, _ = case
    llm, used = graphed_llm(case, mode)
    assert outputs(llm, prompts) == ref
    target = {m for n, m in used if n == "target"}
    # Greedy batches run every decode step in one graph (the loop); others step by step.
    decode = {m for n, m in used if n in ("decode", "loop")}
    prefill = {m for n, m in used if n == "prefill"}
    assert M.PIECEWISE not in decode  # docs/invariants.md, 'Draft decode is never piecewise'
    if mode.has_full:
        # Uniform greedy batches (every verification here) replay the whole step, loop included, as one graph.
        assert ("whole", M.FULL) in used
    if mode is M.FULL:
        assert M.FULL in target and M.FULL in prefill  # mixed batches
    if mode.has_piecewise:
        assert M.PIECEWISE in target and M.PIECEWISE in prefill
    if mode is M.FULL_DECODE_ONLY:
        assert M.NONE in target  # prefills run eagerly
    assert llm.engine.spec_stats.num_drafted > 0


@pytest.mark.parametrize("mode", GRAPH_MODES, ids=lambda m: m.name)
def test_greedy_decode_samples_in_its_own_graph_and_others_do_not(case, mode):
    path, prompts, ref, _ = case
    llm = LLM(str(path), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64])
    runner = llm.engine.runner
    runner.capture_graphs(mode, EagerRecorder(), llm.engine.attention_backend)
    replays = record_greedy_replays(llm)
    # Outputs of earlier steps must not leak into a graph's rows: the padded rows too are poisoned.
    runner.outputs.packed.fill_(987654)
    assert outputs(llm, prompts) == ref
    assert bool(replays) == mode.has_full
    assert all(d.mode is M.FULL and d.query_len == 1 for d in replays)
    if mode.has_full:
        assert {d.num_reqs for d in replays} >= {8, 1}  # 7 requests pad to 8; the last one alone
    replays.clear()
    # Logprobs and sampling need the logits: those batches sample eagerly, with the same tokens.
    with_logprobs = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, with_logprobs, use_tqdm=False)] == ref
    llm.generate(prompts[:2], SamplingParams(temperature=1.0, seed=1, max_tokens=4), use_tqdm=False)
    assert not replays


def record_greedy_replays(llm: LLM) -> list:
    """Descriptors of the replays that sample or verify greedily in a graph: of the greedy outputs' own graph,
    or of the whole step's."""
    runner, replays = llm.engine.runner, []
    for mgr in (runner.greedy_graphs, runner.whole_step_graphs):
        original = mgr.run
        mgr.run = lambda desc, *args, _original=original: replays.append(desc) or _original(desc, *args)
    return replays


@pytest.mark.parametrize("drafter", ["eagle3", "target itself"])
@pytest.mark.parametrize("mode", [M.FULL, M.FULL_DECODE_ONLY], ids=lambda m: m.name)
def test_greedy_verification_of_uniform_batches_runs_in_its_own_graph(case, mode, drafter):
    path, prompts, ref, head = case
    # The random head is always rejected; the target drafting for itself is accepted up to max_tokens.
    spec = {"method": "eagle3", "model": str(head)} if drafter == "eagle3" else {"method": "draft_model",
                                                                                 "model": str(path)}
    llm = LLM(str(path), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64],
              speculative_config={**spec, "num_speculative_tokens": 3})
    llm.engine.runner.capture_graphs(mode, EagerRecorder(), llm.engine.attention_backend)
    replays = record_greedy_replays(llm)
    # Earlier steps' outputs, padded rows included, must not reach a verification's accepted counts.
    llm.engine.runner.outputs.packed.fill_(987654)
    assert outputs(llm, prompts) == ref
    verified = {d.num_reqs for d in replays if d.query_len == 4}  # k = 3
    # 7 requests pad to 8 while they all verify together; the target drafting for itself finishes them in
    # fewer, staggered steps.
    assert 8 in verified if drafter == "eagle3" else verified
    in_graph = copy.deepcopy(llm.engine.spec_stats)
    assert in_graph.num_drafted > 0 and (in_graph.num_accepted > 0) == (drafter == "target itself")
    # Asking for logprobs verifies the same drafts eagerly: each position accepts as often.
    replays.clear()
    with_logprobs = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, with_logprobs, use_tqdm=False)] == ref
    assert not replays
    eager = llm.engine.spec_stats.accepted_per_position
    assert [e - g for e, g in zip(eager, in_graph.accepted_per_position)] == in_graph.accepted_per_position


@pytest.mark.parametrize("mode", [M.FULL, M.FULL_AND_PIECEWISE], ids=lambda m: m.name)
def test_a_prefill_as_long_as_a_verification_samples_without_verifying(case, mode):
    """A prompt of k + 1 tokens, alone, is a uniform batch of the verification's query length: the target
    runs that full graph, but nothing is drafted yet, so its token must be sampled, not verified."""
    path, _, _, head = case
    prompts = [[5, 9, 17, 33], [40, 41, 42, 43]]
    plain = LLM(str(path), max_model_len=256)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(str(path), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64],
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    llm.engine.runner.capture_graphs(mode, EagerRecorder(), llm.engine.attention_backend)
    replays = record_greedy_replays(llm)
    for prompt, want in zip(prompts, ref):
        assert outputs(llm, [prompt]) == [want]
    assert replays and all(d.query_len == 4 for d in replays)


def test_forced_acceptance_takes_the_same_draws_in_the_verification_graph(case):
    path, prompts, _, head = case
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "forced_acceptance_prob": 0.5}
    eager, graphed = (LLM(str(path), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                          cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64], speculative_config=spec)
                      for _ in range(2))
    graphed.engine.runner.capture_graphs(M.FULL_DECODE_ONLY, EagerRecorder(), graphed.engine.attention_backend)
    replays = record_greedy_replays(graphed)
    # Four requests, a capture size, so the graphed batch is not padded (see the loop test below).
    assert outputs(graphed, prompts[:4]) == outputs(eager, prompts[:4])
    assert any(d.query_len == 4 for d in replays)
    stats = graphed.engine.spec_stats
    assert 0 < stats.num_accepted < stats.num_drafted


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_loop_graph_drafts_what_eager_drafting_drafts(case, k):
    path, prompts, _, head = case
    eager = LLM(str(path), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": k})
    llm, used = graphed_llm(case, M.FULL_DECODE_ONLY, k)
    # Draft 1 comes from the prefill's hidden state copied into the loop's buffer: a stale or poisoned
    # row there would change the drafts.
    llm.engine.runner.speculator.first_hidden.fill_(float("nan"))
    # Four requests, a capture size: a padded batch multiplies matrices of another height, whose float32
    # sums differ in the last bits and may flip a near-tie between two draft logits (7 requests did).
    graphed = recorded_drafts(llm, prompts[:4], GREEDY)
    assert ("whole", M.FULL) in used
    assert graphed == recorded_drafts(eager, prompts[:4], GREEDY)
    assert sum(len(d) for step in graphed for d in step.values()) > 0


@pytest.mark.parametrize("num_prompts", [4, 7])
def test_whole_step_graph_does_what_its_parts_do(case, num_prompts):
    """The whole step as one graph against the same step in one graph per part (the target, greedy
    verification, the drafter's prefill and loop): the same tokens and the same drafts every step, also for
    7 requests padded to 8, whose padded rows the whole step's gather fills (poisoned here)."""
    _, prompts, ref, _ = case
    whole, used = graphed_llm(case, M.FULL_AND_PIECEWISE)
    parts, _ = graphed_llm(case, M.FULL_AND_PIECEWISE)
    parts.engine.runner.whole_step_graphs = None
    for llm in (whole, parts):
        llm.engine.runner.draft_last_indices.fill_(987654)
        llm.engine.runner.draft_last_tokens.fill_(987654)
    drafted = recorded_drafts(whole, prompts[:num_prompts], GREEDY)
    assert ("whole", M.FULL) in used
    assert drafted == recorded_drafts(parts, prompts[:num_prompts], GREEDY)
    assert outputs(whole, prompts[:num_prompts]) == ref[:num_prompts]
    assert whole.engine.spec_stats.accepted_per_position == parts.engine.spec_stats.accepted_per_position


def test_sampled_batches_run_decode_steps_one_graph_at_a_time(case):
    _, prompts, _, _ = case
    llm, used = graphed_llm(case, M.FULL_AND_PIECEWISE)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params, use_tqdm=False)]
    assert ("decode", M.FULL) in used and not any(n == "loop" for n, _ in used)
    # Seeded sampling under graphs is reproducible.
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params, use_tqdm=False)] == first


def test_full_graphs_reuse_the_targets_metadata(case):
    llm, _ = graphed_llm(case, M.FULL_AND_PIECEWISE)
    runner = llm.engine.runner
    prefill = runner.speculator.prefill_graphs
    full_keys = [key for key in runner.graphs.metadata]
    assert full_keys and all(prefill.metadata[key] is runner.graphs.metadata[key] for key in full_keys)


def test_poisoned_buffers_change_nothing(case):
    _, prompts, ref, _ = case
    llm, _ = graphed_llm(case, M.FULL_AND_PIECEWISE)
    runner = llm.engine.runner
    spec = runner.speculator
    b, s = runner.buffers, spec.step_buffers
    for t in (b.input_ids, b.positions, b.slot_mapping, b.query_start_loc, b.seq_lens, b.block_table,
              b.staged, s.positions, s.seq_lens, s.query_start_loc, s.slot_mapping, s.last_token_indices,
              spec.next_ids, spec.decode_tokens, runner.draft_block_table, runner.draft_base_positions,
              runner.draft_last_indices, runner.draft_last_tokens):
        t.fill_(987654)
    spec.feedback.fill_(float("nan"))
    spec.first_hidden.fill_(float("nan"))
    assert outputs(llm, prompts) == ref


def test_small_batch_after_large_batch_gets_its_own_outputs(case):
    _, prompts, ref, _ = case
    llm, used = graphed_llm(case, M.FULL_AND_PIECEWISE)
    assert outputs(llm, prompts) == ref
    used.clear()
    assert outputs(llm, prompts[-1:]) == ref[-1:]
    assert ("whole", M.FULL) in used


def test_debug_check_passes_then_catches_a_stale_replay(case):
    _, prompts, ref, _ = case
    llm, _ = graphed_llm(case, M.FULL_AND_PIECEWISE)
    runner = llm.engine.runner
    spec = runner.speculator
    for mgr in (runner.graphs, spec.prefill_graphs, spec.decode_graphs, spec.greedy_loop_graphs):
        mgr.debug = True
    assert outputs(llm, prompts[:3]) == ref[:3]
    # A graph that no longer reads its inputs (as after a buffer was reallocated) must be caught.
    for graph in runner.graphs.graphs.values():
        graph._replay = lambda _metadata: None
    with pytest.raises(CUDAGraphMismatchError, match="graph replay differs from eager"):
        llm.generate(prompts[:2], GREEDY, use_tqdm=False)


def test_debug_option_from_environment(monkeypatch):
    from specserve.config import EngineConfig

    monkeypatch.setenv("SPECSERVE_DEBUG_CUDAGRAPH", "1")
    assert EngineConfig().debug_cudagraph
    monkeypatch.setenv("SPECSERVE_DEBUG_CUDAGRAPH", "0")
    assert not EngineConfig().debug_cudagraph


def test_graph_config_errors_name_the_field():
    from specserve.config import EngineConfig
    from specserve.errors import ConfigError

    with pytest.raises(ConfigError, match="cudagraph_mode.*one of"):
        EngineConfig(cudagraph_mode="SOMETIMES")
    with pytest.raises(ConfigError, match="cudagraph_mode.*GPU only"):
        EngineConfig(device="cpu", cudagraph_mode="FULL")
    with pytest.raises(ConfigError, match="cudagraph_capture_sizes"):
        EngineConfig(cudagraph_capture_sizes=[0, 4])
    assert EngineConfig(cudagraph_capture_sizes=[8, 1, 8]).cudagraph_capture_sizes == [1, 8]
    assert torch.device(EngineConfig().device).type == "cpu" or EngineConfig().cudagraph_mode == "FULL_AND_PIECEWISE"
