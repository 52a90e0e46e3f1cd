"""The sampler against float64 references and statistical tests on a small vocabulary."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve.engine.request import Request
from specserve.sample.sampler import Sampler, SamplingBatch
from specserve.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.5, -2.0])
N = 60_000


def req(params: SamplingParams, rid: str = "r", prompt=(1, 2, 3), eos=()) -> Request:
    return Request(rid, list(prompt), params, set(eos), 10_000)


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> np.ndarray:
    """temperature -> top-k -> top-p -> min-p, in float64, written independently of the sampler."""
    x = logits.double().numpy() / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.ones_like(probs, dtype=bool)
    if p.top_k:
        keep[order[p.top_k:]] = False
    if p.top_p < 1.0:
        masked = np.where(keep, probs, 0.0)
        masked /= masked.sum()
        mass = 0.0
        for idx in order:
            if not keep[idx]:
                continue
            if mass >= p.top_p:
                keep[idx] = False
            mass += masked[idx]
    probs = np.where(keep, probs, 0.0)
    probs /= probs.sum()
    if p.min_p:
        probs = np.where(probs < p.min_p * probs.max(), 0.0, probs)
        probs /= probs.sum()
    return probs


def sample_many(params: SamplingParams, n: int = N, seed: int = 0) -> np.ndarray:
    reqs = [req(params, str(i)) for i in range(n)]
    g = torch.Generator().manual_seed(seed)
    out = Sampler(g)(LOGITS.repeat(n, 1), SamplingBatch.build(reqs, torch.device("cpu")))
    return np.bincount(out.token_ids.numpy(), minlength=len(LOGITS))


def assert_matches(counts: np.ndarray, probs: np.ndarray) -> None:
    support = probs > 0
    assert counts[~support].sum() == 0, "a filtered-out token was sampled"
    p = chisquare(counts[support], probs[support] * counts.sum()).pvalue
    assert p > 1e-3, f"frequencies {counts} do not fit {probs.round(4)} (p = {p:.2e})"


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=5, top_p=0.9, min_p=0.1),
], ids=["plain", "top_k", "top_p", "min_p", "combined"])
def test_frequencies_match_the_filtered_distribution(params):
    assert_matches(sample_many(params), reference_probs(LOGITS, params))


def test_the_check_would_catch_a_missing_filter():
    params = SamplingParams(temperature=1.3, top_p=0.8)
    unfiltered = sample_many(SamplingParams(temperature=1.3))
    with pytest.raises(AssertionError):
        assert_matches(unfiltered, reference_probs(LOGITS, params))


def test_greedy_is_argmax_whatever_the_filters():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    reqs = [req(SamplingParams(temperature=0, top_k=3, top_p=0.5, min_p=0.3), str(i)) for i in range(16)]
    out = Sampler()(logits, SamplingBatch.build(reqs, torch.device("cpu")))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def run_steps(reqs: list[Request], target: int, steps: int, vocab: int = 40) -> list[int]:
    """Sample `steps` tokens for every request (appending as the engine does); return reqs[target]'s."""
    g = torch.Generator().manual_seed(99)
    sampler = Sampler(torch.Generator().manual_seed(len(reqs)))
    for s in range(steps):
        logits = torch.randn(vocab, generator=g).repeat(len(reqs), 1)
        out = sampler(logits, SamplingBatch.build(reqs, torch.device("cpu")))
        for r, t in zip(reqs, out.token_ids.tolist()):
            r.append_token(t)
    return reqs[target].output_token_ids


def test_seeded_request_reproducible_across_batch_compositions():
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=100)
    alone = run_steps([req(params)], 0, 20)
    others = [req(SamplingParams(temperature=0.8), "a"), req(SamplingParams(temperature=1.0, seed=7), "b"),
              req(SamplingParams(temperature=0), "c")]
    in_batch = run_steps(others[:2] + [req(params)] + others[2:], 2, 20)
    first_row = run_steps([req(params)] + [req(SamplingParams(temperature=1.2), "d")], 0, 20)
    assert alone == in_batch == first_row
    assert alone != run_steps([req(SamplingParams(temperature=1.0, seed=43, max_tokens=100))], 0, 20)


def reference_penalized(logits, prompt, output, p: SamplingParams) -> np.ndarray:
    x = logits.double().numpy().copy()
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    counts = np.bincount(output, minlength=len(x))
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def test_penalties_match_float64_reference():
    from specserve.sample.sampler import apply_penalties

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 30, generator=g)
    cases = [SamplingParams(repetition_penalty=1.3), SamplingParams(frequency_penalty=0.5, presence_penalty=0.3),
             SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=1.1)]
    reqs = []
    for i, p in enumerate(cases):
        r = req(p, str(i), prompt=(1, 2, 5))
        for t in (5, 7, 7, 9, 7):
            r.append_token(t)
        reqs.append(r)
    got = apply_penalties(logits, reqs)
    for i, r in enumerate(reqs):
        want = reference_penalized(logits[i], r.prompt_token_ids, r.output_token_ids, r.params)
        np.testing.assert_allclose(got[i].double().numpy(), want, rtol=1e-6, atol=1e-6)


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, 10)
    logits[0, 2] = 50.0  # EOS would always win
    logits[0, 4] = 40.0  # then the stop token
    r = req(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4], max_tokens=10), eos=(2,))
    sampler = Sampler()
    picks = []
    for _ in range(3):
        t = sampler(logits, SamplingBatch.build([r], torch.device("cpu"))).token_ids.item()
        picks.append(t)
        r.append_token(t)
    assert picks[:2] not in ([2], [4]) and 2 not in picks[:2] and 4 not in picks[:2]
    assert picks[2] == 2


def test_logprobs_match_float64_log_softmax():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 30, generator=g)
    reqs = [req(SamplingParams(temperature=1.0, logprobs=5), str(i)) for i in range(4)]
    out = Sampler(torch.Generator().manual_seed(0))(logits, SamplingBatch.build(reqs, torch.device("cpu")))
    ref = torch.log_softmax(logits.double(), dim=-1)
    tokens = out.token_ids
    np.testing.assert_allclose(out.sampled_logprobs.double(), ref.gather(1, tokens[:, None]).squeeze(1), atol=1e-6)
    ranks = (ref > ref.gather(1, tokens[:, None])).sum(dim=1) + 1
    assert torch.equal(out.sampled_ranks, ranks)
    top_lp, top_ids = ref.topk(5, dim=-1)
    assert torch.equal(out.top_ids, top_ids)
    np.testing.assert_allclose(out.top_logprobs.double(), top_lp, atol=1e-6)
