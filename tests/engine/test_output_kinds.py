"""Output kinds: cumulative, delta and final-only outputs carry the same generation, checked against
transformers' greedy tokens."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.errors import InvalidRequestError
from specserve.sampling_params import RequestOutputKind

KINDS = ("cumulative", "delta", "final_only")


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    x = torch.tensor([prompt])
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def same_logprobs(a: list[dict], b: list[dict]) -> bool:
    """Same tokens and ranks, and logprobs equal up to float error (the requests ran in other batch rows)."""
    flat = lambda entries: [(t, lp.rank, lp.logprob) for d in entries for t, lp in d.items()]
    return [x[:2] for x in flat(a)] == [x[:2] for x in flat(b)] and \
        [x[2] for x in flat(a)] == pytest.approx([x[2] for x in flat(b)], abs=1e-5)


def run_kinds(llm: LLM, prompts: list[list[int]], **params) -> dict[tuple[str, int], list]:
    """Every output of each (kind, prompt), all requests in one batch."""
    engine = llm.engine
    ids = {engine.add_request(p, SamplingParams(output_kind=kind, **params)): (kind, i)
           for kind in KINDS for i, p in enumerate(prompts)}
    outputs = defaultdict(list)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[ids[out.request_id]].append(out)
    return outputs


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # n-gram drafts make steps that emit several tokens at once.
    return LLM(str(tiny_llama[0]), max_model_len=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})


def test_kinds_carry_the_same_tokens_text_and_logprobs(llm, tiny_llama):
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11]]
    n = 14
    outputs = run_kinds(llm, prompts, temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
    for i, prompt in enumerate(prompts):
        ref = hf_greedy(tiny_llama[1], prompt, n)
        cumulative, delta, final = (outputs[kind, i] for kind in KINDS)
        # A random model's bytes need not end in a whole character: such a tail is held back, so the text
        # is compared with the cumulative output's (test_detokenizer.py checks that against decoding).
        ref_text = cumulative[-1].outputs[0].text
        assert len(final) == 1 and final[0].finished and not any(o.finished for o in delta[:-1])
        assert len(delta) == len(cumulative) > 1
        for outs in (cumulative, final):
            c = outs[-1].outputs[0]
            assert c.token_ids == ref and c.text == ref_text and len(c.logprobs) == n
        whole = cumulative[-1].outputs[0]
        # Delta outputs add up to the whole; each carries only its step's part.
        assert sum((o.outputs[0].token_ids for o in delta), []) == ref
        assert "".join(o.outputs[0].text for o in delta) == ref_text
        assert same_logprobs(sum((o.outputs[0].logprobs for o in delta), []), whole.logprobs)
        assert [t for d in whole.logprobs for t in list(d)[:1]] == ref
        for o, c in zip(delta, cumulative):
            assert o.outputs[0].cumulative_logprob == pytest.approx(c.outputs[0].cumulative_logprob)
            assert o.metrics.num_output_tokens == len(c.outputs[0].token_ids)
        assert final[0].outputs[0].cumulative_logprob == pytest.approx(whole.cumulative_logprob)


def test_a_stop_string_ends_every_kind_at_the_same_text(llm):
    prompt, stop = [100, 101], " ()"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    assert free.find(stop) > 0, f"the tiny model's text {free!r} must contain {stop!r} past its start"
    outputs = run_kinds(llm, [prompt], temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    texts = {kind: "".join(o.outputs[0].text for o in outputs[kind, 0]) if kind == "delta"
             else outputs[kind, 0][-1].outputs[0].text for kind in KINDS}
    assert texts == dict.fromkeys(KINDS, free[:free.find(stop)])
    for kind in KINDS:
        last = outputs[kind, 0][-1].outputs[0]
        assert last.finish_reason == "stop" and last.stop_reason == stop


def test_llm_generate_builds_only_final_outputs(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert out.finished and len(out.outputs[0].token_ids) == 6
    assert params.output_kind is RequestOutputKind.CUMULATIVE  # the caller's params are left as given


def test_bad_output_kind_names_the_choices():
    with pytest.raises(InvalidRequestError, match="output_kind: must be a RequestOutputKind or one of"):
        SamplingParams(output_kind="stream")


def test_token_totals_count_what_an_aborted_final_only_request_generated(llm):
    # A FINAL_ONLY request that is aborted never gives an output: the engine's totals (what the server's
    # metrics report) still count its tokens.
    engine = llm.engine
    prompt_tokens, generated = engine.core.num_prompt_tokens, engine.core.num_generated_tokens
    params = dict(output_kind="final_only", temperature=0, ignore_eos=True)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, **params))
    left = engine.add_request([9, 10, 11, 12], SamplingParams(max_tokens=60, **params))
    outputs = []
    while engine.scheduler.requests[left].num_output_tokens < 8:
        outputs += engine.step()
    left_tokens = engine.scheduler.requests[left].num_output_tokens
    assert engine.abort_request(left)
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6]
    assert engine.core.num_prompt_tokens - prompt_tokens == 7
    assert engine.core.num_generated_tokens - generated == 6 + left_tokens
