"""benchmarks/sampled_tree_bound.py's acceptance figures against exact enumeration over a small vocabulary."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from sampled_tree_bound import first_draft_acceptance  # noqa: E402


def exact_recursive_acceptance(p: list[float], q: list[float], children: int) -> float:
    """Chance that recursive rejection sampling accepts one of `children` drafts drawn from q without replacement,
    by enumerating every draw in float64: draft x (chance q(x)) is accepted with min(1, p(x) / q(x)); after a
    rejection the next round has p' = (p - q)+ normalised and q without x, normalised."""
    if children == 0:
        return 0.0
    residual = [max(a - b, 0.0) for a, b in zip(p, q)]
    norm = sum(residual)
    residual = [r / norm for r in residual] if norm > 0 else residual
    total = 0.0
    for x, qx in enumerate(q):
        if qx == 0:
            continue
        accept = min(1.0, p[x] / qx)
        rest = [0.0 if i == x else d for i, d in enumerate(q)]
        left = sum(rest)
        later = exact_recursive_acceptance(residual, [d / left for d in rest], children - 1) if left > 0 else 0.0
        total += qx * (accept + (1 - accept) * later)
    return total


def test_figures_match_exact_enumeration():
    p = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10], [0.70, 0.10, 0.10, 0.05, 0.05]], dtype=torch.float32)
    q = torch.tensor([[0.10, 0.16, 0.35, 0.25, 0.14], [0.40, 0.30, 0.12, 0.10, 0.08]], dtype=torch.float32)
    # No ties in q, so its top guesses are one set.
    got = first_draft_acceptance(p, q, children=3, draws=20000, generator=torch.Generator().manual_seed(0))
    for row in range(2):
        pr, qr = p[row].double().tolist(), q[row].double().tolist()
        assert abs(got["chain"][row].item() - sum(min(a, b) for a, b in zip(pr, qr))) < 1e-6
        order = sorted(range(5), key=lambda i: -qr[i])
        for m in (1, 2, 3):
            assert abs(got[f"top{m}"][row].item() - sum(pr[i] for i in order[:m])) < 1e-6
        for m in (2, 3):
            want = exact_recursive_acceptance(pr, qr, m)
            # Monte Carlo over 20,000 draws: 4 standard deviations of a share near 0.8 is about 0.012.
            assert abs(got[f"rrs{m}"][row].item() - want) < 0.012, (row, m, want)
        # One sampled draft is the chain; more children accept more, and beat the same number of top guesses here.
        assert abs(exact_recursive_acceptance(pr, qr, 1) - got["chain"][row].item()) < 1e-6
        assert exact_recursive_acceptance(pr, qr, 2) > got["chain"][row].item()
    assert got["rrs3"][0] > got["top3"][0]
