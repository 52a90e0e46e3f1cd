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


def test_a_warm_started_head_reads_the_targets_late_layer_through_its_lm_head(tiny_llama):
    from specserve.models.arch_config import ArchConfig
    from specserve.models.loader import open_model_source
    from specserve.train.export import head_arch, head_config
    from specserve.train.trainer import build_head
    from specserve.train.vocab import build_draft_vocab

    path, hf = tiny_llama
    target = ArchConfig.from_hf_config(open_model_source(str(path)).hf_config)
    vocab = build_draft_vocab([list(range(3, 40))], target.vocab_size, 16)
    features = TargetFeatures(str(path), (0, 1), torch.float32, "cpu")
    arch = head_arch(head_config(target, vocab.size, (0, 1)))
    head = build_head(target, arch, vocab, (0, 1), features.model, "cpu", 0, warm_start=True)
    torch.testing.assert_close(head.lm_head.weight, hf.lm_head.weight[vocab.draft_to_target])
    torch.testing.assert_close(head.norm.weight, hf.model.norm.weight)
    aux = torch.randn(3, 2 * target.hidden_size)
    torch.testing.assert_close(head.fc(aux), aux[:, target.hidden_size:])
    cold = build_head(target, arch, vocab, (0, 1), features.model, "cpu", 0, warm_start=False)
    assert not torch.equal(cold.lm_head.weight, head.lm_head.weight)
