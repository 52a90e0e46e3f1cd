"""The target's teacher-forced outputs that training reads, against transformers on the same weights."""
from __future__ import annotations

import torch

from single_thread import one_thread  # noqa: F401  (autouse)
from specserve.train.batches import collate
from specserve.train.data import Sequence
from specserve.train.features import TargetFeatures


def test_next_tokens_are_the_targets_own_predictions(tiny_llama):
    path, hf = tiny_llama
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(torch.randint(3, vocab, (4,), generator=g).tolist(),
                     torch.randint(3, vocab, (n,), generator=g).tolist(), 0.0) for n in (9, 5)]
    batch = collate(seqs)
    features = TargetFeatures(str(path), (0, 1), torch.float32, "cpu")
    draft_to_target = torch.arange(3, vocab, 2)
    states = features(batch)
    got = features.next_tokens(states.final, draft_to_target)
    width = batch.ids.shape[1]
    for b, s in enumerate(seqs):
        with torch.no_grad():
            logits = hf(torch.tensor([s.ids])).logits[0].double()
        rows = slice(b * width, b * width + len(s.ids))
        assert got.greedy[rows].tolist() == logits.argmax(dim=-1).tolist()
        want = torch.softmax(logits[:, draft_to_target], dim=-1)
        torch.testing.assert_close(got.draft_probs[rows].double(), want, atol=1e-5, rtol=1e-4)
