"""Grammar-constrained decoding on a GPU: the masks built on the host and applied on the device (inside the greedy
graphs, or eagerly) give the CPU reference's constrained tokens, under CUDA graphs, with and without drafts, and
leave the requests without a grammar in the same batches unchanged."""
from __future__ import annotations

import json

import jsonschema
import pytest

from heads import save_eagle_head, save_perturbed_copy
from schemas import SCHEMAS
from specserve import LLM, SamplingParams
from specserve.worker.step_path import Drafting, Sampling, Verification, WholeStep

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_float32")]
PROMPTS = ["Give me JSON:", "Numbers: 1 2 3", "The quick brown fox"]
USED = SCHEMAS[:8]
FREE = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
SMALL_KV = {"kv_cache_memory_bytes": 256 << 20}


def constrained(schema: dict) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=64, structured_output={"kind": "json_schema", "value": schema})


@pytest.fixture(scope="module")
def case(tiny_llama, tmp_path_factory):
    path, _ = tiny_llama
    near = save_perturbed_copy(tmp_path_factory.mktemp("near") / "near", path)
    prompts = PROMPTS * len(USED)
    params = [constrained(s) for s in USED for _ in PROMPTS]
    cpu = LLM(str(path), max_model_len=256, device="cpu")
    ref = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    free_ref = [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, FREE, use_tqdm=False)]
    return path, near, prompts, params, ref, free_ref


@pytest.mark.parametrize("spec", [None, "near"])
def test_cuda_constrained_equals_cpu_beside_free_requests(case, spec):
    path, near, prompts, params, ref, free_ref = case
    cfg = None if spec is None else {"method": "draft_model", "model": str(near), "num_speculative_tokens": 3,
                                     "mask_drafts": True}
    llm = LLM(str(path), max_model_len=256, device="cuda", dtype="float32", **SMALL_KV, speculative_config=cfg,
              cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32])
    outs = llm.generate(prompts + PROMPTS, params + [FREE] * len(PROMPTS), use_tqdm=False)
    got = [o.outputs[0] for o in outs]
    assert [o.token_ids for o in got[:len(ref)]] == ref
    assert [o.token_ids for o in got[len(ref):]] == free_ref
    for i, out in enumerate(got[:len(ref)]):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), USED[i // len(PROMPTS)])
    if spec is not None:
        assert llm.engine.spec_stats.num_accepted > 0


def recorded_paths(llm: LLM) -> list:
    runner, paths = llm.engine.runner, []
    choose = runner._choose_path
    runner._choose_path = lambda desc, sched: paths.append(choose(desc, sched)) or paths[-1]
    return paths


@pytest.mark.parametrize("spec", [None, "eagle3", "eagle3_masked", "near_masked"])
def test_cuda_greedy_grammar_steps_replay_the_masked_greedy_graph_as_eager_runs(case, tiny_llama, tmp_path, spec):
    """The greedy graph (decode, chain verification) applies the masks on the device: the same tokens as an engine
    on the same device without graphs, and as the CPU's; with unmasked drafts (the default) the drafter's loop graph
    drafts."""
    path, near, prompts, params, ref, _ = case
    head = {"method": "eagle3", "num_speculative_tokens": 3,
            "model": str(save_eagle_head(tmp_path / "eagle3", tiny_llama[1].config, "eagle3", seed=2))}
    cfg = {None: None, "eagle3": head, "eagle3_masked": head | {"mask_drafts": True},
           "near_masked": {"method": "draft_model", "model": str(near), "num_speculative_tokens": 3,
                           "mask_drafts": True}}[spec]
    kw = dict(max_model_len=256, device="cuda", dtype="float32", **SMALL_KV, speculative_config=cfg)
    eager = LLM(str(path), cudagraph_mode="NONE", **kw)
    eager_tokens = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager
    graphed = LLM(str(path), cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32], **kw)
    paths = recorded_paths(graphed)
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    assert got == eager_tokens == ref
    masked = [p for p in paths if p.masked]
    assert masked and all(p.whole is WholeStep.NONE for p in masked)
    greedy_graph = Verification.GREEDY_GRAPH if spec else Sampling.GREEDY_GRAPH
    assert any(greedy_graph in (p.sampling, p.verification) for p in masked)
    drafting = {p.drafting for p in masked}
    assert (Drafting.GREEDY_LOOP_GRAPH in drafting) == (spec == "eagle3")
