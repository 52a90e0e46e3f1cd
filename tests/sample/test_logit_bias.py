"""logit_bias: added to the logits before sampling on every path, speculating or not. +100 forces a token, -100
bans it, greedy output with a bias is transformers' greedy output with the same bias added, and the sampled
distribution with a moderate bias is softmax(logits + bias) (chi-square), with and without EAGLE-3."""
from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from distribution import drafted_tokens, first_two_tokens_test
from heads import save_eagle_head
from specserve import LLM, SamplingParams
from specserve.engine.request import Request
from specserve.errors import InvalidRequestError
from specserve.sample.logit_bias import apply_logit_bias

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


@pytest.fixture(scope="module")
def models(tiny_llama, tmp_path_factory):
    path, hf = tiny_llama
    head = save_eagle_head(tmp_path_factory.mktemp("bias") / "eagle3", hf.config, "eagle3", seed=2)
    return {"path": path, "hf": hf, None: None,
            "eagle3": {"method": "eagle3", "num_speculative_tokens": 3, "model": str(head)},
            "tree": {"method": "eagle3", "model": str(head), "speculative_token_tree": TREE}}


def make_llm(models, spec: str | None, **kw) -> LLM:
    return LLM(str(models["path"]), max_model_len=256, speculative_config=models[spec], **kw)


class AddBias(LogitsProcessor):
    def __init__(self, bias: dict[int, float]):
        self.bias = bias

    def __call__(self, input_ids, scores):
        for token, value in self.bias.items():
            scores[:, token] += value
        return scores


def hf_biased_greedy(hf, ids: list[int], n: int, bias: dict[int, float]) -> list[int]:
    x = torch.tensor([ids])
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, eos_token_id=None,
                      pad_token_id=0, logits_processor=LogitsProcessorList([AddBias(bias)]))
    return out[0, len(ids):].tolist()


def test_bias_lands_on_each_requests_rows():
    params = [SamplingParams(logit_bias={1: 2.0, 4: -3.0}), SamplingParams(), SamplingParams(logit_bias={0: 5.0})]
    requests = [Request(str(i), [1], p, set(), 64) for i, p in enumerate(params)]
    logits = torch.randn(6, 5)
    expected = logits.clone()
    expected[0:2, 1] += 2.0
    expected[0:2, 4] -= 3.0
    expected[4:6, 0] += 5.0
    apply_logit_bias(logits, requests, rows_per_request=2)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("bias, words", [
    ({5: 100.5}, "the bias of token 5 must be a number in [-100, 100], got 100.5"),
    ({5: float("nan")}, "the bias of token 5"),
    ({5: "1"}, "the bias of token 5"),
    ({-1: 1.0}, "key -1 is not a token id"),
    ({"7": 1.0}, "key '7' is not a token id"),
    ([1, 2], "must be a map of token id to bias"),
])
def test_bad_bias_is_refused_by_its_key(bias, words):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logit_bias=bias)
    assert e.value.field == "logit_bias" and words in str(e.value)


def test_a_token_outside_the_vocabulary_is_refused_and_the_engine_serves_on(models):
    llm = make_llm(models, None)
    vocab = llm.engine.core.arch.vocab_size
    with pytest.raises(InvalidRequestError, match=f"key {vocab} is not a token id of this model"):
        llm.generate(PROMPT, SamplingParams(logit_bias={3: 1.0, vocab: 1.0}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


@pytest.mark.parametrize("spec", [None, "eagle3", "tree"])
def test_plus_100_forces_and_minus_100_bans(models, spec):
    llm = make_llm(models, spec)
    ids = llm.engine.tokenize(PROMPT)
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    greedy = llm.generate(PROMPT, free, use_tqdm=False)[0].outputs[0].token_ids
    forced = 7 if 7 not in greedy else 8
    for temperature in (0.0, 1.0):
        out = llm.generate(PROMPT, SamplingParams(n=4, temperature=temperature, max_tokens=10, ignore_eos=True,
                                                  logit_bias={forced: 100}), use_tqdm=False)[0]
        assert all(c.token_ids == [forced] * 10 for c in out.outputs)
    banned = greedy[0]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                              logit_bias={banned: -100}), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_biased_greedy(models["hf"], ids, 10, {banned: -100.0})
    assert banned not in out.outputs[0].token_ids
    # Sampled, the banned token (the most likely one, unbiased) never comes.
    sampled = dict(n=64, temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    free_sampled = llm.generate(PROMPT, SamplingParams(**sampled), use_tqdm=False)[0]
    assert any(banned in c.token_ids for c in free_sampled.outputs)
    out = llm.generate(PROMPT, SamplingParams(**sampled, logit_bias={banned: -100}), use_tqdm=False)[0]
    assert not any(banned in c.token_ids for c in out.outputs)


@pytest.mark.parametrize("spec", [None, "eagle3", "tree"])
def test_greedy_with_a_moderate_bias_is_transformers_biased_greedy(models, spec):
    llm = make_llm(models, spec)
    ids = llm.engine.tokenize(PROMPT)
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    bias = {greedy[0]: -1.5, greedy[1]: 2.5, 9: 1.0}
    expected = hf_biased_greedy(models["hf"], ids, 12, bias)
    assert expected != greedy
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=bias),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected
    if spec is not None:
        assert llm.engine.spec_stats.num_drafted > 0


@pytest.mark.parametrize("speculate", [None, "chain", "tree"])
def test_sampled_distribution_is_softmax_of_biased_logits(models, tmp_path, speculate):
    """The first two tokens of 800 sequences under top-k 3 at temperature 0.5 with a bias that reorders the top
    tokens: transformers' softmax(logits + bias), not softmax(logits). Speculating (a chain or a tree of drafts),
    an EAGLE-3 head that drafts only likely tokens has its drafts both accepted and rejected."""
    hf = models["hf"]
    ids = make_llm(models, None).engine.tokenize(PROMPT)
    with torch.no_grad():
        top = hf(torch.tensor([ids])).logits[0, -1].topk(4).indices.tolist()
    bias = {top[0]: -0.6, top[3]: 0.5}
    params = SamplingParams(n=100, temperature=0.5, top_k=3, max_tokens=2, ignore_eos=True, logit_bias=bias)
    spec = None
    if speculate:
        head = save_eagle_head(tmp_path / "head", hf.config, "eagle3", seed=2,
                               draft_token_ids=drafted_tokens(hf, ids, 0.5, 3, bias))
        spec = ({"method": "eagle3", "num_speculative_tokens": 3, "model": str(head)} if speculate == "chain"
                else {"method": "eagle3", "model": str(head), "speculative_token_tree": TREE})
    llm = LLM(str(models["path"]), max_model_len=256, max_num_seqs=128, speculative_config=spec)
    first_two_tokens_test(llm, hf, PROMPT, params, requests=8, wrong={"bias": None})
    if speculate:
        stats = llm.engine.spec_stats
        assert 0 < stats.num_accepted < stats.num_drafted
