"""Where a train-eagle optimizer step's time goes on the GPU (torch.profiler), on a SmolLM2-shaped target
with random weights and random sequences of the run's usual lengths.

    python benchmarks/profile_train_step.py [--batch-size 32] [--length 450] [--ttt-steps 6] [--steps 20]
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from specserve.models.arch_config import ArchConfig
from specserve.models.eagle3 import default_aux_layers
from specserve.models.loader import build_model, open_model_source
from specserve.train.attention import CausalAttention
from specserve.train.config import TrainConfig
from specserve.train.data import Sequence
from specserve.train.export import head_arch, head_config
from specserve.train.features import TargetFeatures, attention_in_torch
from specserve.train.trainer import Trainer, build_head
from specserve.train.vocab import build_draft_vocab

SMOLLM2 = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
               max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


class RandomFeatures(TargetFeatures):
    def __init__(self, path: str, aux_layers):
        self.model, self.arch = build_model(open_model_source(path), torch.bfloat16, "cuda", CausalAttention(),
                                            aux_layers, load_format="dummy")
        attention_in_torch(self.model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--length", type=int, default=450)
    ap.add_argument("--ttt-steps", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20, help="steps timed")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    (root / "config.json").write_text(json.dumps(SMOLLM2))
    from specserve.bench.models import _save_tokenizer

    _save_tokenizer(root, SMOLLM2["vocab_size"])
    target = ArchConfig.from_hf_config(SMOLLM2)
    aux = default_aux_layers(target.num_layers)
    rng = random.Random(0)
    seqs = [Sequence([rng.randrange(49152) for _ in range(60)],
                     [rng.randrange(49152) for _ in range(a.length - 60 + rng.randrange(-200, 200))], 0.0)
            for _ in range(a.batch_size * 4)]
    vocab = build_draft_vocab([s.response_ids for s in seqs], 49152, 8192)
    cfg = TrainConfig(target=str(root), out=str(root / "out"), device="cuda", batch_size=a.batch_size,
                      ttt_steps=a.ttt_steps, progress=False)
    features = RandomFeatures(str(root), aux)
    head = build_head(target, head_arch(head_config(target, vocab.size, aux)), vocab, aux, features.model,
                      "cuda", 0, cfg.warm_start)
    trainer = Trainer(cfg, features, head, vocab, seqs, [], {})
    # Batches of different lengths, as in a real run (shape-specialised kernels replan per shape).
    batches = [seqs[i::4][: a.batch_size] for i in range(4)]
    for i in range(4):
        trainer.train_step(batches[i % 4]).read()
    torch.cuda.synchronize()
    start, previous = time.perf_counter(), None
    for i in range(a.steps):
        # As Trainer.run does: each step's figures are read once the next step is queued.
        queued = trainer.train_step(batches[i % 4])
        if previous is not None:
            previous.read()
        previous = queued
    torch.cuda.synchronize()
    print(f"train step: {(time.perf_counter() - start) / a.steps * 1e3:.1f} ms over {a.steps} steps (batch "
          f"{a.batch_size} x ~{a.length} tokens, {a.ttt_steps} unrolled steps)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        trainer.train_step(batches[0])
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
