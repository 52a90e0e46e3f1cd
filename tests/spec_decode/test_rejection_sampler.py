"""Rejection sampler: exact greedy cases, batch mixing, seeds, and a statistical proof of losslessness."""
import pytest
import torch
from scipy.stats import chisquare

from specserve.spec_decode.rejection_sampler import draw_randomness, rejection_sample


def _sample_inputs(num_reqs, k, vocab, seed, num_draft_tokens=None, greedy=None):
    """Random but valid inputs for every argument of rejection_sample."""
    g = torch.Generator().manual_seed(seed)
    target = torch.rand(num_reqs, k + 1, vocab, generator=g)
    draft = torch.rand(num_reqs, k, vocab, generator=g)
    return dict(
        draft_token_ids=torch.randint(0, vocab, (num_reqs, k), generator=g),
        num_draft_tokens=(torch.full((num_reqs,), k) if num_draft_tokens is None
                          else torch.tensor(num_draft_tokens)),
        draft_probs=draft / draft.sum(-1, keepdim=True),
        target_probs=target / target.sum(-1, keepdim=True),
        greedy=torch.zeros(num_reqs, dtype=torch.bool) if greedy is None else torch.tensor(greedy),
        target_argmax=target.argmax(-1),
    )


def _randomness(num_reqs, k, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    uniform, noise = draw_randomness(num_reqs, k, vocab, [None] * num_reqs, "cpu", default_generator=g)
    return dict(uniform_samples=uniform, exp_noise=noise)


def _rows(inputs, rows):
    return {name: None if t is None else t[rows] for name, t in inputs.items()}


# ---------------------------------------------------------------- greedy, exact


def test_greedy_handcrafted_cases():
    k, vocab = 3, 6
    drafts = torch.tensor([[1, 2, 3], [1, 5, 3], [-1, -1, -1], [4, 4, -1], [2, 2, 2]])
    num_drafts = torch.tensor([3, 3, 0, 2, 3])
    argmax = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 0, 0, 0], [4, 4, 0, 5], [3, 2, 2, 2]])
    n = len(drafts)
    out, num_accepted = rejection_sample(
        drafts, num_drafts, None, torch.full((n, k + 1, vocab), 1 / vocab),
        torch.ones(n, dtype=torch.bool), argmax, **_randomness(n, k, vocab, seed=0))
    assert out.tolist() == [
        [1, 2, 3, 4],     # all accepted, bonus = argmax at position k
        [1, 2, -1, -1],   # mismatch at 1: emit the target's token there
        [5, -1, -1, -1],  # no drafts: just the target's next token
        [4, 4, 0, -1],    # 2 of 2 accepted: bonus from position num_draft_tokens, not k
        [3, -1, -1, -1],  # first draft wrong
    ]
    assert num_accepted.tolist() == [3, 1, 0, 2, 0]


def test_zero_draft_slots():
    inputs = _sample_inputs(4, 0, 7, seed=1, greedy=[True, False, True, False])
    out, num_accepted = rejection_sample(**inputs, **_randomness(4, 0, 7, seed=1))
    assert out.shape == (4, 1) and num_accepted.tolist() == [0] * 4
    assert out[[0, 2], 0].tolist() == inputs["target_argmax"][[0, 2], 0].tolist()


def _reference_row(drafts, num_drafts, q, p, greedy, argmax, u, noise, forced_accept_prob):
    """The algorithm for one request, written as a plain loop (q None means one-hot)."""
    for j in range(num_drafts):
        x = drafts[j]
        q_j = torch.nn.functional.one_hot(torch.tensor(x), len(p[j])).float() if q is None else q[j]
        if forced_accept_prob is not None:
            accepted = u[j] < forced_accept_prob
        elif greedy:
            accepted = x == argmax[j]
        else:
            accepted = u[j] < min(1.0, p[j, x] / q_j[x])
        if not accepted:
            residual = (p[j] - q_j).clamp_min(0)
            if residual.sum() == 0:
                residual = p[j]
            token = argmax[j] if greedy else (residual / noise).argmax()
            return drafts[:j] + [int(token)]
    bonus = argmax[num_drafts] if greedy else (p[num_drafts] / noise).argmax()
    return drafts[:num_drafts] + [int(bonus)]


@pytest.mark.parametrize("with_q,forced_accept_prob", [(True, None), (False, None), (True, 0.5)],
                         ids=["q", "no-q", "forced"])
def test_matches_row_by_row_reference(with_q, forced_accept_prob):
    """Mixed greedy and sampled rows with 0..k drafts each, against `_reference_row`."""
    k, vocab, n = 4, 4, 300  # a small vocabulary makes acceptances common
    g = torch.Generator().manual_seed(2)
    inputs = _sample_inputs(n, k, vocab, seed=2, num_draft_tokens=torch.randint(0, k + 1, (n,), generator=g).tolist(),
                            greedy=(torch.rand(n, generator=g) < 0.3).tolist())
    if not with_q:
        inputs["draft_probs"] = None
    randomness = _randomness(n, k, vocab, seed=2)
    out, num_accepted = rejection_sample(**inputs, **randomness, forced_accept_prob=forced_accept_prob)

    for i in range(n):
        row = {name: None if t is None else t[i] for name, t in {**inputs, **randomness}.items()}
        expected = _reference_row(row["draft_token_ids"].tolist(), int(row["num_draft_tokens"]), row["draft_probs"],
                                  row["target_probs"], bool(row["greedy"]), row["target_argmax"].tolist(),
                                  row["uniform_samples"], row["exp_noise"], forced_accept_prob)
        assert out[i].tolist() == expected + [-1] * (k + 1 - len(expected)), i
        assert num_accepted[i] == len(expected) - 1
    assert 0 < num_accepted.sum() < inputs["num_draft_tokens"].sum()  # both outcomes exercised


def test_rows_do_not_influence_each_other():
    k, vocab, n = 4, 11, 8
    inputs = _sample_inputs(n, k, vocab, seed=3, num_draft_tokens=[4, 0, 2, 3, 1, 4, 0, 2],
                            greedy=[True, False, False, True, True, False, True, False])
    randomness = _randomness(n, k, vocab, seed=3)
    out, num_accepted = rejection_sample(**inputs, **randomness)
    for i in range(n):
        alone_out, alone_accepted = rejection_sample(**_rows(inputs, [i]), **_rows(randomness, [i]))
        assert torch.equal(out[i], alone_out[0]) and num_accepted[i] == alone_accepted[0]


def test_seeded_request_is_reproducible_whatever_the_batch():
    k, vocab = 3, 9
    request = _sample_inputs(1, k, vocab, seed=4)
    others = _sample_inputs(3, k, vocab, seed=5, num_draft_tokens=[1, 3, 0], greedy=[False, True, False])

    def run_request(other_rows, position, other_generators, seed=1234):
        """Run `request` (seeded) at `position` among the given other requests."""
        batch = {name: torch.cat([others[name][other_rows][:position], request[name],
                                  others[name][other_rows][position:]]) for name in request}
        generators = list(other_generators)
        generators.insert(position, torch.Generator().manual_seed(seed))
        uniform, noise = draw_randomness(len(generators), k, vocab, generators, "cpu")
        out, _ = rejection_sample(**batch, uniform_samples=uniform, exp_noise=noise)
        return out[position], uniform[position], noise[position]

    alone = run_request([], 0, [])
    in_batch = run_request([0, 1], 1, [None, torch.Generator().manual_seed(7)])
    elsewhere = run_request([2, 1, 0], 3, [None, None, None])
    for a, b, c in zip(alone, in_batch, elsewhere):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert not torch.equal(alone[2], run_request([], 0, [], seed=99)[2])  # the seed does matter


def test_residual_all_zero_falls_back_to_target():
    """p == q leaves max(0, p - q) empty; a (forced) rejection must still sample from p."""
    k, vocab, n = 2, 5, 3
    p = torch.zeros(n, k + 1, vocab)
    p[..., 3] = 1.0
    out, num_accepted = rejection_sample(
        torch.full((n, k), 3), torch.full((n,), k), p[:, :k].clone(), p, torch.zeros(n, dtype=torch.bool),
        p.argmax(-1), **_randomness(n, k, vocab, seed=5), forced_accept_prob=0.0)
    assert num_accepted.tolist() == [0] * n
    assert out[:, 0].tolist() == [3] * n


def test_rejects_16_bit_probabilities_and_bad_shapes():
    inputs = _sample_inputs(2, 2, 5, seed=6)
    randomness = _randomness(2, 2, 5, seed=6)
    with pytest.raises(TypeError, match="float32"):
        rejection_sample(**{**inputs, "draft_probs": inputs["draft_probs"].bfloat16()}, **randomness)
    with pytest.raises(ValueError, match="exp_noise"):
        rejection_sample(**inputs, uniform_samples=randomness["uniform_samples"],
                         exp_noise=randomness["exp_noise"][:, :2])


def test_runs_on_meta_tensors():
    """CPU stand-in for "no host sync": meta tensors have shapes but no data, so
    .item(), .tolist(), .cpu(), `if tensor`, boolean indexing and nonzero all raise."""
    inputs = _sample_inputs(4, 3, 8, seed=7, num_draft_tokens=[3, 0, 1, 2], greedy=[True, False, False, True])
    meta = {name: t.to("meta") for name, t in {**inputs, **_randomness(4, 3, 8, seed=7)}.items()}
    out, num_accepted = rejection_sample(**meta)
    assert out.shape == (4, 4) and num_accepted.shape == (4,)
    rejection_sample(**{**meta, "draft_probs": None}, forced_accept_prob=0.5)


@pytest.mark.gpu
def test_no_host_sync_on_cuda():
    inputs = {name: t.cuda() for name, t in _sample_inputs(64, 4, 1000, seed=8).items()}
    randomness = {name: t.cuda() for name, t in _randomness(64, 4, 1000, seed=8).items()}
    torch.cuda.set_sync_debug_mode("error")
    try:
        rejection_sample(**inputs, **randomness)
        rejection_sample(**{**inputs, "draft_probs": None}, **randomness, forced_accept_prob=0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---------------------------------------------------------------- forced acceptance


def test_forced_acceptance_rate_is_geometric():
    k, vocab, n, rate = 5, 4, 100_000, 0.6
    num_drafts = [5, 3, 0, 5] * (n // 4)
    inputs = _sample_inputs(n, k, vocab, seed=9, num_draft_tokens=num_drafts,
                            greedy=[False, True] * (n // 2))
    _, num_accepted = rejection_sample(**inputs, **_randomness(n, k, vocab, seed=9), forced_accept_prob=rate)
    # Accepting each draft with probability `rate` until the first rejection:
    # E[accepted | d drafts] = rate + rate^2 + ... + rate^d.
    expected = torch.tensor([sum(rate ** j for j in range(1, d + 1)) for d in num_drafts], dtype=torch.float64)
    assert abs(num_accepted.double().mean() - expected.mean()) < 0.02  # the standard error is 0.004
    assert (num_accepted <= inputs["num_draft_tokens"]).all()


# ---------------------------------------------------------------- losslessness

VOCAB, K = 5, 3
NUM_TOKENS = 4              # tokens compared per emulated sequence; each round emits >= 1
NUM_POSITIONS = NUM_TOKENS + K  # a round starts before NUM_TOKENS and reads K + 1 positions
# A 2% error in a token probability of 0.5 adds N * 0.01^2 / 0.5 = 40 to that
# position's chi-square: p < 1e-6 with 4 degrees of freedom.
NUM_SEQUENCES = 200_000

# Position 0 is chosen so that rounding q to bfloat16 matters: q(0) = 0.5021 rounds
# up to 0.5039 > p(0), so token 0 stops being a residual token, and the mass it
# loses goes to token 1, the only other token with p > q. Token 1's small target
# probability (0.01) then grows by ~18%. A good draft (q close to p) is exactly
# the case where this happens in practice.
P0 = [0.5022, 0.0100, 0.1989, 0.1500, 0.1389]
Q0 = [0.5021, 0.0090, 0.2000, 0.1500, 0.1389]


def _position_distributions():
    """Target P[t] and draft Q[t] for absolute positions t; independent of the context."""
    g = torch.Generator().manual_seed(2024)
    p = torch.empty(NUM_POSITIONS, VOCAB).exponential_(generator=g)  # Dirichlet(1) rows
    q = torch.empty(NUM_POSITIONS, VOCAB).exponential_(generator=g)
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    p[0], q[0] = torch.tensor(P0), torch.tensor(Q0)
    return p, q


def _sample_categorical(probs, g):
    u = torch.rand(*probs.shape[:-1], 1, generator=g)
    return (probs.cumsum(-1) < u).sum(-1).clamp(max=probs.shape[-1] - 1)


def _emulate_decoding(sampler_draft_probs, seed):
    """Speculative decoding of NUM_SEQUENCES sequences: rounds of K drafts from Q,
    verified against P, each round resuming after the tokens the last one emitted.
    `sampler_draft_probs` maps the true draft probabilities to what the sampler is given."""
    p, q = _position_distributions()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.full((NUM_SEQUENCES, NUM_POSITIONS), -1)
    next_position = torch.zeros(NUM_SEQUENCES, dtype=torch.long)
    while (unfinished := (next_position < NUM_TOKENS).nonzero().squeeze(1)).numel():
        n = len(unfinished)
        positions = next_position[unfinished, None] + torch.arange(K + 1)
        target_probs, draft_probs = p[positions], q[positions[:, :K]]
        drafts = _sample_categorical(draft_probs, g)
        uniform, noise = draw_randomness(n, K, VOCAB, [None] * n, "cpu", default_generator=g)
        out, num_accepted = rejection_sample(
            drafts, torch.full((n,), K), sampler_draft_probs(draft_probs), target_probs,
            torch.zeros(n, dtype=torch.bool), target_probs.argmax(-1), uniform, noise)
        # -1 entries land on positions no round has written yet, so they do no harm.
        tokens[unfinished] = tokens[unfinished].scatter(1, positions, out)
        next_position[unfinished] += num_accepted + 1
    return tokens[:, :NUM_TOKENS], p


def _p_values(tokens, p):
    """Chi-square p-values of the emitted tokens against the target: the joint of the
    first two tokens against P[0] x P[1] (catches dependence between positions) and
    each token's marginal against P[t] (more sensitive to an error at one position;
    tokens 3 include the bonus tokens of sequences that accepted all K drafts)."""
    def test(observed_codes, probs):
        probs = probs.double().flatten()
        observed = torch.bincount(observed_codes, minlength=len(probs))
        return chisquare(observed.numpy(), (probs / probs.sum() * len(observed_codes)).numpy()).pvalue

    joint = test(tokens[:, 0] * VOCAB + tokens[:, 1], torch.outer(p[0], p[1]))
    return [joint] + [test(tokens[:, t], p[t]) for t in range(NUM_TOKENS)]


@pytest.mark.parametrize("draft_probs_given", [
    pytest.param(lambda q: q, id="float32-q"),
    pytest.param(lambda q: None, id="no-q-like-ngram"),  # one-hot q is lossless for any drafts
])
def test_sampling_is_lossless(draft_probs_given):
    tokens, p = _emulate_decoding(draft_probs_given, seed=11)
    assert (tokens >= 0).all()
    assert min(_p_values(tokens, p)) > 1e-3


@pytest.mark.parametrize("draft_probs_given", [
    pytest.param(lambda q: torch.roll(q, 1, dims=1), id="q-of-wrong-step"),
    pytest.param(lambda q: q.bfloat16().float(), id="q-rounded-to-bf16"),
])
def test_lossless_check_catches_bugs(draft_probs_given):
    """The same check must reject samplers that are subtly wrong, or it proves nothing."""
    tokens, p = _emulate_decoding(draft_probs_given, seed=11)
    assert min(_p_values(tokens, p)) < 1e-6
