"""tests/perplexity.py, which the GPU test of the FP8 KV cache relies on, against transformers on the CPU."""
from __future__ import annotations

import math
import random

import torch

from perplexity import perplexity


def test_perplexity_matches_transformers_and_fp8_stays_close(tiny_llama):
    path, hf = tiny_llama
    rng = random.Random(5)
    ids = [rng.randrange(3, hf.config.vocab_size) for _ in range(150)]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    expected = math.exp(-torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None]).mean().item())
    # Three chunks of 64: later chunks read the earlier ones from the cache.
    ours = perplexity(str(path), ids, chunk=64)
    assert abs(ours - expected) / expected < 1e-4
    fp8 = perplexity(str(path), ids, kv_cache_dtype="fp8", chunk=64)
    assert fp8 != ours and abs(fp8 - ours) / ours < 0.05
