"""An EAGLE-3 head beside its target outside the engine, as training runs it: for scripts that score a head's
drafts along known answers (benchmarks/tree_acceptance_bound.py, head_accuracy_by_prompts.py,
sampled_tree_bound.py)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specserve.heads import resolve_head
from specserve.spec_decode.config import SpeculativeConfig
from specserve.spec_decode.factory import load_head
from specserve.train.attention import UnrolledAttention
from specserve.train.features import TargetFeatures, plain_torch


def head_beside_target(target: str, head: str) -> tuple[TargetFeatures, torch.nn.Module]:
    """The target's features (the auxiliary layers the head reads) and the head (a directory or a shipped head's
    name) in plain torch, on the CPU in float32, ready for train.ttt.unroll."""
    head_dir = resolve_head(head)
    config = json.loads((Path(head_dir) / "config.json").read_text())
    features = TargetFeatures(target, tuple(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
                              torch.float32, "cpu")
    spec = SpeculativeConfig.parse({"method": "eagle3", "model": head_dir, "num_speculative_tokens": 1})
    model = load_head(spec, features.model, features.arch, UnrolledAttention())
    plain_torch(model)
    return features, model
