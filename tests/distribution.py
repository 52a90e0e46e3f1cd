"""Chi-square tests of sampled tokens against the distribution transformers' logits give: the first two tokens of
many sequences under top-k, a joint distribution small enough to test whole, whose second token comes from
verification when a request speculates."""
from __future__ import annotations

import copy
from collections import Counter

import torch
from scipy.stats import chisquare

# p below this would be a one-in-ten-thousand event (unseeded requests draw from the engine's seeded generator,
# so each test is deterministic).
P_MIN = 1e-4


def reference_first_two(hf, prompt_ids: list[int], temperature: float, top_k: int,
                        bias: dict[int, float] | None = None) -> dict[tuple[int, int], float]:
    """P(first, second token) from transformers' logits in float64, with the bias added, top-k, temperature."""
    model = copy.deepcopy(hf).double()

    def distribution(ids: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        for token, value in (bias or {}).items():
            logits[token] += value
        top = logits.topk(top_k)
        return dict(zip(top.indices.tolist(), (top.values / temperature).softmax(-1).tolist()))

    first = distribution(prompt_ids)
    return {(a, b): pa * pb for a, pa in first.items() for b, pb in distribution(prompt_ids + [a]).items()}


def p_value(counts: Counter, probs: dict) -> float:
    """Chi-square goodness of fit; outcomes expected fewer than 5 times are pooled into one cell. 0 when an
    outcome has probability 0 in the reference."""
    if set(counts) - set(probs):
        return 0.0
    total = sum(counts.values())
    observed, expected, rest_observed, rest_expected = [], [], 0, 0.0
    for outcome, p in probs.items():
        if p * total >= 5:
            observed.append(counts[outcome])
            expected.append(p * total)
        else:
            rest_observed += counts[outcome]
            rest_expected += p * total
    if rest_expected > 0:
        observed.append(rest_observed)
        expected.append(rest_expected)
    return chisquare(observed, expected).pvalue


def sample_first_two(llm, prompt: str, params, requests: int) -> Counter:
    """(first, second) token of every sequence of `requests` requests of prompt (params.max_tokens == 2)."""
    outs = llm.generate([prompt] * requests, params, use_tqdm=False)
    return Counter(tuple(c.token_ids) for o in outs for c in o.outputs)


def first_two_tokens_test(llm, hf, prompt: str, params, requests: int, wrong: dict | None = None) -> None:
    """Assert the sampled first two tokens fit transformers' distribution, and that they do not fit `wrong` (a
    reference computed with one of the parameters changed: the test can tell the difference)."""
    counts = sample_first_two(llm, prompt, params, requests)
    assert sum(counts.values()) == requests * params.n
    ids = llm.engine.tokenize(prompt)
    reference = reference_first_two(hf, ids, params.temperature, params.top_k, params.logit_bias)
    assert p_value(counts, reference) > P_MIN, (counts, reference)
    if wrong is not None:
        changed = {"temperature": params.temperature, "top_k": params.top_k, "bias": params.logit_bias, **wrong}
        assert p_value(counts, reference_first_two(hf, ids, **changed)) < P_MIN, counts


def drafted_tokens(hf, prompt_ids: list[int], temperature: float, top_k: int,
                   bias: dict[int, float] | None = None) -> list[int]:
    """Every token of the reference's support: the draft vocabulary of an EAGLE-3 head whose drafts the target
    accepts (heads.save_eagle_head's draft_token_ids)."""
    return sorted({t for pair in reference_first_two(hf, prompt_ids, temperature, top_k, bias) for t in pair})
