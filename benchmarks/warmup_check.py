"""Whether the engine's start-up warm-up keeps kernel compilation out of the first requests. A fresh engine
(SmolLM2's shape with random weights, optionally with a random EAGLE-3 head) serves requests one at a time, as
a server at concurrency 1: prompts of 1 to 400 tokens, every other one a cached prefix of its predecessor
plus a new tail, 8 tokens each, then the same lengths again with new tokens. It prints each pass's time to
first token (P50, P90, max) and the kernel variants Triton compiled (or loaded) during it. Run each case in a
fresh process with an empty Triton cache:

    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/warmup_check.py
    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/warmup_check.py --no-warmup
    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/warmup_check.py --spec 3

With the warm-up the first pass compiles nothing and its TTFT matches the second pass's; without it, the
first pass pays for every kernel shape it meets first.
"""
from __future__ import annotations

import argparse
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from triton import knobs

from specserve.bench.models import prepare_model, write_random_eagle3_head
from specserve.llm import LLM
from specserve.sampling_params import RequestOutputKind, SamplingParams


def ttft_ms(llm: LLM, prompt: list[int]) -> float:
    """Milliseconds from adding the request to its first token, then run it to its end."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    start, first = time.perf_counter(), None
    rid = engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.request_id == rid and out.outputs[0].token_ids:
                first = time.perf_counter()
    return 1e3 * (first - start)


def prompts_of(rng: random.Random, lengths: list[int]) -> list[list[int]]:
    """Prompts of these lengths; every other one continues its predecessor's first full blocks."""
    prompts = []
    for i, n in enumerate(lengths):
        fresh = [rng.randrange(3, 40000) for _ in range(n)]
        prompts.append(prompts[-1][:len(prompts[-1]) // 16 * 16] + fresh if i % 2 and prompts else fresh)
    return prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--spec", type=int, default=0, help="drafts of a random EAGLE-3 head per step (0: none)")
    ap.add_argument("--requests", type=int, default=40)
    a = ap.parse_args()
    # The engine's start-up lines: the memory profile, the KV cache's size, the warm-up's scenarios and time.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    root = Path(tempfile.mkdtemp())
    model = prepare_model("smollm2-shape", root, torch.bfloat16)
    spec = None
    if a.spec:
        head = write_random_eagle3_head(root / "head", model.hf_config, torch.bfloat16, "cuda")
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": a.spec}
    compiled: list[str] = []

    def compiling(*, repr, **_) -> bool:
        compiled.append(repr.split("[")[0])
        return False  # compile as usual

    knobs.runtime.jit_cache_hook = compiling
    start = time.perf_counter()
    llm = LLM(model.path, load_format=model.load_format, dtype="bfloat16", max_model_len=2048, warmup=a.warmup,
              speculative_config=spec)
    print(f"engine built in {time.perf_counter() - start:.1f} s, {len(compiled)} kernel variants compiled")
    rng = random.Random(0)
    lengths = [rng.randint(1, 400) for _ in range(a.requests)]
    for name in ("first pass", "second pass"):
        compiled.clear()
        ms = sorted(ttft_ms(llm, p) for p in prompts_of(rng, lengths))
        p90 = ms[int(0.9 * (len(ms) - 1))]
        print(f"{name}: TTFT P50 {statistics.median(ms):.1f} ms, P90 {p90:.1f} ms, max {ms[-1]:.1f} ms; "
              f"{len(compiled)} kernel variants compiled ({', '.join(sorted(set(compiled))) or 'none'})")


if __name__ == "__main__":
    main()
