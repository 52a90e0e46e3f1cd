"""Milliseconds per engine step at batch 1 with an EAGLE-3 head at forced acceptance, over several timed runs of
one engine: the figure an A/B of the speculative step compares (run each side in its own process, alternating).

    python benchmarks/spec_step_time.py --k 4 --p 0.6 --head smollm2-135m-eagle3 [--model smollm2-shape] [--runs 5]

--k 0 times the same engine without speculation. Speed does not depend on weights, so the target may be a
shape with random weights; the head sets the drafting cost by its draft vocabulary and MLP width.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from specserve.bench.decode_plan import SpecSetting
from specserve.bench.timing import make_prompts, time_engine
from specserve.bench.models import prepare_model
from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-shape")
    ap.add_argument("--head", default="smollm2-135m-eagle3", help="EAGLE-3 head: directory or shipped name")
    ap.add_argument("--k", type=int, default=4, help="drafts per step (0: no speculation)")
    ap.add_argument("--p", type=float, default=0.6, help="forced acceptance probability of each draft")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=256)
    a = ap.parse_args()
    model = prepare_model(a.model, Path(tempfile.mkdtemp()), torch.bfloat16)
    spec = None if a.k == 0 else SpecSetting(a.k, a.p).speculative_config(a.head)
    engine = LLMEngine(EngineConfig(model=model.path, load_format=model.load_format, device="cuda", dtype="bfloat16",
                                    max_model_len=2048, max_num_seqs=8, enable_prefix_caching=False,
                                    cudagraph_capture_sizes=[1, 2, 4, 8], speculative_config=spec))
    prompts = make_prompts(1, 64, engine.core.arch.vocab_size, 0)
    time_engine(engine, prompts, 64)  # warm-up
    ms, per_step = [], 1.0
    for _ in range(a.runs):
        t = time_engine(engine, prompts, a.new_tokens)
        per_step = t.accept_len or 1.0
        ms.append(1e3 * per_step / t.tok_s)
    print(f"{a.model} k={a.k} ms/step runs: {' '.join(f'{m:.3f}' for m in ms)} median {statistics.median(ms):.3f} "
          f"(tokens/step {per_step:.2f})")


if __name__ == "__main__":
    main()
