"""CPU benchmark: n-gram speculation on editing prompts (the answer repeats much of the prompt).

Prints, for the default model, greedy tokens/s without speculation and with
n-gram speculation (k = 3 and 5) in the same run, the speedup, and the
acceptance statistics. Greedy output with and without speculation is checked
to be identical.

    python benchmarks/bench_ngram_cpu.py [--max-tokens 128] [--threads N]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from specserve import LLM, SamplingParams

PARAGRAPHS = [
    "Teh quick brown fox jumpd over the lazy dog. It was a sunny day and the the birds were singing in "
    "the trees. The farmer watched from his porch, drinking his coffe and thinking about the harvest.",
    "Our meeting is schedulled for tuesday at 10am in the main conference room. Please bring you're "
    "laptops and the quarterly reports. We will discus the budget, the hiring plan and the new office.",
    "The recipe calls for two cups of flower, one cup of sugar, three eggs and a pinch of salt. Mix the "
    "dry ingredients first, than add the eggs one at a time, and bake for thirty minuts at 180 degrees.",
]


def editing_prompts() -> list[list[dict]]:
    return [[{"role": "user", "content": f"Fix the spelling mistakes in this text and return the whole "
                                         f"corrected text, nothing else:\n\n{p}"}] for p in PARAGRAPHS]


def run(llm: LLM, chats, params) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False)
    return time.perf_counter() - start, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    chats = editing_prompts()
    rows = []
    baseline = None
    for k in (None, 3, 5):
        cfg = None if k is None else {"method": "ngram", "num_speculative_tokens": k,
                                      "prompt_lookup_min": 2, "prompt_lookup_max": 4}
        llm = LLM("smollm2-135m", dtype="float32", device="cpu", max_model_len=2048, speculative_config=cfg)
        run(llm, chats[:1], SamplingParams(temperature=0, max_tokens=8))  # warm-up
        # Batch 1: one request at a time, as a latency-bound user would.
        total_time, outs = 0.0, []
        for chat in chats:
            t, o = run(llm, [chat], params)
            total_time += t
            outs += o
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        texts = [o.outputs[0].token_ids for o in outs]
        if baseline is None:
            baseline = (tokens / total_time, texts)
        same = texts == baseline[1]
        # Statistics of the measured requests only (the warm-up's are left out).
        drafted, accepted, steps = (sum(o.metrics.spec.get(key, 0) for o in outs)
                                    for key in ("num_drafted", "num_accepted", "num_steps"))
        rows.append((f"n-gram k={k}" if k else "no speculation", tokens, total_time, tokens / total_time,
                     tokens / total_time / baseline[0], accepted / drafted if k and drafted else None,
                     (accepted + steps) / steps if k and steps else None, same))
        print(f"done: {rows[-1][0]}", file=sys.stderr)
    print(f"\nSmolLM2-135M-Instruct (GGUF Q4_1 dequantized, float32), CPU, {a.threads} threads, batch 1, "
          f"greedy, {len(chats)} editing prompts, max {a.max_tokens} new tokens\n")
    print("| config | tokens | wall s | tokens/s | speedup | acceptance rate | mean acceptance length | output = no-spec |")
    print("|---|---|---|---|---|---|---|---|")
    for name, tok, t, tps, sp, acc, mal, same in rows:
        acc_s = f"{acc:.1%}" if acc is not None else "-"
        mal_s = f"{mal:.2f}" if mal is not None else "-"
        print(f"| {name} | {tok} | {t:.2f} | {tps:.1f} | {sp:.2f}x | {acc_s} | {mal_s} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
