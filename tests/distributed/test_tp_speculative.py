"""Speculative decoding under tensor parallelism on the CPU: the drafter whole on rank 0 beside a target sharded
over two ranks (gloo) drafts, accepts and emits exactly what it does beside the whole target (float32 greedy),
for EAGLE-3 chains and trees and EAGLE-1 (whose head shares the target's embedding and lm_head, read whole
from the checkpoint), with chunked prefill, prefix hits and preemption."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from tests.conftest import repetitive_prompts
from tests.heads import save_eagle_head

GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
TREE = "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]"
# Chunks of 16 tokens, and 10 blocks of 16 cannot hold 6 requests of up to 110 tokens at once.
SMALL = dict(max_model_len=128, block_size=16, num_kv_blocks=10, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def heads(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("tp-heads")
    cfg = tiny_llama[1].config
    return {m: save_eagle_head(root / m, cfg, m, seed=s) for m, s in (("eagle", 1), ("eagle3", 2))}


def _run(path, batches, **kwargs):
    """Each batch's tokens, one batch after another on one engine; the engine's drafted and accepted counts;
    the preemptions and prefix-cached tokens over all requests."""
    llm = LLM(str(path), dtype="float32", device="cpu", **kwargs)
    try:
        outs = [llm.generate(b, GREEDY, use_tqdm=False) for b in batches]
        stats = llm.engine.spec_stats
        every = [o for b in outs for o in b]
        return ([[o.outputs[0].token_ids for o in b] for b in outs], (stats.num_drafted, stats.num_accepted),
                sum(o.metrics.num_preemptions for o in every), sum(o.metrics.num_cached_tokens for o in every))
    finally:
        llm.engine.core.close()


@pytest.mark.parametrize("method, tree, async_scheduling", [("eagle3", None, False), ("eagle3", TREE, True),
                                                             ("eagle", None, True)],
                         ids=["eagle3-chain", "eagle3-tree-async", "eagle-chain-async"])
def test_tp2_speculation_equals_tp1(tiny_llama, heads, method, tree, async_scheduling):
    """With asynchronous scheduling every rank takes the in-flight requests' inputs from the outputs rank 0
    shares (StepOutputs.share_from_rank0); TP=1 schedules the same way, since asynchronous scheduling drafts
    for steps that a synchronous engine knows it will not run."""
    path, hf = tiny_llama
    prompts = repetitive_prompts(hf.config.vocab_size, n=6, seed=11)
    # The second batch repeats the last prompts, whose full blocks the prefix cache still holds.
    batches = [prompts, prompts[-2:]]
    spec = {"method": method, "model": str(heads[method]), "num_speculative_tokens": 3}
    if tree is not None:
        spec = {**spec, "speculative_token_tree": tree, "num_speculative_tokens": 3}
    want = _run(path, batches, speculative_config=spec, async_scheduling=async_scheduling, **SMALL)
    got = _run(path, batches, speculative_config={**spec, "draft_tensor_parallel_size": 1},
               tensor_parallel_size=2, async_scheduling=async_scheduling, **SMALL)
    assert got[0] == want[0]
    assert got[1] == want[1] and got[1][0] > 0  # the same drafts proposed and accepted
    assert got[2] > 0 and got[3] > 0  # preempted and hit the prefix cache
