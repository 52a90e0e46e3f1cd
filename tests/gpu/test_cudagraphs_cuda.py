"""Real CUDA graphs on the GPU, every mode, target and EAGLE drafter: replay equals eager (the debug
check compares every replay bit for bit), greedy output with EAGLE equals output without it in float32,
poisoned buffers change nothing, a small batch after a large one gets its own outputs."""
from __future__ import annotations

import random

import pytest
import torch

from heads import save_eagle_head
from scripted_policy import scripted
from step_drafts import recorded_drafts
from specserve import LLM, SamplingParams
from specserve.worker.cudagraph_mode import CUDAGraphMode as M

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_float32")]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
MODES = [m.name for m in M]
# The tiny model's engines get a small cache: sized by a share of the GPU, its 8 KiB blocks would number millions.
SMALL_KV = {"kv_cache_memory_bytes": 256 << 20}



@pytest.fixture(scope="module")
def case(tiny_llama, tmp_path_factory):
    path, hf = tiny_llama
    rng = random.Random(11)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(rng.randint(2, 90))] for _ in range(12)]
    cpu = LLM(str(path), max_model_len=256, device="cpu")
    ref = [o.outputs[0].token_ids for o in cpu.generate(prompts, GREEDY, use_tqdm=False)]
    head = save_eagle_head(tmp_path_factory.mktemp("cg") / "eagle3", hf.config, "eagle3", seed=6)
    return path, prompts, ref, head


def make_llm(case, mode: str, spec: bool, debug: bool = True) -> LLM:
    path, _, _, head = case
    cfg = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3} if spec else None
    return LLM(str(path), max_model_len=256, device="cuda", **SMALL_KV, dtype="float32", cudagraph_mode=mode,
               debug_cudagraph=debug, max_num_seqs=16, max_num_batched_tokens=128,
               cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64, 128], speculative_config=cfg)


def count_replays(llm: LLM) -> dict[str, int]:
    runner = llm.engine.runner
    if runner.graphs is None:  # mode NONE
        return {}
    managers = {"target": runner.graphs, "greedy": runner.greedy_graphs, "whole": runner.whole_step_graphs}
    if runner.speculator is not None:
        spec = runner.speculator
        managers.update(prefill=spec.prefill_graphs, decode=spec.decode_graphs, loop=spec.greedy_loop_graphs,
                        tree=spec.tree_graphs, sampled_tree=spec.sampled_tree_graphs)
    counts = dict.fromkeys(managers, 0)
    for name, mgr in managers.items():
        if mgr is None:
            continue
        original = mgr.run

        def run(desc, forward, metadata, _o=original, _n=name, _m=mgr):
            counts[_n] += _m.has_graph(desc)
            return _o(desc, forward, metadata)

        mgr.run = run
    return counts


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "eagle3"])
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_replays_equal_eager_and_greedy_is_lossless(case, mode, spec):
    _, prompts, ref, _ = case
    llm = make_llm(case, mode, spec)
    counts = count_replays(llm)
    # Large batches, then smaller ones: each batch must get its own outputs under the graphs.
    for n in (12, 5, 1, 3):
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts[:n], GREEDY, use_tqdm=False)]
        assert outs == ref[:n], f"mode {mode}, batch {n}"
    if mode != "NONE":
        assert counts["target"] > 0
        # Greedy uniform batches sample (decode) or verify their drafts inside a graph of their own.
        assert (counts["greedy"] > 0) == M[mode].has_full
        if spec:
            assert counts["prefill"] > 0
            # Greedy: all decode steps replay as one graph per batch.
            assert (counts["loop"] > 0) == M[mode].has_full
    if spec:
        assert llm.engine.spec_stats.num_drafted > 0
        # Sampled requests draft step by step (per-step decode graphs), still replay == eager under debug.
        sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
        llm.generate(prompts[:4], sampled, use_tqdm=False)
        if mode != "NONE":
            assert (counts["decode"] > 0) == M[mode].has_full


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "eagle3"])
@pytest.mark.parametrize("mode", [m.name for m in M if m.has_full])
def test_whole_step_graphs_are_lossless_and_draft_what_the_parts_draft(case, mode, spec):
    """Without the debug check (which runs each part in its own graph), greedy uniform batches replay the whole
    step as one real CUDA graph: output equals the CPU's, and every step drafts exactly what the same step
    does with each part in its own graph, padded batches (5 and 3 requests) included."""
    _, prompts, ref, _ = case
    whole = make_llm(case, mode, spec, debug=False)
    counts = count_replays(whole)
    if spec:
        # Two fresh engines, fed the same requests (so the same ids and prefix-cache hits) in the same order.
        parts = make_llm(case, mode, spec, debug=False)
        parts.engine.runner.whole_step_graphs = None
        for n in (5, 3):
            assert recorded_drafts(whole, prompts[:n], GREEDY) == recorded_drafts(parts, prompts[:n], GREEDY)
        assert whole.engine.spec_stats.num_drafted > 0
    for n in (12, 5, 1, 3):
        outs = [o.outputs[0].token_ids for o in whole.generate(prompts[:n], GREEDY, use_tqdm=False)]
        assert outs == ref[:n], f"mode {mode}, batch {n}"
    assert counts["whole"] > 0


@pytest.mark.parametrize("debug", [True, False], ids=["parts", "whole step"])
def test_poisoned_buffers_change_nothing_on_the_gpu(case, debug):
    _, prompts, ref, _ = case
    llm = make_llm(case, "FULL_AND_PIECEWISE", spec=True, debug=debug)
    runner = llm.engine.runner
    spec = runner.speculator
    b, s = runner.buffers, spec.step_buffers
    for t in (b.input_ids, b.positions, b.slot_mapping, b.query_start_loc, b.seq_lens, b.block_table,
              b.staged, s.positions, s.seq_lens, s.query_start_loc, s.slot_mapping, s.last_token_indices,
              spec.next_ids, spec.decode_tokens, runner.draft_block_table, runner.draft_base_positions,
              runner.draft_last_indices, runner.draft_last_tokens):
        t.fill_(2**30)
    spec.feedback.fill_(float("nan"))
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts[:7], GREEDY, use_tqdm=False)]
    torch.cuda.synchronize()
    assert outs == ref[:7]


def test_graphs_are_captured_quickly_and_report_memory(case):
    llm = make_llm(case, "FULL_AND_PIECEWISE", spec=True)
    runner = llm.engine.runner
    assert runner.capture_seconds is not None and runner.capture_seconds < 60
    assert runner.graph_memory_bytes is not None and runner.graph_memory_bytes >= 0


TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)]"


@pytest.mark.parametrize("mode,debug", [("FULL_AND_PIECEWISE", False), ("FULL_AND_PIECEWISE", True),
                                        ("PIECEWISE", True), ("NONE", False)])
def test_trees_of_drafts_are_lossless_under_graphs(case, mode, debug):
    """A tree of drafts in real graphs: greedy output equals the CPU's at every batch size, the whole tree step
    (without the debug check) drafts what the parts draft, and sampling runs beside it."""
    path, prompts, ref, head = case

    def tree_llm():
        return LLM(str(path), max_model_len=256, device="cuda", **SMALL_KV, dtype="float32", cudagraph_mode=mode,
                   debug_cudagraph=debug, max_num_seqs=16, max_num_batched_tokens=128,
                   cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64, 128],
                   speculative_config={"method": "eagle3", "model": str(head), "speculative_token_tree": TREE})

    llm = tree_llm()
    counts = count_replays(llm)
    if mode == "FULL_AND_PIECEWISE" and not debug:
        parts = tree_llm()
        parts.engine.runner.whole_step_graphs = None
        for n in (5, 3):
            assert recorded_drafts(llm, prompts[:n], GREEDY) == recorded_drafts(parts, prompts[:n], GREEDY)
    for n in (12, 5, 1, 3):
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts[:n], GREEDY, use_tqdm=False)]
        assert outs == ref[:n], f"mode {mode}, batch {n}"
    assert llm.engine.spec_stats.num_drafted > 0
    if mode != "NONE":
        assert counts["target"] > 0 and counts["prefill"] > 0
        assert (counts["whole"] > 0) == (mode == "FULL_AND_PIECEWISE" and not debug)
    # Sampled trees: a seeded request's children drawn pass by pass (repeating under its seed), an unseeded one's
    # in the sampled tree graph (its draws from the engine's generator, registered with the graph; under debug
    # each replay is checked against an eager run from the same generator state).
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], seeded, use_tqdm=False)]
    assert all(len(t) == 12 for t in first)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:4], seeded, use_tqdm=False)] == first
    before = counts.get("sampled_tree", 0)
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], unseeded, use_tqdm=False)]
    assert all(len(t) == 12 for t in outs) and len(set(map(tuple, outs))) > 1
    full = M[mode].has_full  # the drafter's tree graphs are full graphs
    assert (counts.get("sampled_tree", 0) > before) == full
    if full and not debug:
        # Each replay of the sampled tree graph draws new numbers (the generator's offset advances). Replayed for
        # requests that have finished, whose trees' cache writes may share slots: not for the debug check.
        drafter = llm.engine.runner.speculator
        drafter.tree_draws.greedy[:4] = False
        drafter.tree_draws.rows[:4] = torch.arange(4)
        one, two = (drafter._replay_for(drafter.sampled_tree_graphs, 4, drafter._sampled_tree_in_graph).clone()
                    for _ in range(2))
        assert not torch.equal(one, two)


def test_the_whole_sampled_tree_step_draws_what_its_parts_draw_in_real_graphs(case):
    """Trees whose requests draw with their temperatures alone (two sampling, two greedy) replay the whole sampled
    tree step in a real graph, its draws from the engine's generator registered with it: with a graph for every
    batch size, an engine of the same seed without that step emits the same tokens, the greedy requests the CPU's,
    and each replay draws new numbers."""
    path, prompts, ref, head = case

    def tree_llm() -> LLM:
        return LLM(str(path), max_model_len=256, device="cuda", **SMALL_KV, dtype="float32", seed=3,
                   debug_cudagraph=False, max_num_seqs=4, max_num_batched_tokens=128,
                   cudagraph_capture_sizes=[1, 2, 3, 4],
                   speculative_config={"method": "eagle3", "model": str(head), "speculative_token_tree": TREE})

    whole, parts = tree_llm(), tree_llm()
    parts.engine.runner.whole_sampled_tree_graphs = None
    graphs = whole.engine.runner.whole_sampled_tree_graphs
    replays = []
    original = graphs.run
    graphs.run = lambda desc, fn, md: replays.append(desc.num_reqs) or original(desc, fn, md)
    sampled = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    params = [sampled, GREEDY, sampled, GREEDY]
    outs = [[o.outputs[0].token_ids for o in llm.generate(prompts[:4], params, use_tqdm=False)]
            for llm in (whole, parts)]
    assert outs[0] == outs[1]
    assert [outs[0][1], outs[0][3]] == [ref[1], ref[3]]
    assert 4 in replays
    again = [o.outputs[0].token_ids for o in whole.generate(prompts[:4], params, use_tqdm=False)]
    assert again[0] != outs[0][0] or again[2] != outs[0][2]


def test_steps_kept_from_drafting_decode_in_the_whole_plain_step_in_real_graphs(case):
    """A dynamic engine whose decisions are scripted (drafts on some steps, none on others): the steps that draft
    nothing and verify nothing replay the whole plain step's real graph, and greedy output equals the CPU's."""
    path, prompts, ref, head = case
    llm = LLM(str(path), max_model_len=256, device="cuda", **SMALL_KV, dtype="float32", debug_cudagraph=False,
              max_num_seqs=16, max_num_batched_tokens=128, cudagraph_capture_sizes=[1, 2, 4, 8, 16],
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3,
                                  "dynamic": True})
    graphs = llm.engine.runner.plain_step_graphs
    replays = []
    original = graphs.run
    graphs.run = lambda desc, fn, md: replays.append(desc.num_reqs) or original(desc, fn, md)
    scripted(llm, [3, 0, 0, 0, 3, 3, 0, 0])
    for n in (12, 3):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts[:n], GREEDY, use_tqdm=False)] == ref[:n]
    assert replays and llm.engine.spec_stats.num_drafted > 0
