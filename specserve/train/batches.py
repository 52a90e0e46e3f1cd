"""Splitting the sequences and grouping them into padded batches.

Batches group sequences of similar length (sorted within random windows of
many batches), so little compute goes to padding, while the order of batches
and their make-up still change every epoch. Everything is a function of
(seed, epoch), so a resumed run sees exactly the batches it would have seen.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from specserve.train.data import Sequence

# Batches per window that is sorted by length before being cut into batches.
_WINDOW = 16


@dataclass
class Batch:
    """ids live where the model runs; the lengths stay on the host, which already knows them, so that
    nothing in a training step has to wait for the GPU to learn which rows count."""

    ids: torch.Tensor  # [B, L] int64, right-padded with 0
    lengths: torch.Tensor  # [B] int64, on the host
    prompt_lengths: torch.Tensor  # [B] int64, on the host

    def to(self, device) -> "Batch":
        return Batch(_to_device(self.ids, torch.device(device)), self.lengths, self.prompt_lengths)

    def counted_rows(self, steps: int) -> list[torch.Tensor]:
        """For each unrolled step j, the flat indices (b * L + i) of the rows that count there (see ttt.py):
        those from the last prompt token (i >= P - 1) on whose token to predict exists (i + j + 2 < n)."""
        row = torch.arange(self.ids.shape[1])
        starts, ends = self.prompt_lengths[:, None] - 1, self.lengths[:, None]
        per_step = [((row >= starts) & (row + j + 2 < ends)).flatten().nonzero().squeeze(1) for j in range(steps)]
        rows = _to_device(torch.cat(per_step), self.ids.device)
        return list(rows.split([len(r) for r in per_step]))


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to device without the stream sync a plain copy from pageable memory makes."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def split(sequences: list[Sequence], val_fraction: float, seed: int) -> tuple[list[Sequence], list[Sequence]]:
    """(train, validation); the validation share is drawn by seed, and stays empty for a zero fraction."""
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    n_val = int(val_fraction * len(sequences))
    return [sequences[i] for i in sorted(order[n_val:])], [sequences[i] for i in sorted(order[:n_val])]


def epoch_batches(sequences: list[Sequence], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Indices of each batch of one epoch, in the order they are trained on."""
    rng = random.Random(f"{seed}:{epoch}")
    order = list(range(len(sequences)))
    rng.shuffle(order)
    batches = []
    for w in range(0, len(order), batch_size * _WINDOW):
        window = sorted(order[w:w + batch_size * _WINDOW], key=lambda i: len(sequences[i].ids))
        batches += [window[b:b + batch_size] for b in range(0, len(window), batch_size)]
    rng.shuffle(batches)
    return batches


def collate(sequences: list[Sequence], length_multiple: int = 1) -> Batch:
    """Right-padded to the longest sequence, rounded up to length_multiple (GPU kernels that plan
    per shape then see a few dozen shapes rather than one per batch)."""
    lengths = [len(s.ids) for s in sequences]
    width = -(-max(lengths) // length_multiple) * length_multiple
    ids = torch.zeros(len(sequences), width, dtype=torch.int64)
    for row, s in enumerate(sequences):
        ids[row, : lengths[row]] = torch.tensor(s.ids)
    return Batch(ids, torch.tensor(lengths), torch.tensor([len(s.prompt_ids) for s in sequences]))

