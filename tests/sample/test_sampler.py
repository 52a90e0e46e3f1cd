"""Sampler tests against independent float64 references and chi-square goodness-of-fit checks."""
from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest
import torch
from scipy import stats

from specserve.engine.request import Request
from specserve.sample.sampler import (
    Sampler,
    SamplingBatch,
    apply_min_tokens,
    apply_penalties,
    filtered_probs,
)
from specserve.sampling_params import SamplingParams

CPU = torch.device("cpu")

# Hand-made logits on a vocab of 8: distinct values, no ties, mass spread enough that
# every filter below has an effect.
LOGITS8 = [2.0, 1.5, 1.2, 0.3, -0.1, -0.8, -1.7, -3.0]


def make_request(params: SamplingParams, prompt=(1, 2, 3), eos=(), rid="r", output=()) -> Request:
    r = Request(rid, list(prompt), params, set(eos), max_model_len=10_000)
    for t in output:
        r.output_token_ids.append(t)
        r.all_token_ids.append(t)
    return r


def seeded_sampler(seed: int = 0) -> Sampler:
    return Sampler(torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------
# Independent float64 references
# ---------------------------------------------------------------------------------------

def softmax64(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def ref_filtered(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, margin=1e-4) -> np.ndarray:
    """temperature -> top-k -> top-p -> min-p, renormalized, in float64.

    Asserts that no top-p / min-p decision lies within `margin` of its threshold, so float32
    rounding in the sampler cannot legitimately flip it.
    """
    p = softmax64(np.asarray(logits, dtype=np.float64) / temperature)
    order = np.argsort(-p, kind="stable")
    if top_k > 0:
        keep = np.zeros_like(p, dtype=bool)
        keep[order[:top_k]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if top_p < 1.0:
        sp = p[order]
        cum = np.cumsum(sp)
        assert np.all(np.abs(cum[sp > 0] - top_p) > margin), "top_p too close to a cumulative mass"
        # smallest prefix whose mass reaches top_p (the top token is always kept)
        n_keep = int(np.searchsorted(cum, top_p, side="left")) + 1
        n_keep = max(1, min(n_keep, len(p)))
        keep = np.zeros_like(p, dtype=bool)
        keep[order[:n_keep]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if min_p > 0.0:
        thr = min_p * p.max()
        assert np.all(np.abs(p[p > 0] - thr) > margin), "min_p threshold too close to a probability"
        p = np.where(p < thr, 0.0, p)
        p /= p.sum()
    return p


def ref_penalties(logits: np.ndarray, requests: list[Request]) -> np.ndarray:
    """Repetition (prompt + output, HF/vLLM style), then frequency/presence (output only, OpenAI)."""
    out = np.array(logits, dtype=np.float64, copy=True)
    for i, r in enumerate(requests):
        p = r.params
        if p.repetition_penalty != 1.0:
            for t in set(r.prompt_token_ids) | set(r.output_token_ids):
                v = out[i, t]
                out[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(r.output_token_ids):
            c = r.output_token_ids.count(t)
            out[i, t] -= p.frequency_penalty * c + p.presence_penalty * (1.0 if c > 0 else 0.0)
    return out


# ---------------------------------------------------------------------------------------
# Goodness of fit helpers
# ---------------------------------------------------------------------------------------

def gof(counts: np.ndarray, expected: np.ndarray) -> tuple[int, float]:
    """(number of samples outside the support of `expected`, chi-square p-value on the support)."""
    counts = np.asarray(counts, dtype=np.float64)
    support = expected > 0
    outside = int(counts[~support].sum())
    obs = counts[support]
    if support.sum() == 1:
        return outside, 1.0
    exp = expected[support] / expected[support].sum() * obs.sum()
    return outside, float(stats.chisquare(obs, exp).pvalue)


def matches(counts, expected, alpha=1e-3) -> bool:
    outside, p = gof(counts, expected)
    return outside == 0 and p > alpha


def sample_counts(params: SamplingParams, logits_row, n=100_000, seed=0, vocab=None) -> np.ndarray:
    """Sample n rows with identical params in one sampler call; token histogram."""
    req = make_request(params)
    logits = torch.tensor(logits_row, dtype=torch.float32).expand(n, -1).contiguous()
    b = SamplingBatch.build([req] * n, CPU)
    toks = seeded_sampler(seed)(logits, b).token_ids
    return np.bincount(toks.numpy(), minlength=vocab or len(logits_row))


# ---------------------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------------------

def test_greedy_rows_are_argmax_in_mixed_batch():
    g = torch.Generator().manual_seed(1)
    n, v = 64, 50
    logits = torch.randn(n, v, generator=g) * 3
    settings = [
        dict(),
        dict(top_k=3),
        dict(top_p=0.2),
        dict(min_p=0.9),
        dict(top_k=2, top_p=0.1, min_p=0.5),
        dict(seed=5, top_k=1),
    ]
    reqs = []
    for i in range(n):
        s = settings[i % len(settings)]
        # Every other row greedy; the rest sample at high temperature so they differ from argmax.
        temp = 0.0 if i % 2 == 0 else 3.0
        reqs.append(make_request(SamplingParams(temperature=temp, **s), rid=str(i)))
    out = seeded_sampler(3)(logits, SamplingBatch.build(reqs, CPU))
    greedy_rows = torch.arange(n) % 2 == 0
    ref = torch.from_numpy(np.asarray(logits, dtype=np.float64).argmax(axis=1))
    assert torch.equal(out.token_ids[greedy_rows], ref[greedy_rows])
    # sanity: the sampled rows are really sampled (not all argmax)
    assert not torch.equal(out.token_ids[~greedy_rows], ref[~greedy_rows])


def test_all_greedy_batch_ignores_filters_and_is_deterministic():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 30, generator=g)
    reqs = [make_request(SamplingParams(temperature=0.0, top_k=5, top_p=0.3, min_p=0.7, seed=i), rid=str(i))
            for i in range(16)]
    b = SamplingBatch.build(reqs, CPU)
    assert b.all_greedy
    for seed in (0, 1):
        out = seeded_sampler(seed)(logits, b)
        assert torch.equal(out.token_ids, logits.argmax(dim=-1))


# ---------------------------------------------------------------------------------------
# Filtered distributions: chi-square against float64 references
# ---------------------------------------------------------------------------------------

FILTER_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.6, top_k=3),
    dict(temperature=0.8, top_k=1),
    dict(temperature=1.3, top_p=0.7),
    dict(temperature=0.6, top_p=0.9),
    dict(temperature=2.0, top_p=0.05),  # only the top token
    dict(temperature=1.4, min_p=0.2),
    dict(temperature=0.5, min_p=0.05),
    dict(temperature=1.7, top_k=5, top_p=0.8),
    dict(temperature=1.5, top_k=6, min_p=0.3),
    dict(temperature=2.5, top_p=0.85, min_p=0.25),
    dict(temperature=1.9, top_k=6, top_p=0.9, min_p=0.15),
]


@pytest.mark.parametrize("idx", range(len(FILTER_CASES)),
                         ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in FILTER_CASES])
def test_sampled_frequencies_match_filtered_distribution(idx):
    case = FILTER_CASES[idx]
    expected = ref_filtered(LOGITS8, **case)
    counts = sample_counts(SamplingParams(**case), LOGITS8, seed=1000 + idx)
    outside, p = gof(counts, expected)
    assert outside == 0, f"tokens outside the support sampled: {counts} vs {expected}"
    assert p > 1e-3, f"chi-square p={p}: counts {counts} expected {expected * counts.sum()}"
    # filtered_probs itself agrees with the reference
    b = SamplingBatch.build([make_request(SamplingParams(**case))], CPU)
    probs = filtered_probs(torch.tensor([LOGITS8]), b)[0].double().numpy()
    np.testing.assert_allclose(probs, expected, atol=1e-6)
    assert np.array_equal(probs > 0, expected > 0)


def test_filters_per_row_in_one_mixed_batch():
    """Different params on different rows of one call: each block matches its own reference."""
    cases = [
        dict(temperature=1.2),  # top_p == 1 next to rows that use top-p
        dict(temperature=0.9, top_p=0.6),
        dict(temperature=1.5, top_k=4, min_p=0.1),
        dict(temperature=0.0, top_k=3),  # greedy
    ]
    n = 40_000
    reqs = []
    for j, c in enumerate(cases):
        req = make_request(SamplingParams(**c), rid=str(j))
        reqs += [req] * n
    logits = torch.tensor(LOGITS8).expand(len(reqs), -1).contiguous()
    toks = seeded_sampler(11)(logits, SamplingBatch.build(reqs, CPU)).token_ids.numpy()
    for j, c in enumerate(cases):
        counts = np.bincount(toks[j * n:(j + 1) * n], minlength=8)
        if c["temperature"] == 0.0:
            assert counts[int(np.argmax(LOGITS8))] == n
            continue
        expected = ref_filtered(LOGITS8, **c)
        assert matches(counts, expected), (c, counts, expected * n)


def test_goodness_of_fit_check_is_sensitive():
    case = dict(temperature=1.7, top_k=5, top_p=0.8)
    expected = ref_filtered(LOGITS8, **case)
    # Unfiltered softmax at the same temperature: tokens outside the support appear.
    unfiltered = sample_counts(SamplingParams(temperature=1.7), LOGITS8, seed=5)
    outside, _ = gof(unfiltered, expected)
    assert outside > 0
    assert not matches(unfiltered, expected)
    # Same support, wrong temperature: the chi-square alone must reject strongly.
    exp2 = ref_filtered(LOGITS8, temperature=0.7, top_k=4)
    wrong_t = sample_counts(SamplingParams(temperature=1.0, top_k=4), LOGITS8, seed=6)
    outside, p = gof(wrong_t, exp2)
    assert outside == 0 and p < 1e-6
    # A slightly wrong min_p (an extra low-probability token kept) is rejected too.
    exp3 = ref_filtered(LOGITS8, temperature=1.3, min_p=0.1)
    wrong_min_p = sample_counts(SamplingParams(temperature=1.3, min_p=0.02), LOGITS8, seed=7)
    assert not matches(wrong_min_p, exp3)


def test_top_p_one_rows_unaffected_by_other_rows_top_p():
    """A row with top_p == 1 keeps its whole distribution even when the batch uses top-p."""
    row = [20.0] + [0.0] * 7  # tail probabilities ~2e-9: float32 cumsum saturates at 1.0
    reqs = [make_request(SamplingParams(), rid="a"), make_request(SamplingParams(top_p=0.5), rid="b")]
    b = SamplingBatch.build(reqs, CPU)
    assert b.needs_top_p
    probs = filtered_probs(torch.tensor([row, [0.0] * 8]), b).double().numpy()
    np.testing.assert_allclose(probs[0], softmax64(row), rtol=1e-5, atol=0)
    assert (probs[0] > 0).all()
    # uniform 8 with top_p = 0.5: exactly 4 tokens reach 0.5
    assert (probs[1] > 0).sum() == 4


def test_min_p_keeps_tokens_at_the_threshold():
    """Only tokens strictly below min_p * max are dropped: with min_p = 1 the tied top tokens stay."""
    row = [1.0, 3.0, 3.0, 0.0, 3.0, -1.0]
    b = SamplingBatch.build([make_request(SamplingParams(min_p=1.0, temperature=0.9))], CPU)
    probs = filtered_probs(torch.tensor([row]), b)[0]
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs, torch.tensor([0.0, 1 / 3, 1 / 3, 0.0, 1 / 3, 0.0]))
    counts = sample_counts(SamplingParams(min_p=1.0, temperature=0.9), row, n=30_000, seed=21)
    assert matches(counts, np.array([0, 1, 1, 0, 1, 0]) / 3)


# ---------------------------------------------------------------------------------------
# Per-request seeds
# ---------------------------------------------------------------------------------------

V_SEED = 32
STEPS = 12


def step_logits(rid: str, step: int) -> torch.Tensor:
    """The logits a given request sees at a given step, independent of batching."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{rid}/{step}".encode()))
    return torch.randn(V_SEED, generator=g) * 1.5


def run_batches(layouts, default_seed: int) -> dict[str, list[int]]:
    """layouts[step] is the list of (rid, params) rows; requests persist across steps by rid."""
    sampler = seeded_sampler(default_seed)
    reqs: dict[str, Request] = {}
    for step, layout in enumerate(layouts):
        rows = []
        for rid, params in layout:
            if rid not in reqs:
                reqs[rid] = make_request(params, rid=rid)
            rows.append(reqs[rid])
        logits = torch.stack([step_logits(r.request_id, step) for r in rows])
        toks = sampler(logits, SamplingBatch.build(rows, CPU)).token_ids.tolist()
        for r, t in zip(rows, toks):
            r.append_token(t)  # as the engine does; output feeds the penalties next step
    return {rid: r.output_token_ids for rid, r in reqs.items()}


def test_seeded_request_reproducible_across_batch_compositions():
    a = SamplingParams(temperature=1.1, top_k=20, top_p=0.95, frequency_penalty=0.5, seed=1234, max_tokens=100)
    b = SamplingParams(temperature=0.9, seed=7, max_tokens=100)
    u = SamplingParams(temperature=1.0, top_p=0.8, max_tokens=100)
    g = SamplingParams(temperature=0.0, max_tokens=100)

    alone = run_batches([[("A", a)]] * STEPS, default_seed=0)["A"]
    mixed = run_batches([[("U1", u), ("B", b), ("A", a), ("U2", u), ("G", g)]] * STEPS, default_seed=1)["A"]
    # row position changes every step, batch size changes too
    rng = np.random.default_rng(0)
    layouts = []
    for step in range(STEPS):
        rows = [("A", a), ("B2", b), ("U3", u)] + ([("U4", u)] if step % 2 else [])
        rng.shuffle(rows)
        layouts.append(rows)
    shuffled = run_batches(layouts, default_seed=2)["A"]

    assert len(alone) == STEPS
    assert alone == mixed == shuffled
    assert len(set(alone)) > 2  # not degenerate
    # A different seed gives a different sequence (the seed really is used).
    other = run_batches([[("A", dataclasses.replace(a, seed=99))]] * STEPS, default_seed=0)["A"]
    assert other != alone


def test_same_seed_twice_in_one_batch_gives_same_tokens():
    p = SamplingParams(temperature=1.5, seed=42)
    reqs = [make_request(p, rid="x"), make_request(SamplingParams(), rid="u"), make_request(p, rid="y")]
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)).expand(3, -1).contiguous()
    sampler = seeded_sampler(0)
    seq_x, seq_y = [], []
    for _ in range(10):
        t = sampler(logits, SamplingBatch.build(reqs, CPU)).token_ids
        seq_x.append(int(t[0]))
        seq_y.append(int(t[2]))
    assert seq_x == seq_y
    assert len(set(seq_x)) > 1


def test_unseeded_rows_reproducible_from_default_generator():
    p = SamplingParams(temperature=1.0)
    reqs = [make_request(p, rid=str(i)) for i in range(8)]
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(3))
    b = SamplingBatch.build(reqs, CPU)
    t1 = seeded_sampler(5)(logits, b).token_ids
    t2 = seeded_sampler(5)(logits, b).token_ids
    assert torch.equal(t1, t2)


# ---------------------------------------------------------------------------------------
# Penalties
# ---------------------------------------------------------------------------------------

def penalty_requests():
    specs = [
        (dict(), (0, 1), (2, 2)),
        (dict(repetition_penalty=1.3), (0, 1, 5), (2, 5, 5)),
        (dict(repetition_penalty=0.7), (3, 4), ()),
        (dict(frequency_penalty=0.6), (0, 1, 2), (4, 4, 4, 7)),
        (dict(presence_penalty=1.1), (0, 9), (4, 4, 8)),
        (dict(frequency_penalty=-0.4, presence_penalty=0.9), (6,), (3, 3, 11, 11, 11)),
        (dict(repetition_penalty=2.0, frequency_penalty=0.3, presence_penalty=-0.5), (1, 2, 3, 6), (6, 6, 9, 2, 12)),
        (dict(frequency_penalty=1.5, presence_penalty=1.5), (5,), ()),
    ]
    return [make_request(SamplingParams(**p), prompt=pr, output=o, rid=str(i)) for i, (p, pr, o) in enumerate(specs)]


def test_penalties_match_float64_reference():
    reqs = penalty_requests()
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(len(reqs), 16, generator=g) * 2  # positive and negative logits
    before = logits.clone()
    got = apply_penalties(logits, reqs)
    assert torch.equal(logits, before), "input logits modified"
    ref = ref_penalties(logits.double().numpy(), reqs)
    np.testing.assert_allclose(got.double().numpy(), ref, rtol=1e-6, atol=1e-6)
    # The penalties really do something on every penalized row.
    for i, r in enumerate(reqs):
        changed = not np.allclose(ref[i], logits[i].double().numpy())
        assert changed == bool(r.params.uses_penalties and (r.params.repetition_penalty != 1.0 or r.output_token_ids))


def test_repetition_penalty_sign_handling():
    r = make_request(SamplingParams(repetition_penalty=2.0), prompt=(0, 1), output=(2,))
    logits = torch.tensor([[3.0, -3.0, 0.0, 1.0]])
    got = apply_penalties(logits, [r])
    assert got.tolist() == [[1.5, -6.0, 0.0, 1.0]]


def test_greedy_with_penalties_picks_reference_argmax():
    # token 0 is the argmax before penalties; frequency penalty pushes it below token 1
    r = make_request(SamplingParams(temperature=0.0, frequency_penalty=0.5), output=(0, 0, 0))
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    out = seeded_sampler()(logits, SamplingBatch.build([r], CPU))
    ref = ref_penalties(logits.double().numpy(), [r])
    assert int(out.token_ids[0]) == int(ref[0].argmax()) == 1


def test_penalized_sampling_distribution():
    r = make_request(SamplingParams(temperature=0.8, repetition_penalty=1.5, frequency_penalty=0.4,
                                    presence_penalty=0.3), prompt=(0, 6), output=(0, 1, 1, 7))
    n = 10_000  # apply_penalties loops over rows in Python
    logits = torch.tensor(LOGITS8).expand(n, -1).contiguous()
    toks = seeded_sampler(9)(logits, SamplingBatch.build([r] * n, CPU)).token_ids.numpy()
    pen = ref_penalties(np.array([LOGITS8]), [r])[0]
    expected = softmax64(pen / 0.8)
    counts = np.bincount(toks, minlength=8)
    assert matches(counts, expected), (counts, expected * n)
    # and it is not the unpenalized distribution
    assert not matches(counts, softmax64(np.array(LOGITS8) / 0.8))


# ---------------------------------------------------------------------------------------
# min_tokens
# ---------------------------------------------------------------------------------------

def test_min_tokens_blocks_eos_and_stop_tokens_until_reached():
    eos, stops = 2, [5, 7]
    params = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=stops + [1000])  # 1000 >= V: ignored
    r = make_request(params, eos=(eos,))
    # EOS and stop tokens are the most likely ones
    row = [0.0, 0.5, 4.0, 0.1, -0.2, 3.5, 0.3, 3.8, -1.0, 0.2]
    banned = [eos] + stops
    n = 4000
    logits = torch.tensor(row).expand(n, -1).contiguous()
    sampler = seeded_sampler(1)
    for step in range(5):
        b = SamplingBatch.build([r] * n, CPU)
        masked = apply_min_tokens(logits, [r] * n)
        probs = filtered_probs(masked, b)[0]
        toks = sampler(logits, b).token_ids.numpy()
        counts = np.bincount(toks, minlength=len(row))
        greedy = seeded_sampler()(logits[:1], SamplingBatch.build(
            [make_request(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=stops), eos=(eos,),
                          output=r.output_token_ids)], CPU)).token_ids.item()
        if r.num_output_tokens < 3:
            assert (probs[banned] == 0).all()
            assert counts[banned].sum() == 0
            assert greedy not in banned
            expected = softmax64(row)
            expected[banned] = 0
            assert matches(counts, expected / expected.sum())
        else:
            assert (probs[banned] > 0).all()
            assert counts[banned].sum() > 0
            assert greedy == eos
            assert matches(counts, softmax64(row))
        # append a non-banned token as the engine would
        assert not r.append_token(0)


def test_min_tokens_only_affects_its_rows_and_ignore_eos():
    row = torch.tensor([0.0, 5.0, 4.0, 1.0])
    reqs = [
        make_request(SamplingParams(min_tokens=2), eos=(1,), rid="a"),
        make_request(SamplingParams(min_tokens=2), eos=(1,), rid="b", output=(0, 0)),  # reached
        make_request(SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[2]), eos=(1,), rid="c"),
        make_request(SamplingParams(), eos=(1,), rid="d"),
    ]
    logits = row.expand(4, -1).contiguous()
    out = apply_min_tokens(logits, reqs)
    assert torch.isneginf(out[0, 1]) and torch.isfinite(out[0, [0, 2, 3]]).all()
    assert torch.equal(out[1], row) and torch.equal(out[3], row)
    assert torch.isneginf(out[2, 2]) and torch.isfinite(out[2, [0, 1, 3]]).all()
    assert torch.isfinite(logits).all(), "input logits modified"


# ---------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------

def test_logprobs_match_float64_log_softmax_of_raw_logits():
    g = torch.Generator().manual_seed(8)
    n, v = 24, 40
    logits = torch.randn(n, v, generator=g) * 2
    reqs = []
    for i in range(n):
        kw = dict(logprobs=[None, 0, 3, 5][i % 4])
        if i % 3 == 0:
            kw["temperature"] = 0.0
        else:
            kw.update(temperature=2.0, top_k=[0, 10, 25][i % 3])
        if i % 5 == 0:  # penalties and min_tokens change sampling, not the reported (raw) logprobs
            kw.update(repetition_penalty=1.5, frequency_penalty=0.7, min_tokens=2)
        reqs.append(make_request(SamplingParams(**kw), prompt=(0, 1, 2), output=(3, 3), eos=(4,), rid=str(i)))
    out = seeded_sampler(2)(logits, SamplingBatch.build(reqs, CPU))
    ref = torch.log_softmax(logits.double(), dim=-1)
    toks = out.token_ids
    ref_tok = ref.gather(1, toks.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.sampled_logprobs.double(), ref_tok, atol=1e-5, rtol=0)
    ref_rank = (ref > ref_tok.unsqueeze(1)).sum(dim=1) + 1
    assert torch.equal(out.sampled_ranks, ref_rank)
    assert (ref_rank > 1).any()  # some sampled tokens are not the most likely
    top_lp, top_ids = torch.topk(ref, 5, dim=-1)
    assert torch.equal(out.top_ids, top_ids)
    torch.testing.assert_close(out.top_logprobs.double(), top_lp, atol=1e-5, rtol=0)
    # greedy rows without penalties: rank 1
    for i, r in enumerate(reqs):
        if r.params.greedy and not r.params.uses_penalties:
            assert out.sampled_ranks[i] == 1


def test_logprobs_zero_and_none():
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(0))
    reqs = [make_request(SamplingParams(logprobs=0), rid="a"), make_request(SamplingParams(), rid="b"),
            make_request(SamplingParams(temperature=0.0), rid="c")]
    out = seeded_sampler()(logits, SamplingBatch.build(reqs, CPU))
    assert out.top_ids is None and out.top_logprobs is None
    ref = torch.log_softmax(logits.double(), -1).gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.sampled_logprobs.double(), ref, atol=1e-5, rtol=0)
    none = seeded_sampler()(logits[1:], SamplingBatch.build(reqs[1:], CPU))
    assert none.sampled_logprobs is None and none.sampled_ranks is None and none.top_ids is None
