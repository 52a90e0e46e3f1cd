"""CPU benchmark: greedy decoding tokens/s of the default model, specserve beside transformers.

SmolLM2-135M-Instruct from its GGUF (dequantized, float32) on the CPU; the
first turns of MT-bench questions as chat prompts; every request generates
exactly --max-tokens tokens. transformers' generate runs on the same weights
(its own GGUF loader) in the same process, batch 16 with left padding.

    python benchmarks/bench_cpu.py [--max-tokens 64] [--batch-sizes 1,16] [--prompts ../shared/data/mt_bench.jsonl]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from specserve import LLM, SamplingParams
from specserve.models.loader import resolve_model_path

REPO = Path(__file__).resolve().parents[1]


def load_questions(path: Path, n: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


def bench_specserve(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompts[i:i + batch], params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    return time.perf_counter() - start, tokens


def bench_transformers(hf, tok, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[float, int]:
    hf.generation_config.eos_token_id = None
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        tokens += (out.shape[1] - width) * len(chunk)
    return time.perf_counter() - start, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--prompts", type=Path, default=REPO.parent / "shared" / "data" / "mt_bench.jsonl")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    llm = LLM("smollm2-135m", dtype="float32", device="cpu", max_model_len=2048)
    questions = load_questions(a.prompts, 16)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    path = resolve_model_path("smollm2-135m")
    print("loading transformers' model from the same GGUF...", file=sys.stderr)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    bench_specserve(llm, prompts[:1], 1, 4)
    bench_transformers(hf, None, prompts[:1], 1, 4)
    rows = []
    for b in [int(x) for x in a.batch_sizes.split(",")]:
        # Batch 1 runs 4 prompts one after another; batch b runs b prompts at once.
        subset = prompts[:4] if b == 1 else prompts[:b]
        t_ours, n_ours = bench_specserve(llm, subset, b, a.max_tokens)
        with torch.inference_mode():
            t_ref, n_ref = bench_transformers(hf, None, subset, b, a.max_tokens)
        rows.append((b, n_ours / t_ours, n_ref / t_ref, t_ours, t_ref, len(subset)))
        print(f"batch {b}: specserve {n_ours / t_ours:.1f} tok/s, transformers {n_ref / t_ref:.1f} tok/s",
              file=sys.stderr)
    print(f"\nSmolLM2-135M-Instruct (GGUF Q4_1 dequantized to float32), CPU, {a.threads} threads, greedy, "
          f"{a.max_tokens} new tokens per request, MT-bench first turns as chat prompts\n")
    print("| batch | prompts | specserve tok/s | transformers tok/s | specserve / transformers | specserve s | transformers s |")
    print("|---|---|---|---|---|---|---|")
    for b, ours, ref, to, tr, n in rows:
        print(f"| {b} | {n} | {ours:.1f} | {ref:.1f} | {ours / ref:.2f}x | {to:.1f} | {tr:.1f} |")


if __name__ == "__main__":
    main()
