"""Greedy grammar rows through the greedy graphs (the CPU stand-in for CUDA graphs): the graph applies each step's
masks from the runner's bitmask buffer, so the output equals transformers' greedy decoding masked by xgrammar
(an independent reference), with and without chains of drafts, and a batch mixing grammar and free rows equals
each alone; a step without masks replays the same graph unmasked."""
from __future__ import annotations

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from heads import save_eagle_head, save_perturbed_copy
from schemas import SCHEMAS
from specserve import LLM, SamplingParams
from specserve.structured_output.spec import JSON_LAYOUT
from specserve.worker.cudagraph_mode import CUDAGraphMode as M
from specserve.worker.graph_recorder import EagerRecorder
from specserve.worker.step_path import Drafting, Sampling, Verification, WholeStep

PROMPTS = [[5, 9, 33, 2, 17], [40, 41, 42], [7, 7, 7, 7, 7, 7, 8], [100, 3, 250, 12]]
GRAMMARS = SCHEMAS[:4]
MAX_TOKENS = 24


def schema_params(schema: dict) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                          structured_output={"kind": "json_schema", "value": schema})


FREE = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def hf_constrained_greedy(hf, compiled, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens with the logits masked by xgrammar's own matcher and kernel, until the grammar
    ends (its stop token included) or n tokens."""
    matcher, bitmask, out = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, hf.config.vocab_size), []
    with torch.no_grad():
        while len(out) < n and not matcher.is_terminated():
            logits = hf(torch.tensor([ids + out])).logits[0, -1:].float()
            matcher.fill_next_token_bitmask(bitmask, 0)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            assert matcher.accept_token(token)
            out.append(token)
    return out


@pytest.fixture(scope="module")
def setup(tiny_llama, tokenizer_dir, tmp_path_factory):
    """(model path, the transformers references: grammar rows, free rows), and the drafters."""
    path, hf = tiny_llama
    root = tmp_path_factory.mktemp("masked_graphs")
    llm = LLM(str(path), max_model_len=256)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size,
                                              stop_token_ids=sorted(llm.engine.core.eos_token_ids))
    compiler = xgr.GrammarCompiler(info)
    # The engine's JSON layout (at most one blank between tokens).
    grammar_ref = [hf_constrained_greedy(hf, compiler.compile_json_schema(s, **JSON_LAYOUT), p, MAX_TOKENS)
                   for p, s in zip(PROMPTS, GRAMMARS)]
    free_ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, FREE, use_tqdm=False)]
    drafters = {
        None: None,
        "eagle3": {"method": "eagle3", "num_speculative_tokens": 3,
                   "model": str(save_eagle_head(root / "eagle3", hf.config, "eagle3", seed=2))},
        # Masked drafts, often accepted: verification's masks at every position count.
        "near": {"method": "draft_model", "num_speculative_tokens": 3, "mask_drafts": True,
                 "model": str(save_perturbed_copy(root / "near", path))},
    }
    return path, grammar_ref, free_ref, drafters


def graphed(setup, drafter) -> tuple[LLM, list]:
    """An engine whose graphs are recorded with the stand-in (FULL), and the list of every step's path."""
    path, _, _, drafters = setup
    llm = LLM(str(path), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64], speculative_config=drafters[drafter])
    runner = llm.engine.runner
    runner.capture_graphs(M.FULL, EagerRecorder(), llm.engine.attention_backend)
    paths, choose = [], runner._choose_path

    def recorded(desc, sched):
        paths.append(choose(desc, sched))
        return paths[-1]

    runner._choose_path = recorded
    return llm, paths


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("drafter", [None, "eagle3", "near"])
def test_greedy_graphs_apply_the_grammar_masks(setup, drafter):
    _, grammar_ref, free_ref, _ = setup
    llm, paths = graphed(setup, drafter)
    assert tokens(llm, PROMPTS, [schema_params(s) for s in GRAMMARS]) == grammar_ref
    masked = [p for p in paths if p.masked]
    assert masked and all(p.whole is WholeStep.NONE for p in masked)
    if drafter is None:
        assert any(p.sampling is Sampling.GREEDY_GRAPH for p in masked)
    else:
        assert any(p.verification is Verification.GREEDY_GRAPH for p in masked)
        assert llm.engine.spec_stats.num_drafted > 0
    if drafter == "near":
        assert llm.engine.spec_stats.num_accepted > 0
    # The head's drafts are unmasked (the default): drafted in the loop graph, as without a grammar.
    assert any(p.drafting is Drafting.GREEDY_LOOP_GRAPH for p in masked) == (drafter == "eagle3")
    # The same graphs, with the masks switched off by the staged header: free rows are the model's own.
    paths.clear()
    assert tokens(llm, PROMPTS, FREE) == free_ref
    assert not any(p.masked for p in paths) and any(p.whole is not WholeStep.NONE for p in paths)


@pytest.mark.parametrize("drafter", [None, "near"])
def test_a_batch_of_grammar_and_free_rows_equals_each_alone(setup, drafter):
    _, grammar_ref, free_ref, _ = setup
    llm, paths = graphed(setup, drafter)
    mixed = tokens(llm, PROMPTS * 2, [FREE] * len(PROMPTS) + [schema_params(s) for s in GRAMMARS])
    assert mixed == free_ref + grammar_ref
    assert any(p.masked and (p.sampling is Sampling.GREEDY_GRAPH or p.verification is Verification.GREEDY_GRAPH)
               for p in paths)
