"""Token sampling: penalties, temperature, top-k, top-p, min-p, seeds, logprobs.

Randomness is drawn per request: a seeded request uses only its own
generator, one draw of V exponentials per sampled token, so its output does
not depend on what else is in the batch. Sampling picks
argmax(probs / Exponential(1)), which is an exact draw from probs.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from specserve.engine.request import Request
from specserve.sample.argmax import greedy_argmax
from specserve.transfer import to_device


def draws_with_temperature_only(request: Request) -> bool:
    """A greedy request, or one whose draws need only softmax(logits / T) and the engine's generator: no top-k,
    top-p or min-p, no seed of its own. Such draws can be recorded in a CUDA graph (spec_decode/sampled_tree.py)."""
    p = request.params
    return p.greedy or (request.generator is None and p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0)


class SamplingBatch:
    """The sampling parameters of the rows of a logits tensor.

    The per-row device tensors are made on first use: an all-greedy batch (the common decode step)
    then uploads nothing, and `greedy` is a fill on the device rather than a copy from the host.
    """

    def __init__(self, requests: list[Request], device: torch.device):
        ps = [r.params for r in requests]
        self.requests = requests
        self.device = device
        self._params = ps
        self._greedy = [p.greedy for p in ps]
        asked = [p.logprobs for p in ps if p.logprobs is not None]
        self.generators: list[torch.Generator | None] = [r.generator for r in requests]
        self.all_greedy = all(self._greedy)
        self.needs_top_k = any(p.top_k > 0 and not g for p, g in zip(ps, self._greedy))
        self.needs_top_p = any(p.top_p < 1.0 and not g for p, g in zip(ps, self._greedy))
        self.needs_min_p = any(p.min_p > 0.0 and not g for p, g in zip(ps, self._greedy))
        self.temperature_only = all(draws_with_temperature_only(r) for r in requests)
        # Largest logprobs asked for in the batch, None when none asked.
        self.max_logprobs: int | None = max(asked) if asked else None

    @classmethod
    def build(cls, requests: list[Request], device: torch.device) -> "SamplingBatch":
        return cls(requests, device)

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, self.device, dtype)

    @cached_property
    def greedy(self) -> torch.Tensor:  # [N] bool
        if self.all_greedy:
            return torch.ones(len(self._greedy), dtype=torch.bool, device=self.device)
        return self._tensor(self._greedy, torch.bool)

    @cached_property
    def temperature(self) -> torch.Tensor:  # [N] float32, 1.0 on greedy rows
        return self._tensor([1.0 if g else p.temperature for g, p in zip(self._greedy, self._params)], torch.float32)

    @cached_property
    def top_k(self) -> torch.Tensor:  # [N] int64, 0 = off
        return self._tensor([p.top_k for p in self._params], torch.int64)

    @cached_property
    def top_p(self) -> torch.Tensor:  # [N] float32
        return self._tensor([p.top_p for p in self._params], torch.float32)

    @cached_property
    def min_p(self) -> torch.Tensor:  # [N] float32
        return self._tensor([p.min_p for p in self._params], torch.float32)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    # When logprobs are asked for: the sampled token's logprob [N] and rank [N],
    # and the top max_logprobs ids and logprobs [N, max_logprobs].
    sampled_logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition (prompt and output tokens), frequency and presence (output tokens) penalties, OpenAI style."""
    rows = [i for i, r in enumerate(requests) if r.params.uses_penalties]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        p = requests[i].params
        out = to_device(requests[i].output_token_ids, logits.device)
        if p.repetition_penalty != 1.0:
            seen = to_device(sorted(set(requests[i].all_token_ids)), logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if out.numel():
            counts = torch.bincount(out, minlength=logits.shape[1])[: logits.shape[1]].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Forbid EOS and stop tokens until a request has min_tokens outputs."""
    rows = [(i, r) for i, r in enumerate(requests) if r.num_output_tokens < r.params.min_tokens]
    if not rows:
        return logits
    logits = logits.clone()
    for i, r in rows:
        banned = [t for t in (r.eos_token_ids | r.stop_token_ids) if t < logits.shape[1]]
        logits[i, banned] = float("-inf")
    return logits


def filtered_probs(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """The distribution sampled from: softmax(logits / T) restricted by top-k, then top-p, then min-p."""
    x = logits / b.temperature.unsqueeze(1)
    if b.needs_top_k or b.needs_top_p:
        sorted_x, order = x.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_x, dtype=torch.bool)
        if b.needs_top_k:
            rank = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            drop |= (b.top_k.unsqueeze(1) > 0) & (rank >= b.top_k.unsqueeze(1))
        if b.needs_top_p:
            probs = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p: a token is dropped
            # when the mass before it already does. Rows with top_p == 1 are left
            # alone: a float32 cumsum can round up to 1.0 before the tail and
            # would otherwise drop their small-probability tokens.
            mass_before = probs.cumsum(dim=-1) - probs
            top_p = b.top_p.unsqueeze(1)
            drop |= (mass_before >= top_p) & (top_p < 1.0)
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = x.softmax(dim=-1)
    if b.needs_min_p:
        threshold = b.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def repeated_rows_probs(logits: torch.Tensor, b: SamplingBatch, per_request: int) -> torch.Tensor:
    """filtered_probs of logits whose rows are each request of b, per_request rows in a row (the positions of a
    verification, the nodes of a tree's depth). A batch that draws with its temperatures alone builds no
    batch of the repeated requests: its temperatures are repeated on the device."""
    if b.temperature_only:
        return (logits / b.temperature.repeat_interleave(per_request).unsqueeze(1)).softmax(dim=-1)
    return filtered_probs(logits, SamplingBatch.build([r for r in b.requests for _ in range(per_request)],
                                                      logits.device))


def exponential_noise(
    shape: tuple[int, int], generators: list[torch.Generator | None], default: torch.Generator | None, device
) -> torch.Tensor:
    """Exponential(1) noise, each seeded row from its own generator, the others from `default`."""
    noise = torch.empty(shape, device=device).exponential_(generator=default)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return noise


def sample_from_probs(
    probs: torch.Tensor, generators: list[torch.Generator | None], default: torch.Generator | None = None
) -> torch.Tensor:
    noise = exponential_noise(tuple(probs.shape), generators, default, probs.device)
    return (probs / noise).argmax(dim=-1)


class Sampler:
    def __init__(self, default_generator: torch.Generator | None = None):
        # Unseeded requests share this generator, so a whole run is reproducible from the engine's seed.
        self.default_generator = default_generator

    def __call__(self, logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
        raw_logprobs = logits.log_softmax(dim=-1) if b.max_logprobs is not None else None
        logits = apply_min_tokens(apply_penalties(logits, b.requests), b.requests)
        tokens = greedy_argmax(logits)
        if not b.all_greedy:
            sampled = sample_from_probs(filtered_probs(logits, b), b.generators, self.default_generator)
            tokens = torch.where(b.greedy, tokens, sampled)
        if raw_logprobs is None:
            return SamplerOutput(tokens)
        return token_logprobs(raw_logprobs, tokens, b.max_logprobs)


def token_logprobs(raw_logprobs: torch.Tensor, tokens: torch.Tensor, top_n: int) -> SamplerOutput:
    """Logprob and rank of each chosen token under the raw model distribution, and the top_n alternatives."""
    out = SamplerOutput(tokens)
    out.sampled_logprobs = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    out.sampled_ranks = (raw_logprobs > out.sampled_logprobs.unsqueeze(1)).sum(dim=1) + 1
    if top_n > 0:
        out.top_logprobs, out.top_ids = raw_logprobs.topk(top_n, dim=-1)
    return out
