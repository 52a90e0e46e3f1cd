"""End to end: trees of drafts are lossless, eagerly and in graphs, and a tree that is a chain drafts exactly
what the chain does, step by step."""
from __future__ import annotations

import pytest

from heads import save_eagle_head
from step_drafts import recorded_drafts
from test_speculative_e2e import GREEDY, target  # noqa: F401 (the target's fixture, with its reference outputs)
from specserve import LLM, SamplingParams
from specserve.worker.cudagraph_mode import CUDAGraphMode as M
from specserve.worker.graph_recorder import EagerRecorder

TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


@pytest.fixture(scope="module")
def heads(tmp_path_factory, tiny_llama):
    _, hf = tiny_llama
    root = tmp_path_factory.mktemp("tree")
    return {m: save_eagle_head(root / m, hf.config, m, seed=s) for m, s in (("eagle", 1), ("eagle3", 2))}


def graphed_tree_llm(path, heads, max_num_seqs: int, mode: M) -> LLM:
    """An EAGLE-3 tree engine with graphs recorded in `mode` by the CPU stand-in (which re-runs each recording)."""
    llm = LLM(str(path), max_model_len=256, max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
              cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64],
              speculative_config={"method": "eagle3", "model": str(heads["eagle3"]), "speculative_token_tree": TREE})
    llm.engine.runner.capture_graphs(mode, EagerRecorder(), llm.engine.attention_backend)
    return llm


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_tree_greedy_equals_no_speculation(target, heads, method):
    path, _, ps, ref = target
    llm = LLM(str(path), max_model_len=256, speculative_config={
        "method": method, "model": str(heads[method]), "speculative_token_tree": TREE},
        max_num_batched_tokens=48, num_kv_blocks=17, block_size=16)
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.engine.spec_stats.num_drafted > 0


@pytest.mark.parametrize("mode", [M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY, M.PIECEWISE], ids=lambda m: m.name)
def test_tree_under_graphs_with_the_cpu_stand_in(target, heads, mode):
    """Graphs recorded for trees (the CPU stand-in re-runs each recording): output unchanged, greedy batches
    that verify whole trees run as the whole tree step, padded rows included (3 requests in graphs of 4), and
    the other steps (the prefills) draft their trees in the tree graph where full graphs are recorded."""
    path, _, ps, ref = target
    llm = graphed_tree_llm(path, heads, 4, mode)
    runner = llm.engine.runner
    whole = runner.whole_step_graphs
    replays = []
    original = whole.run
    whole.run = lambda desc, fn, md: replays.append(desc.num_reqs) or original(desc, fn, md)
    trees = runner.speculator.tree_graphs
    tree_replays = []
    original_tree = trees.run
    trees.run = lambda desc, fn, md: tree_replays.append(desc.num_reqs) or original_tree(desc, fn, md)
    outs = llm.generate(ps[:3], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref[:3]
    assert (4 in replays) == (mode is not M.PIECEWISE) and (mode is M.PIECEWISE) == (not replays)
    assert bool(tree_replays) == (mode is not M.PIECEWISE)


def test_a_tree_that_is_a_chain_drafts_what_the_chain_drafts(target, heads):
    """The tree drafter (one pass a depth, tree masks, cache moves) against the chain drafter, same head."""
    path, _, ps, ref = target

    def llm(extra):
        return LLM(str(path), max_model_len=256, speculative_config={
            "method": "eagle3", "model": str(heads["eagle3"]), **extra})

    chain = recorded_drafts(llm({"num_speculative_tokens": 3}), ps[:4], GREEDY)
    tree = recorded_drafts(llm({"speculative_token_tree": "[(0,), (0, 0), (0, 0, 0)]"}), ps[:4], GREEDY)
    assert tree == chain and any(chain)


def test_a_cached_prompts_tail_runs_as_a_full_graph(target, heads):
    """A prompt the prefix cache holds prefills its uncached tail (at most a block) as a single-request full graph,
    the drafter's prefill with it, and the output is unchanged (the CPU stand-in re-runs each recording)."""
    path, _, ps, ref = target
    llm = graphed_tree_llm(path, heads, 1, M.FULL_AND_PIECEWISE)
    runner = llm.engine.runner
    assert [o.outputs[0].token_ids for o in llm.generate(ps[:2], GREEDY, use_tqdm=False)] == ref[:2]
    ran = []
    for graphs in (runner.graphs, runner.speculator.prefill_graphs):
        original = graphs.run
        graphs.run = lambda desc, fn, md, _run=original: ran.append(desc) or _run(desc, fn, md)
    outs = llm.generate(ps[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref[:2]
    tails = [d for d in ran if d.mode is M.FULL and d.num_reqs == 1
             and d.query_len in runner.graphs.single_request_query_lens]
    assert len(tails) == 4  # each prompt's tail: the target's graph and the drafter's prefill graph
    assert all(o.metrics.num_cached_tokens > 0 for o in outs)


def replays_of(graphs) -> list[int]:
    """The batch sizes graphs replays from now on."""
    replays = []
    original = graphs.run
    graphs.run = lambda desc, fn, md: replays.append(desc.num_reqs) or original(desc, fn, md)
    return replays


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded, top-k", "temperature alone"])
def test_a_sampled_tree_beside_greedy_ones(target, heads, seeded):
    """One request samples (its tree's children drawn from the head and verified by recursive rejection sampling,
    spec_decode/sampled_tree.py) beside greedy ones, with graphs recorded (the CPU stand-in): the greedy outputs
    equal no speculation. Such steps never draft in the tree graph (which drafts top guesses): a request with a
    seed or top-k drafts pass by pass, and repeats under its seed; one that draws with its temperature alone
    drafts in the sampled tree graph, padded (3 requests in the graph of 4)."""
    path, _, ps, ref = target
    llm = graphed_tree_llm(path, heads, 4, M.FULL_AND_PIECEWISE)
    drafter = llm.engine.runner.speculator
    tree_replays, sampled_replays = replays_of(drafter.tree_graphs), replays_of(drafter.sampled_tree_graphs)
    sampled = (SamplingParams(temperature=1.0, top_k=50, max_tokens=16, ignore_eos=True, seed=7) if seeded else
               SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True))
    params = [sampled, GREEDY, GREEDY]
    first = llm.generate(ps[:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first[1:]] == ref[1:3]
    assert first[0].outputs[0].token_ids != ref[0] and len(first[0].outputs[0].token_ids) == 16
    assert not tree_replays and llm.engine.spec_stats.num_drafted > 0
    if seeded:
        assert llm.generate(ps[:3], params, use_tqdm=False)[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert (4 in sampled_replays) != seeded and (not sampled_replays) == seeded


def test_the_whole_sampled_tree_step_draws_what_its_parts_draw(target, heads):
    """Batches of whole trees whose requests draw with their temperatures alone (two sampling, two greedy) replay
    the whole sampled tree step (the CPU stand-in), which verifies and drafts as the parts do, drawing from the
    engine's generator in the same order: with a graph for every batch size (so no padded row draws numbers the
    parts do not), two engines of the same seed, one of them without the whole step, emit the same tokens, and
    the greedy requests the target's own."""
    path, _, ps, ref = target

    def tree_llm() -> LLM:
        llm = LLM(str(path), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, seed=3,
                  cudagraph_capture_sizes=[1, 2, 3, 4], speculative_config={
                      "method": "eagle3", "model": str(heads["eagle3"]), "speculative_token_tree": TREE})
        llm.engine.runner.capture_graphs(M.FULL_AND_PIECEWISE, EagerRecorder(), llm.engine.attention_backend)
        return llm

    whole, parts = tree_llm(), tree_llm()
    parts.engine.runner.whole_sampled_tree_graphs = None
    replays = replays_of(whole.engine.runner.whole_sampled_tree_graphs)
    sampled = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    params = [sampled, GREEDY, sampled, GREEDY]
    outs = [[o.outputs[0].token_ids for o in llm.generate(ps[:4], params, use_tqdm=False)] for llm in (whole, parts)]
    assert outs[0] == outs[1]
    assert [outs[0][1], outs[0][3]] == [ref[1], ref[3]] and outs[0][0] != ref[0]
    assert 4 in replays and whole.engine.spec_stats.num_drafted > 0
