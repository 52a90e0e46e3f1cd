"""The drafter sharded like the target (draft_tensor_parallel_size 2) on the CPU, two ranks over gloo: every rank
runs its shard of the EAGLE head in lockstep with rank 0, chains and trees of drafts, and the float32 greedy
tokens, drafts and acceptances equal TP=1's (test_tp_speculative.py: TP=2 with the head whole on rank 0 equals
TP=1 too) or, where rank 0 samples or masks, TP=2's with the head whole on rank 0."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.config import EngineConfig
from specserve.errors import ConfigError
from tests.conftest import hf_greedy, repetitive_prompts
from tests.heads import save_eagle_head

GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
TREE = "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]"
# Chunks of 16 tokens, and 10 blocks of 16 cannot hold 6 requests of up to 110 tokens at once.
SMALL = dict(max_model_len=128, block_size=16, num_kv_blocks=10, max_num_batched_tokens=16)


def _prompts(hf) -> list[list[int]]:
    return repetitive_prompts(hf.config.vocab_size, n=6, seed=11)


@pytest.fixture(scope="module")
def heads(tmp_path_factory, tiny_llama):
    """A random EAGLE-1 head, and an EAGLE-3 head drafting only the tokens of the target's greedy answers, so that
    some of its drafts are accepted."""
    root = tmp_path_factory.mktemp("sharded-heads")
    hf = tiny_llama[1]
    answers = {t for p in _prompts(hf) for t in hf_greedy(hf, p, GREEDY.max_tokens)}
    return {"eagle": save_eagle_head(root / "eagle", hf.config, "eagle", seed=1),
            "eagle3": save_eagle_head(root / "eagle3", hf.config, "eagle3", seed=2, draft_token_ids=sorted(answers))}


def _run(path, prompts, params, **kwargs):
    """The prompts' tokens on one engine, its drafted and accepted counts, and every step's drafts."""
    llm = LLM(str(path), dtype="float32", device="cpu", **kwargs)
    runner, drafts = llm.engine.runner, []
    resolve = runner.resolve
    runner.resolve = lambda handle: (out := resolve(handle), drafts.append(sorted(out.drafts.values())))[0]
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.spec_stats
        return [o.outputs[0].token_ids for o in outs], (stats.num_drafted, stats.num_accepted), drafts
    finally:
        llm.engine.core.close()


def _spec(heads, method: str, tree: str | None) -> dict:
    spec = {"method": method, "model": str(heads[method]), "num_speculative_tokens": 3}
    return spec if tree is None else {**spec, "speculative_token_tree": tree}


@pytest.mark.parametrize("method, tree, async_scheduling", [
    ("eagle3", None, False), ("eagle3", None, True), ("eagle", None, True),
    ("eagle3", TREE, False), ("eagle3", TREE, True), ("eagle", TREE, True)],
    ids=["eagle3-chain", "eagle3-chain-async", "eagle-chain-async", "eagle3-tree", "eagle3-tree-async",
         "eagle-tree-async"])
def test_sharded_drafter_equals_tp1(tiny_llama, heads, method, tree, async_scheduling):
    """A tree's other rank retraces rank 0's walk from the outputs rank 0 shares, and moves its shards of the
    target's and the head's caches as rank 0 does: a wrong move or path would change its later drafts and, with
    asynchronous scheduling, the tokens its forward runs."""
    path, hf = tiny_llama
    prompts = _prompts(hf)
    spec = _spec(heads, method, tree)
    common = dict(async_scheduling=async_scheduling, **SMALL)
    want = _run(path, prompts, GREEDY, speculative_config=spec, **common)
    sharded = _run(path, prompts, GREEDY, speculative_config={**spec, "draft_tensor_parallel_size": 2},
                   tensor_parallel_size=2, **common)
    assert sharded[0] == want[0]
    assert sharded[1] == want[1]  # as many drafts proposed and accepted
    assert sharded[2] == want[2]  # the same drafts, step by step
    assert sharded[1][1] > 0 if method == "eagle3" else sharded[1][0] > 0


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_sharded_drafter_takes_rank0s_sampled_drafts(tiny_llama, heads, tree):
    """Sampled requests' drafts are rank 0's, broadcast to the other rank, which drafts on from them: had it drafted
    its own (the argmax), the head's all-reduces would sum shards of different tokens' states, and rank 0's later
    drafts would differ from those of the head whole on rank 0 (the same target, the same draws). A tree's drafts
    are its top guesses whatever the sampling, but its walk follows the target's sampled tokens, which the other
    rank retraces from rank 0's outputs."""
    path, hf = tiny_llama
    prompts = _prompts(hf)[:4]
    spec = _spec(heads, "eagle3", tree)
    params = [GREEDY, SamplingParams(temperature=1.5, seed=3, max_tokens=14, ignore_eos=True)] * 2
    common = dict(tensor_parallel_size=2, **SMALL)
    want = _run(path, prompts, params, speculative_config=spec, **common)
    got = _run(path, prompts, params, speculative_config={**spec, "draft_tensor_parallel_size": 2}, **common)
    assert got == want and got[1][1] > 0


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("tree, mask_drafts", [(None, True), (TREE, True), (None, False)],
                         ids=["chain", "tree", "chain-unmasked"])
def test_sharded_drafter_takes_rank0s_masked_drafts(tiny_llama, heads, tree, mask_drafts):
    """Under a grammar only rank 0 masks the head's logits (it alone holds the grammars): each draft, or each
    depth of a tree's guesses, is rank 0's, broadcast before the other rank drafts on from it; had it drafted from
    its unmasked logits, the drafts would differ from those of the head whole on rank 0. Unmasked, every rank
    takes the argmax of the same logits, as without a grammar."""
    path, _ = tiny_llama
    params = SamplingParams(temperature=0, max_tokens=40, structured_output={"kind": "json_schema", "value": SCHEMA})
    spec = {**_spec(heads, "eagle3", tree), "mask_drafts": mask_drafts}
    common = dict(tensor_parallel_size=2, max_model_len=256)
    want = _run(path, ["Give me JSON:", "Numbers: 1 2 3"], params, speculative_config=spec, **common)
    got = _run(path, ["Give me JSON:", "Numbers: 1 2 3"], params,
               speculative_config={**spec, "draft_tensor_parallel_size": 2}, **common)
    assert got == want and got[1][0] > 0


@pytest.mark.parametrize("tp, size, sharded", [(2, None, False), (2, 1, False), (2, 2, True), (1, 1, False)])
@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_draft_tensor_parallel_size_is_honoured(tiny_llama, heads, tp, size, sharded, tree):
    spec = {**_spec(heads, "eagle3", tree), "draft_tensor_parallel_size": size}
    cfg = EngineConfig(model=str(tiny_llama[0]), device="cpu", tensor_parallel_size=tp, speculative_config=spec)
    assert cfg.drafter_sharded is sharded


@pytest.mark.parametrize("tp, extra, match", [
    (2, {"draft_tensor_parallel_size": 3}, r"must be 1 \(the drafter whole on rank 0\) or tensor_parallel_size \(2\)"),
    (1, {"draft_tensor_parallel_size": 2}, r"or tensor_parallel_size \(1\), got 2"),
    (2, {"draft_tensor_parallel_size": 2, "method": "ngram"}, "drafts whole on rank 0: pass 1"),
], ids=["not-the-target-size", "without-tensor-parallelism", "ngram"])
def test_draft_tensor_parallel_size_is_refused_naming_the_fix(tiny_llama, heads, tp, extra, match):
    spec = {"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": 2, **extra}
    with pytest.raises(ConfigError, match=match) as e:
        EngineConfig(model=str(tiny_llama[0]), device="cpu", tensor_parallel_size=tp, speculative_config=spec)
    assert e.value.field == "speculative_config.draft_tensor_parallel_size"
