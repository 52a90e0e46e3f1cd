"""The collectives of one target step alone, for the benchmark's all-reduce time per step: every rank
replays the same all-reduces and all-gather as a step of the same size runs (the embedding's, two per
layer, lm_head's), on buffers of the same shapes and dtype, back to back with nothing between them. Inside
a step each of them waits for the layer before it and the next layer waits for it, so none overlaps other
work: their time alone is what they cost the step (no profiler needed, and the same on gloo and NCCL)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specserve.distributed.communication import all_gather_last_dim, all_reduce
from specserve.models.parallel_layers import vocab_shard


@dataclass
class CollectiveProbe:
    """Replay the collectives of a step of num_tokens tokens whose lm_head runs over logits_rows rows,
    `repeats` times after one untimed replay (rank 0 sends it to the others, which answer nothing)."""

    num_tokens: int
    logits_rows: int
    repeats: int


def replay_collectives(model, probe: CollectiveProbe) -> float:
    """Seconds per replay of the probe's collectives on this rank (model: the rank's shard of the target)."""
    whole, tp = model.whole_cfg, model.tp
    weight = model.lm_head.weight
    hidden = torch.zeros(probe.num_tokens, whole.hidden_size, dtype=weight.dtype, device=weight.device)
    logits = torch.zeros(probe.logits_rows, vocab_shard(whole.vocab_size, tp)[1], dtype=weight.dtype,
                         device=weight.device)

    def replay() -> None:
        all_reduce(hidden)  # the embedding's
        for _ in range(2 * whole.num_layers):  # after attention, after the MLP
            all_reduce(hidden)
        if probe.logits_rows:
            all_gather_last_dim(logits, tp.size)

    replay()
    _sync(weight.device)
    start = time.perf_counter()
    for _ in range(probe.repeats):
        replay()
    _sync(weight.device)
    return (time.perf_counter() - start) / probe.repeats


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_collective_seconds(core, num_tokens: int, logits_rows: int, repeats: int = 20) -> float:
    """Seconds of the collectives of one step of core (an EngineCore at tensor_parallel_size > 1), every rank
    replaying them together."""
    probe = CollectiveProbe(num_tokens, logits_rows, repeats)
    core.tp_workers.send_step(probe)
    return replay_collectives(core.model, probe)
