"""logit_bias (SamplingParams.logit_bias): each request's {token id: bias} added to its rows of a logits tensor.

Applied to the logits every sampling and verification path computes (worker/sample_and_verify.py), after a
grammar's mask and before penalties, temperature, top-k, top-p and min-p, so that greedy tokens, sampled
tokens, and the target probabilities rejection sampling and the tree walk verify drafts against are all the
biased ones. Rows with a bias therefore never take a path that skips the logits (worker/step_path.py).
"""
from __future__ import annotations

import torch

from specserve.engine.request import Request
from specserve.transfer import to_device


def apply_logit_bias(logits: torch.Tensor, requests: list[Request], rows_per_request: int = 1) -> None:
    """Add each request's bias to its rows of logits, in place. logits: [len(requests) * rows_per_request, V],
    request i owning the rows_per_request rows from i * rows_per_request (the positions it verifies)."""
    rows: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, req in enumerate(requests):
        bias = req.params.logit_bias
        if not bias:
            continue
        for row in range(i * rows_per_request, (i + 1) * rows_per_request):
            rows.extend([row] * len(bias))
            token_ids.extend(bias)
            values.extend(bias.values())
    if not rows:
        return
    where = to_device([rows, token_ids], logits.device)
    logits.index_put_((where[0], where[1]), to_device(values, logits.device, logits.dtype), accumulate=True)
