"""The training-time-test loss: the head's draft steps unrolled over every position at once.

Row i of unrolled step j plays draft step j for a request whose last accepted
token is token i (see attention.py for why its attention matches the
drafter's). With tokens x_0..x_{n-1}, that step is fed token x_{i+j+1} (the
bonus token at j = 0, then the earlier drafts, which are only kept when they
equal the target's tokens), sits at position i + j, and must predict
x_{i+j+2}. Step 0 reads the target's hidden states at i; step j > 0 the
head's own output of step j - 1 in the same row, as when drafting.

A row counts where the drafter could stand there: its first token x_{i+1}
is one the target generated (i >= prompt length - 1) and the token to
predict exists. Tokens outside the draft vocabulary cannot be proposed: they
are left out of the loss and counted as misses in the accuracy.

With the target's own next-token predictions (soft labels, as EAGLE-3 trains),
step j's row is scored against the target's distribution after x_{i+j+1}
(renormalised over the draft vocabulary; the loss is the KL divergence to
it) rather than the one token the data holds, and its accuracy is agreement
with the target's greedy choice: every row then teaches the whole ranking,
and sampled answers teach what greedy serving will ask for.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.train.attention import DenseBatch, UnrolledKV
from specserve.train.batches import Batch
from specserve.train.features import NextTokens


@dataclass
class UnrolledResult:
    loss: torch.Tensor  # scalar, the weighted sum of the steps' mean cross-entropies (KL divergences, soft)
    correct: torch.Tensor  # [steps] counted rows whose argmax draft is the target's token
    counted: torch.Tensor  # [steps] rows that count, on the host


def unroll(head, aux: torch.Tensor, ids: torch.Tensor, steps: int) -> Iterator[torch.Tensor]:
    """For j = 0..steps-1, the normed hidden states [B * L, H] of unrolled step j (ids: [B, L], right-padded)."""
    b, n = ids.shape
    padded = F.pad(ids, (0, steps))
    row = torch.arange(n, device=ids.device)
    max_position = head.cfg.max_position_embeddings - 1
    shape, cache = DenseBatch(b, n), UnrolledKV()
    hidden = aux
    for j in range(steps):
        positions = (row + j).clamp(max=max_position).expand(b, n)
        hidden, normed = head(padded[:, j + 1: j + 1 + n].flatten(), positions.flatten(), hidden, cache, shape)
        yield normed


def unrolled_loss(head, aux: torch.Tensor, batch: Batch, target_to_draft: torch.Tensor,
                  draft_to_target: torch.Tensor, steps: int, step_weight_decay: float,
                  teacher: NextTokens | None = None) -> UnrolledResult:
    """teacher: the target's predictions at every position of the batch (soft labels); None trains on
    the data's tokens."""
    n = batch.ids.shape[1]
    targets_of = F.pad(batch.ids, (0, steps + 1))
    counted_rows = batch.counted_rows(steps)
    loss = aux.new_zeros((), dtype=torch.float32)
    correct = []
    for j, (normed, rows) in enumerate(zip(unroll(head, aux, batch.ids, steps), counted_rows)):
        logits = head.lm_head(normed[rows]).float()
        if teacher is None:
            targets = targets_of[:, j + 2: j + 2 + n].flatten()[rows]
            labels = target_to_draft[targets]
            ce = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
        else:
            # The prediction of x_{i+j+2} is the target's at position i + j + 1, in the same sequence.
            targets = teacher.greedy[rows + j + 1]
            labels = target_to_draft[targets]
            # KL divergence: the cross-entropy less the target's own entropy, so a perfect draft scores 0
            # as with hard labels.
            probs = teacher.draft_probs[rows + j + 1]
            ce = (torch.xlogy(probs, probs) - probs * F.log_softmax(logits, dim=-1)).sum(dim=-1)
        in_vocab = labels >= 0
        loss = loss + step_weight_decay**j * (ce * in_vocab).sum() / in_vocab.sum().clamp(min=1)
        correct.append((draft_to_target[logits.argmax(dim=-1)] == targets).sum())
    return UnrolledResult(loss, torch.stack(correct), torch.tensor([len(rows) for rows in counted_rows]))
