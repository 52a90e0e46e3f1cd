"""Where an EAGLE-3 head misses: its first-draft accuracy on two prompt sets, side by side.

For each set the target answers greedily; the head then scores every answer position the way
train-eagle scores held-out data (aux states of prompt + answer, the next token fed in). Printed per
set: accuracy overall, with the fed token shuffled (how much the head uses it), by the target's
own confidence in that token, and per answer.

With --data (the head's training sequences, train-eagle's sequences.jsonl, gzip or not) it also splits
the rows by whether their pair (fed token, drafted-for token) occurs in the training answers, and with
--compare-data (other sequence files, e.g. data written with other settings) it prints how many of the
unseen pairs each file holds, per 100k of its tokens: which data would teach the head what it misses.

    python benchmarks/head_accuracy_by_prompts.py --head HEAD_DIR --prompts mt_bench.jsonl --num-prompts 12
"""
from __future__ import annotations

import argparse
import gzip
import json

import torch

from specserve.bench.unrolled_head import head_beside_target
from specserve.llm import LLM
from specserve.prompt_files import load_prompt_file, prompt_token_ids
from specserve.sampling_params import SamplingParams
from specserve.train.batches import collate
from specserve.train.data import Sequence
from specserve.train.features import TargetFeatures
from specserve.train.request_templates import templated_requests
from specserve.train.ttt import unroll

BUCKETS = 5


@torch.no_grad()
def score(head, features: TargetFeatures, answers: list[Sequence], seed: int, seen: set[tuple[int, int]]) -> dict:
    hits, shuffled, per_answer, pairs = [], [], [], []
    by_conf = torch.zeros(2, BUCKETS)
    g = torch.Generator().manual_seed(seed)
    for s in answers:
        ids, p = torch.tensor(s.ids), len(s.prompt_ids)
        if len(ids) - p < 3:
            continue
        batch = collate([s])
        states = features(batch)
        confidence = torch.softmax(features.model.compute_logits(states.final), dim=-1).max(dim=-1).values
        drafts = head.greedy_tokens(next(unroll(head, states.aux, batch.ids, 1)))
        mixed = ids.clone()
        mixed[p:] = ids[p:][torch.randperm(len(ids) - p, generator=g)]
        # The same target states, the answer's tokens fed in shuffled.
        drafts_mixed = head.greedy_tokens(next(unroll(head, states.aux, mixed[None], 1)))
        rows = range(p - 1, len(ids) - 2)
        ok = [int(drafts[i] == ids[i + 2]) for i in rows]
        hits += ok
        pairs += [(int(ids[i + 1]), int(ids[i + 2])) for i in rows]
        shuffled += [int(drafts_mixed[i] == ids[i + 2]) for i in rows]
        per_answer.append(sum(ok) / len(ok))
        for i, hit in zip(rows, ok):
            bucket = min(int(confidence[i + 1] * BUCKETS), BUCKETS - 1)
            by_conf[0, bucket] += 1
            by_conf[1, bucket] += hit
    known = [pair in seen for pair in pairs]
    split = {flag: [h for h, k in zip(hits, known) if k is flag] for flag in (True, False)}
    return {"rows": len(hits), "accuracy": sum(hits) / len(hits), "shuffled": sum(shuffled) / len(shuffled),
            "by_confidence": by_conf, "per_answer": per_answer, "seen_share": sum(known) / len(known),
            "seen_accuracy": {flag: sum(h) / max(len(h), 1) for flag, h in split.items()},
            "unseen_pairs": {p for p, k in zip(pairs, known) if not k}}


def answer_pairs(path: str) -> tuple[set[tuple[int, int]], int]:
    """Every (token, next token) pair in the answers of a sequence file, and the file's answer tokens."""
    pairs, tokens = set(), 0
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for line in f:
            s = json.loads(line)
            ids = s["prompt_ids"][-1:] + s["response_ids"]
            pairs.update(zip(ids, ids[1:]))
            tokens += len(s["response_ids"])
    return pairs, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True, help="EAGLE-3 head directory")
    ap.add_argument("--prompts", required=True, help="JSONL prompts to compare with fresh templated requests")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=99, help="seed of the templated requests (not train-eagle's 0)")
    ap.add_argument("--data", help="the head's training sequences: split rows by pairs seen in them")
    ap.add_argument("--compare-data", nargs="*", default=[], help="sequence files: how many unseen pairs each holds")
    a = ap.parse_args()
    seen = answer_pairs(a.data)[0] if a.data else set()

    llm = LLM(a.model, device="cpu", max_model_len=1024, max_num_seqs=32)
    features, head = head_beside_target(a.model, a.head)
    loaded = load_prompt_file(a.prompts)
    sets = {
        a.prompts: loaded[:: max(1, len(loaded) // a.num_prompts)][: a.num_prompts],
        f"templated (seed {a.seed})": [[{"role": "user", "content": r}]
                                       for r in templated_requests(a.num_prompts, a.seed)],
    }
    greedy = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    print(f"{'prompts':<34} {'rows':>6} {'accuracy':>8} {'shuffled':>8}  accuracy by target confidence "
          f"({' '.join(f'<{(b + 1) / BUCKETS:.1f}' for b in range(BUCKETS))}; share of rows)")
    for name, conversations in sets.items():
        prompts = [prompt_token_ids(llm, c) for c in conversations]
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        r = score(head, features, [Sequence(p, o.outputs[0].token_ids, 0.0) for p, o in zip(prompts, outs)], a.seed,
                  seen)
        count, hit = r["by_confidence"]
        cells = " ".join(f"{h / max(c, 1):.2f}({c / count.sum():.2f})" for c, h in zip(count.tolist(), hit.tolist()))
        print(f"{name[-34:]:<34} {r['rows']:>6} {r['accuracy']:>8.3f} {r['shuffled']:>8.3f}  {cells}")
        print(f"{'':<34} per answer: {' '.join(f'{x:.2f}' for x in r['per_answer'])}")
        if not a.data:
            continue
        acc = r["seen_accuracy"]
        print(f"{'':<34} pair (fed token, next) in the training answers: {r['seen_share']:.2f} of rows, "
              f"accuracy {acc[True]:.3f} there and {acc[False]:.3f} elsewhere; {len(r['unseen_pairs'])} unseen pairs")
        for path in a.compare_data:
            pairs, tokens = answer_pairs(path)
            held = len(r["unseen_pairs"] & pairs)
            print(f"{'':<34} {path[-40:]}: {held} of them in {tokens} tokens ({1e5 * held / max(tokens, 1):.1f} "
                  "per 100k tokens)")


if __name__ == "__main__":
    main()
