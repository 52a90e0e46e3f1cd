"""Timing one decode batch: the engine's and transformers' decode tokens/s, measured as bench/decode.py's
docstring says, and the device's copy bandwidth behind the weight-read limit."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy, which reads and writes every byte once."""
    n = 1 << 30 if device.startswith("cuda") else 1 << 26
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    reps = 10
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    return 2 * n * reps / (time.perf_counter() - start)


def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Distinct random prompts of one length (ids from 3: past the pad, BOS and EOS ids of the shapes)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(prompt_len)] for _ in range(batch)]


@dataclass
class DecodeTiming:
    tokens: int
    seconds: float
    accept_len: float | None = None
    drafting_share: float | None = None

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def time_engine(engine, prompts: list[list[int]], new_tokens: int) -> DecodeTiming:
    """Decode tokens/s of one batch: from the step that gives the last request its first token to the end."""
    from specserve.sampling_params import RequestOutputKind, SamplingParams

    # Delta outputs: cumulative ones would time the copy of every request's tokens at every step.
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    stats, policy = engine.spec_stats, engine.scheduler.policy
    steps0, emitted0 = stats.num_steps, stats.num_emitted

    def decisions() -> tuple[int, int]:
        return (policy.steps_drafting, policy.steps_without_drafts) if policy is not None else (0, 0)

    ids = [engine.add_request(p, params) for p in prompts]
    counts: dict[str, int] = {}
    start, before = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = out.metrics.num_output_tokens
        if start is None and len(counts) == len(ids):
            start, before, decided = time.perf_counter(), sum(counts.values()), decisions()
    seconds = time.perf_counter() - start
    total = sum(counts.values())
    if total != len(ids) * new_tokens:
        raise RuntimeError(f"expected {len(ids)} x {new_tokens} tokens, got {total}; was a request cut short?")
    steps = stats.num_steps - steps0
    accept = (stats.num_emitted - emitted0) / steps if steps else None
    drafting, without = (now - then for now, then in zip(decisions(), decided))
    share = drafting / (drafting + without) if policy is not None and drafting + without else None
    return DecodeTiming(total - before, seconds, accept, share)


# Runs of each length that time_hf takes the fastest of.
HF_RUNS = 5


def time_hf(hf, prompts: list[list[int]], new_tokens: int, device: str) -> DecodeTiming:
    x = torch.tensor(prompts, device=device)

    def generate(n: int) -> float:
        _sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        eos_token_id=None, pad_token_id=0)
        _sync(device)
        return time.perf_counter() - start

    # The fastest of a few runs each, the two lengths alternating so that a busy spell of the machine slows both
    # alike: one run's noise can exceed a short decode on a small model.
    runs = [(generate(new_tokens), generate(1)) for _ in range(HF_RUNS)]
    decode = min(full for full, _ in runs) - min(first for _, first in runs)
    if decode <= 0:
        raise RuntimeError("transformers' decode time came out non-positive; use more --hf-new-tokens")
    return DecodeTiming(len(prompts) * (new_tokens - 1), decode)
