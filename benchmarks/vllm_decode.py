"""vLLM's offline decode speed on the shapes `specserve bench decode` measures, for a table beside it: random
weights (load_format dummy), the same random 64-token prompts, 128 new tokens, greedy, EOS ignored, prefix caching
off, at a tensor-parallel size. Run it in its own process beside specserve's run, in the same device call:

    PYTHONPATH=VLLM_SITE python benchmarks/vllm_decode.py --model llama3-8b --tensor-parallel-size 2 \
        --batch-sizes 1,64 [--quantization fp8] [--json OUT.json]

Tokens/s counts the new tokens after the first (which comes with the prefill) over the time after it, as
`specserve bench decode` does (from the step that gives the last request its first token); here the time of the
batch's prefill and first token is measured apart and subtracted.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from specserve.bench.timing import make_prompts
from specserve.bench.models import prepare_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", help="a shape name of specserve/bench/models.py")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", choices=["fp8"], help="vLLM's --quantization (default: bfloat16 weights)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm import LLM, SamplingParams

    sizes = [int(x) for x in a.batch_sizes.split(",")]
    model = prepare_model(a.model, Path(tempfile.mkdtemp()), torch.bfloat16)
    llm = LLM(model=model.path, load_format="dummy", dtype="bfloat16", tensor_parallel_size=a.tensor_parallel_size,
              max_model_len=a.prompt_len + a.new_tokens + 16, max_num_seqs=max(sizes), enable_prefix_caching=False,
              gpu_memory_utilization=0.85, quantization=a.quantization)
    vocab = model.hf_config["vocab_size"]
    rows = []
    for b in sizes:
        prompts = [{"prompt_token_ids": p} for p in make_prompts(b, a.prompt_len, vocab, seed=b)]

        def timed(new_tokens: int) -> float:
            params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start

        timed(a.new_tokens)  # warm-up: compilation, graphs
        first = min(timed(1) for _ in range(a.repeats))
        whole = min(timed(a.new_tokens) for _ in range(a.repeats))
        tok_s = b * (a.new_tokens - 1) / (whole - first)
        rows.append(dict(model=a.model, tp=a.tensor_parallel_size, quantization=a.quantization, batch=b, tok_s=tok_s))
        print(json.dumps(rows[-1]), flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    weights = a.quantization or "bfloat16"
    print(f"\n| vLLM, {a.model}, TP={a.tensor_parallel_size}, {weights} | "
          + " | ".join(f"batch {r['batch']}: {r['tok_s']:,.0f} tok/s" for r in rows) + " |")


if __name__ == "__main__":
    main()
