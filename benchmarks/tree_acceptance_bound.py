"""How far a tree of drafts could take an EAGLE-3 head's acceptance: the best static trees of N nodes, from where
the target's own tokens rank among the head's drafts, on the real model and MT-bench first turns (CPU, float32).

For every answer position (a row) the head is unrolled along the target's tokens, as train-eagle scores held-out
data and as drafting runs while its drafts are accepted, and the rank of the target's next token among the head's
draft-vocabulary logits is kept at each depth (a token outside the draft vocabulary ranks last). A static tree is
a set of rank paths closed under prefixes, e.g. (0,), (1,), (0, 0): the top two drafts first, then the top draft
after the first. At a row it accepts as many drafts as its deepest node on the row's rank path is deep, and adds
the bonus token. Trees of N nodes are built greedily on half of the prompts (each next node the child that the
most rows reach, which for a fixed N maximises the accepted drafts on that half) and scored on the other half, so
the figures are what a tree chosen in advance would have done on prompts it was not chosen on. With
--score-prompts the trees are built on the prompts of --prompts and scored on those of --score-prompts instead.
A chain of k drafts is the tree (0,), (0, 0), ... of k nodes. After the table each best tree is printed as a
Python list of its nodes, by depth then rank, to paste into a config.

Two means are printed: over rows (every position alike), and over the steps of a walk through each answer as
the engine takes it (each step starts after the last token the one before emitted), which is what
eval-acceptance reports: easy stretches, where many drafts pass, take fewer steps, so it reads lower.

    python benchmarks/tree_acceptance_bound.py --prompts mt_bench.jsonl [--score-prompts OTHER.jsonl]
        [--head smollm2-135m-eagle3] [--num-prompts 40] [--max-tokens 128] [--depth 5] [--tree-depths 4 5] [--nodes 5 8 12 16 24 32 48 64]

--tree-depths builds trees no deeper than each of its values (default: --depth) from the same rows.
--num-prompts takes that many prompts, spread evenly, from each file (default: 40, or all with --score-prompts).

Ranks past --max-rank (default 8) are never in a tree. Rows run to --depth drafts only where the answer holds
that many tokens after them.
"""
from __future__ import annotations

import argparse
from collections import Counter

import torch

from specserve.bench.unrolled_head import head_beside_target
from specserve.llm import LLM
from specserve.prompt_files import load_prompt_file, prompt_token_ids
from specserve.sampling_params import SamplingParams
from specserve.train.batches import collate
from specserve.train.data import Sequence
from specserve.train.features import TargetFeatures
from specserve.train.ttt import unroll


@torch.no_grad()
def rank_paths(head, features: TargetFeatures, answers: list[Sequence], depth: int) -> list[list[tuple[int, ...]]]:
    """Per answer, per row in order (an answer position with `depth` tokens after its next one), the target
    token's rank among the head's drafts at each depth."""
    draft_of = torch.full((features.arch.vocab_size,), -1, dtype=torch.int64)
    draft_of[head.target_ids] = torch.arange(head.target_ids.shape[0])
    paths = []
    for s in answers:
        ids, p = torch.tensor(s.ids), len(s.prompt_ids)
        rows = torch.arange(p - 1, len(ids) - depth - 1)
        if len(rows) == 0:
            continue
        batch = collate([s])
        ranks = []
        for j, normed in enumerate(unroll(head, features(batch).aux, batch.ids, depth)):
            logits = head.lm_head(normed[rows]).float()
            wanted = draft_of[ids[rows + j + 2]]
            score = logits.gather(1, wanted.clamp(min=0)[:, None])
            rank = (logits > score).sum(dim=1)
            ranks.append(torch.where(wanted >= 0, rank, logits.shape[1]))
        paths.append([tuple(r) for r in torch.stack(ranks, dim=1).tolist()])
    return paths


def reach(paths: list[list[tuple[int, ...]]], max_rank: int) -> Counter:
    """How many rows' rank paths pass through each node (a rank path of at most max_rank at every depth)."""
    counts = Counter()
    for path in (path for answer in paths for path in answer):
        for d in range(len(path)):
            if path[d] >= max_rank:
                break
            counts[path[:d + 1]] += 1
    return counts


def best_tree(counts: Counter, nodes: int, max_depth: int) -> list[tuple[int, ...]]:
    """The `nodes` nodes, closed under prefixes, that the most rows reach: greedily, each next node the child of
    the tree (or a root node) with the largest count, at most max_depth deep. A child never reaches more rows
    than its parent, so the greedy choice keeps the tree closed under prefixes."""
    tree: set[tuple[int, ...]] = set()
    while len(tree) < nodes:
        candidates = [(n, c) for n, c in counts.items()
                      if n not in tree and len(n) <= max_depth and (len(n) == 1 or n[:-1] in tree)]
        if not candidates:
            break
        tree.add(max(candidates, key=lambda nc: (nc[1], -len(nc[0])))[0])
    return sorted(tree, key=lambda n: (len(n), n))


def accepted(held: set[tuple[int, ...]], path: tuple[int, ...]) -> int:
    return sum(path[:d + 1] in held for d in range(len(path)))


def acceptance(tree: list[tuple[int, ...]], answers: list[list[tuple[int, ...]]]) -> tuple[float, float]:
    """Mean accepted drafts plus the bonus token: per row, and per step of a walk through each answer."""
    held = set(tree)
    rows = [accepted(held, path) for paths in answers for path in paths]
    emitted, steps = 0, 0
    for paths in answers:
        r = 0
        while r < len(paths):
            a = accepted(held, paths[r]) + 1
            emitted, steps, r = emitted + a, steps + 1, r + a
    return 1 + sum(rows) / len(rows), emitted / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--score-prompts", help="score the trees on these prompts (default: half of --prompts)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", default="smollm2-135m-eagle3")
    ap.add_argument("--num-prompts", type=int, help="per file (default: 40, or all with --score-prompts)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--max-rank", type=int, default=8)
    ap.add_argument("--tree-depths", type=int, nargs="+", help="deepest tree levels to build (default: --depth)")
    ap.add_argument("--nodes", type=int, nargs="+", default=[5, 8, 12, 16, 24, 32, 48, 64])
    a = ap.parse_args()
    llm = LLM(a.model, device="cpu", max_model_len=1024, max_num_seqs=32)
    features, head = head_beside_target(a.model, a.head)
    num_prompts = a.num_prompts or (None if a.score_prompts else 40)

    def greedy_answers(path: str) -> list[Sequence]:
        loaded = load_prompt_file(path)
        n = num_prompts or len(loaded)
        prompts = [prompt_token_ids(llm, c) for c in loaded[:: max(1, len(loaded) // n)][:n]]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=a.max_tokens), use_tqdm=False)
        return [Sequence(p, o.outputs[0].token_ids, 0.0) for p, o in zip(prompts, outs)]

    answers = greedy_answers(a.prompts)
    if a.score_prompts:
        scored = greedy_answers(a.score_prompts)
        build, held_out = (rank_paths(head, features, s, a.depth) for s in (answers, scored))
        source = f"built on {len(answers)} prompts ({a.prompts}), scored on {len(scored)} ({a.score_prompts})"
    else:  # every other prompt builds the trees; the rest score them
        build, held_out = (rank_paths(head, features, answers[i::2], a.depth) for i in (0, 1))
        source = f"{len(answers)} prompts ({a.prompts}), every other one to build trees on"
    print(f"{source}: {sum(map(len, build))} rows to build trees on, {sum(map(len, held_out))} to score them; "
          f"depth {a.depth}, ranks below {a.max_rank}")
    print(f"{'tree (nodes per depth)':<28} {'nodes':>5}   accept len, build: rows / steps   held out: rows / steps")

    def row(name: str, tree: list[tuple[int, ...]]) -> None:
        (b_rows, b_steps), (h_rows, h_steps) = acceptance(tree, build), acceptance(tree, held_out)
        print(f"{name:<28} {len(tree):>5}   {b_rows:>17.3f} / {b_steps:.3f}   {h_rows:>16.3f} / {h_steps:.3f}")

    for k in range(1, a.depth + 1):
        row(f"chain of {k}", [(0,) * d for d in range(1, k + 1)])
    counts = reach(build, a.max_rank)
    trees = [(depth, best_tree(counts, n, depth)) for depth in a.tree_depths or [a.depth] for n in a.nodes]
    for _, tree in trees:
        widths = Counter(len(node) for node in tree)
        row(f"best static ({'/'.join(str(widths[d]) for d in range(1, max(widths) + 1))})", tree)
    print()
    for depth, tree in trees:
        print(f"best static, {len(tree)} nodes, depth <= {depth}: {tree}")


if __name__ == "__main__":
    main()
