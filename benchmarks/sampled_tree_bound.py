"""What sampled children could give a tree of drafts at temperature T > 0: the first draft's acceptance, on the real
model and MT-bench first turns (CPU, float32).

A tree drafts the head's top guesses, and at T > 0 its walk accepts a node's child when the target's sample is
one of them (spec_decode/tree_verify.py): the chance is the target's probability of those children. A chain draws
its draft from the head's distribution q and verifies by rejection sampling: min(p, q) summed. With m children
drawn from q without replacement and verified one after another by recursive rejection sampling (Jeon et al.,
"Recursive Speculative Decoding", 2024: child i is accepted with probability min(1, p_i(x) / q_i(x)), and on a
rejection p_{i+1} = (p_i - q_i)+ normalised and q_{i+1} = q_i without x, normalised; after the last the target
samples from the residual), the output is still distributed as p and more children pay more.

For every answer position of the target's own sampled answers, this prints the mean first-draft acceptance of each:
`chain` (one sampled draft), `topM` (the M top guesses, as a tree's first level drafts them), `rrsM` (M sampled
children, Monte Carlo over --draws). Only the first level is measured: deeper levels follow drafts the head made.

    python benchmarks/sampled_tree_bound.py --prompts mt_bench.jsonl [--head smollm2-135m-eagle3]
        [--num-prompts 12] [--max-tokens 96] [--temperature 1.0] [--children 3] [--draws 32]
"""
from __future__ import annotations

import argparse

import torch

from specserve.bench.unrolled_head import head_beside_target
from specserve.llm import LLM
from specserve.prompt_files import load_prompt_file, prompt_token_ids
from specserve.sampling_params import SamplingParams
from specserve.train.batches import collate
from specserve.train.data import Sequence
from specserve.train.ttt import unroll


def recursive_rejection_acceptance(p: torch.Tensor, q: torch.Tensor, children: int, draws: int,
                                   generator: torch.Generator) -> torch.Tensor:
    """Per row of p and q ([rows, vocab], each row a distribution), the chance that one of `children` drafts drawn
    from q without replacement is accepted by recursive rejection sampling, estimated over `draws` draws."""
    accepted = torch.zeros(p.shape[0])
    for _ in range(draws):
        residual, draft = p.clone(), q.clone()
        hit = torch.zeros(p.shape[0], dtype=torch.bool)
        for _ in range(children):
            x = torch.multinomial(draft, 1, generator=generator)
            px, qx = residual.gather(1, x).squeeze(1), draft.gather(1, x).squeeze(1)
            u = torch.rand(p.shape[0], generator=generator)
            hit |= u * qx < px
            residual = (residual - draft).clamp(min=0)
            residual = residual / residual.sum(-1, keepdim=True).clamp(min=1e-30)
            draft = draft.scatter(1, x, 0.0)
            draft = draft / draft.sum(-1, keepdim=True).clamp(min=1e-30)
        accepted += hit.float()
    return accepted / draws


def first_draft_acceptance(p: torch.Tensor, q: torch.Tensor, children: int, draws: int,
                           generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Per row: chain (min(p, q) summed), topM (p of q's M top tokens) and rrsM (recursive rejection sampling of M
    sampled children) for M = 1..children (rrs from 2: rrs1 is the chain)."""
    out = {"chain": torch.minimum(p, q).sum(-1)}
    top = q.topk(children, dim=-1).indices
    for m in range(1, children + 1):
        out[f"top{m}"] = p.gather(1, top[:, :m]).sum(-1)
    for m in range(2, children + 1):
        out[f"rrs{m}"] = recursive_rejection_acceptance(p, q, m, draws, generator)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", default="smollm2-135m-eagle3")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--children", type=int, default=3)
    ap.add_argument("--draws", type=int, default=32)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    if a.temperature <= 0 or a.children < 2:
        ap.error("give --temperature above 0 (at 0 the top guesses are the best children) and --children 2 or more")
    llm = LLM(a.model, device="cpu", max_model_len=1024, max_num_seqs=32)
    features, head = head_beside_target(a.model, a.head)
    prompts = [prompt_token_ids(llm, c) for c in load_prompt_file(a.prompts, limit=a.num_prompts)]
    outs = llm.generate(prompts, SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, seed=a.seed),
                        use_tqdm=False)
    generator = torch.Generator().manual_seed(a.seed)
    sums: dict[str, float] = {}
    rows_seen = 0
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            s = Sequence(prompt, out.outputs[0].token_ids, a.temperature)
            batch = collate([s])
            states = features(batch)
            rows = torch.arange(len(prompt) - 1, len(s.ids) - 2)
            if len(rows) == 0:
                continue
            # The head at row i drafts token i + 2, which the target predicts at row i + 1.
            p = torch.softmax(features.model.compute_logits(states.final[rows + 1]).float() / a.temperature, -1)
            normed = next(iter(unroll(head, states.aux, batch.ids, 1)))
            q = torch.zeros_like(p)
            q[:, head.target_ids] = torch.softmax(head.lm_head(normed[rows]).float() / a.temperature, -1)
            for name, value in first_draft_acceptance(p, q, a.children, a.draws, generator).items():
                sums[name] = sums.get(name, 0.0) + value.sum().item()
            rows_seen += len(rows)
    print(f"{a.head}, {len(prompts)} prompts ({a.prompts}), T={a.temperature}, {rows_seen} answer positions: "
          "mean first-draft acceptance")
    for name, total in sums.items():
        print(f"  {name:<6} {total / rows_seen:.4f}")


if __name__ == "__main__":
    main()
