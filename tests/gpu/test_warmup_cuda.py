"""The start-up warm-up on a GPU: afterwards no request compiles a Triton kernel (tests/kernel_variants.py), under
the default graphs, for the target alone and with an EAGLE-3 head drafting a chain or a tree: one request at a
time of any length, cached-prefix tails, chunked prefill, and batches of any size mixing prefills and decodes,
greedy and sampled."""
from __future__ import annotations

import gc
import random

import pytest
import torch

from kernel_variants import KernelVariants, describe_new
from specserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu
TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)]"
SEQS, BUDGET, MAX_LEN = 32, 512, 2048


def params(rng: random.Random, i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=True)
    return SamplingParams(temperature=0.9, top_p=0.95, top_k=50, min_p=0.02, max_tokens=rng.randint(1, 12),
                          seed=i if i % 4 == 0 else None, logprobs=3 if i % 3 == 1 else None,
                          presence_penalty=0.3 if i % 5 == 2 else 0.0, ignore_eos=True)


@pytest.mark.parametrize("spec", [None, "chain", "tree"])
def test_no_request_compiles_a_kernel_after_the_warm_up(smollm2_shape, spec):
    model, head = smollm2_shape
    cfg = {None: None, "chain": {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3},
           "tree": {"method": "eagle3", "model": str(head), "speculative_token_tree": TREE}}[spec]
    llm = LLM(model.path, load_format=model.load_format, dtype="bfloat16", max_model_len=MAX_LEN, max_num_seqs=SEQS,
              max_num_batched_tokens=BUDGET, gpu_memory_utilization=0.3, speculative_config=cfg)
    rng = random.Random(7)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 40000) for _ in range(n)]

    with KernelVariants() as compiled:
        # One at a time: every length up to two budgets (chunked past one), and tails after a cached prefix.
        for n in sorted(rng.sample(range(1, 2 * BUDGET), 60)):
            llm.generate(prompt(n), params(rng, n), use_tqdm=False)
        shared = prompt(256)
        for n in rng.sample(range(1, 300), 30):
            llm.generate(shared[:rng.choice((16, 64, 256))] + prompt(n), params(rng, n), use_tqdm=False)
        # Batches of sizes up to max_num_seqs, their prompts of any length, arriving as earlier ones decode.
        engine = llm.engine
        for size in sorted(rng.sample(range(2, SEQS + 1), 12)):
            for i in range(size):
                engine.add_request(prompt(rng.randint(1, 600)), params(rng, i))
                if i % 3 == 2:
                    engine.step()
            while engine.has_unfinished_requests():
                engine.step()
    assert not compiled, describe_new(compiled, set())
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
