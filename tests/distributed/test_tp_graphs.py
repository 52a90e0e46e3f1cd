"""Graphs under tensor parallelism with the CPU stand-in recorder (EagerRecorder, whose replay re-runs the
recording): rank 0 records its graphs and the other rank records its body of each part for the same
descriptors; every step the other rank replays the graph rank 0 names (it fails if it has none), and the
tokens, drafts and acceptances equal TP=1's without graphs. On a GPU the same decisions replay NCCL inside
CUDA graphs (tests/gpu/test_tensor_parallel_cuda.py)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from specserve import LLM, SamplingParams
from specserve.worker.cudagraph_mode import CUDAGraphMode as M
from specserve.worker.graph_recorder import EagerRecorder
from tests.conftest import repetitive_prompts
from tests.heads import save_eagle_head

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
TREE = "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]"
# Blocks of 8 tokens: a lone request's full graphs are recorded for query lengths up to a block, 7 graphs where
# blocks of 16 take 15 of the same kind.
ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, block_size=8, max_num_seqs=4,
              max_num_batched_tokens=64,
              cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64])


@pytest.fixture(scope="module")
def head(tmp_path_factory, tiny_llama):
    return save_eagle_head(tmp_path_factory.mktemp("tp-graphs") / "eagle3", tiny_llama[1].config, "eagle3", seed=2)


def _spec(head, drafts: str | None):
    """No drafter, an EAGLE-3 chain or tree whole on rank 0, or ("sharded-" before either) of the head sharded
    like the target."""
    if drafts is None:
        return None
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    if drafts.startswith("sharded-"):
        return {**_spec(head, drafts.removeprefix("sharded-")), "draft_tensor_parallel_size": 2}
    return {**spec, "speculative_token_tree": TREE} if drafts == "tree" else spec


@dataclass(frozen=True)
class Reference:
    tokens: list[list[int]]
    drafted_and_accepted: tuple[int, int]


@pytest.fixture(scope="module")
def tp1_reference(tiny_llama, head):
    """TP=1's greedy run of the prompts without graphs, once per drafter and scheduling (asynchronous scheduling
    drafts for steps a synchronous engine knows it will not run, so the drafted counts differ)."""
    path, hf = tiny_llama
    runs: dict[tuple[str | None, bool], Reference] = {}

    def reference(drafts: str | None, async_scheduling: bool) -> Reference:
        drafts = drafts and drafts.removeprefix("sharded-")  # TP=1 has no placement of the drafter
        key = (drafts, async_scheduling)
        if key not in runs:
            ref = LLM(str(path), speculative_config=_spec(head, drafts), async_scheduling=async_scheduling, **ENGINE)
            try:
                tokens = [o.outputs[0].token_ids for o in ref.generate(prompts(hf), GREEDY, use_tqdm=False)]
                runs[key] = Reference(tokens, (ref.engine.spec_stats.num_drafted, ref.engine.spec_stats.num_accepted))
            finally:
                ref.engine.core.close()
        return runs[key]

    return reference


def prompts(hf) -> list[list[int]]:
    return repetitive_prompts(hf.config.vocab_size, n=3, seed=17)


@pytest.mark.parametrize("drafts, mode, async_scheduling", [
    (None, M.FULL_AND_PIECEWISE, False), ("chain", M.FULL_AND_PIECEWISE, True), ("tree", M.FULL_AND_PIECEWISE, True),
    ("chain", M.PIECEWISE, True), ("sharded-chain", M.FULL_AND_PIECEWISE, True),
    ("sharded-chain", M.FULL_AND_PIECEWISE, False), ("sharded-chain", M.PIECEWISE, True),
    ("sharded-tree", M.FULL_AND_PIECEWISE, True), ("sharded-tree", M.FULL_AND_PIECEWISE, False),
    ("sharded-tree", M.FULL_DECODE_ONLY, True), ("sharded-tree", M.PIECEWISE, True)],
    ids=["none-full", "chain-full-async", "tree-full-async", "chain-piecewise-async", "sharded-chain-full-async",
         "sharded-chain-full", "sharded-chain-piecewise-async", "sharded-tree-full-async", "sharded-tree-full",
         "sharded-tree-full-decode-only-async", "sharded-tree-piecewise-async"])
def test_tp2_graphs_follow_rank0_and_equal_tp1(tiny_llama, head, tp1_reference, drafts, mode, async_scheduling):
    """With asynchronous scheduling the whole step's graph takes its in-flight inputs from the outputs rank 0
    shares at the end of the previous step's graph. A sharded tree's other rank retraces rank 0's walk from the
    outputs rank 0 shares after verifying, in the whole tree step's graph and outside it (the drafter's tree
    graph, or its passes)."""
    path, hf = tiny_llama
    spec = _spec(head, drafts)
    want = tp1_reference(drafts, async_scheduling)
    llm = LLM(str(path), speculative_config=spec, tensor_parallel_size=2, async_scheduling=async_scheduling,
              **ENGINE)
    try:
        runner = llm.engine.runner
        runner.capture_graphs(mode, EagerRecorder(), llm.engine.attention_backend)
        replays = {"target": [], "whole": []}
        for name, manager in (("target", runner.graphs), ("whole", runner.whole_step_graphs)):
            if manager is not None:
                original = manager.run
                manager.run = lambda desc, fn, md, name=name, original=original: (
                    replays[name].append(desc.mode) or original(desc, fn, md))
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(hf), GREEDY, use_tqdm=False)]
        assert got == want.tokens
        assert (llm.engine.spec_stats.num_drafted, llm.engine.spec_stats.num_accepted) == want.drafted_and_accepted
        # Rank 0 replayed graphs, which the other rank followed: the whole step where full graphs are recorded,
        # the target's piecewise graphs otherwise.
        if mode is M.PIECEWISE:
            assert M.PIECEWISE in replays["target"] and not replays["whole"]
        else:
            assert replays["whole"]
    finally:
        llm.engine.core.close()
