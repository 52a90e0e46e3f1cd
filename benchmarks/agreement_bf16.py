"""Greedy output with EAGLE-3 beside output without it, in bf16 on a GPU, over MT-bench first turns.

In float32 the two are equal token for token (tests/gpu); in bf16 the verify pass (1 + k query tokens)
and the plain decode pass (1 token) use differently shaped kernels whose roundings can flip a
near-tie, after which the texts diverge. This prints how often that happens.

    python benchmarks/agreement_bf16.py PROMPTS.jsonl [--k 3 5] [--max-tokens 128]
"""
from __future__ import annotations

import argparse

from specserve import LLM, SamplingParams
from specserve.prompt_files import load_prompt_file


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("prompts")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", default="smollm2-135m-eagle3")
    ap.add_argument("--k", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    base = LLM(a.model, dtype="bfloat16", max_num_seqs=128)
    chats = [base.apply_chat_template(conversation) for conversation in load_prompt_file(a.prompts)]
    ref = [o.outputs[0].token_ids for o in base.generate(chats, params, use_tqdm=False)]
    del base
    print(f"{len(chats)} prompts, greedy, {a.max_tokens} new tokens at most, bf16")
    print("  k  identical outputs  tokens before first difference (share of output)")
    for k in a.k:
        llm = LLM(a.model, dtype="bfloat16", max_num_seqs=128,
                  speculative_config={"method": "eagle3", "model": a.head, "num_speculative_tokens": k})
        outs = [o.outputs[0].token_ids for o in llm.generate(chats, params, use_tqdm=False)]
        same = sum(o == r for o, r in zip(outs, ref))
        prefix = sum(common_prefix(o, r) for o, r in zip(outs, ref)) / max(sum(map(len, ref)), 1)
        print(f"{k:3d}  {same:3d}/{len(ref)} ({same / len(ref):.0%})  {prefix:.1%}")
        del llm


if __name__ == "__main__":
    main()
