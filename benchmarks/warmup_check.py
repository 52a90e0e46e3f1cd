"""Whether eval-acceptance's warm-up keeps kernel compilation out of its timed runs: SmolLM2's shape with
random weights at batch 1, prompts of 20-300 tokens, N warm-ups of eval-acceptance's kind, then three
timed runs. Run it in a fresh process with an empty Triton cache (TRITON_CACHE_DIR), once per N:

    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/warmup_check.py --warm-ups 1
    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/warmup_check.py --warm-ups 2

A first timed run well below the next two means something still compiled inside it.
"""
from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch

from specserve.bench.models import prepare_model
from specserve.entrypoints.eval_acceptance import run_prompts
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm-ups", type=int, default=2)
    a = ap.parse_args()
    model = prepare_model("smollm2-shape", Path(tempfile.mkdtemp()), torch.bfloat16)
    llm = LLM(model.path, load_format=model.load_format, device="cuda", dtype="bfloat16", max_num_seqs=1,
              max_model_len=2048)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randint(20, 300))] for _ in range(16)]
    for _ in range(a.warm_ups):
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    runs = [run_prompts(llm, prompts, 0.0, 128, None).tokens_per_s for _ in range(3)]
    print(f"warm-ups {a.warm_ups}: timed runs " + " ".join(f"{r:.0f}" for r in runs) + " tok/s")


if __name__ == "__main__":
    main()
