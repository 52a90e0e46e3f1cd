"""A Llama's shard on one rank of a tensor-parallel group (docs/design.md, 'Tensor parallelism').

Column-parallel projections (the fused qkv by heads, the fused gate/up by columns) keep their rank's
output rows; row-parallel ones (o_proj, down_proj) their input columns, so each rank's output is a
partial sum that the decoder layer all-reduces. The vocabulary is padded to a multiple of the group's
size and split evenly: the embedding looks up its rank's ids and all-reduces, lm_head all-gathers its
rank's logits. Fewer KV heads than ranks are replicated: rank r keeps KV head r // (size / kv heads).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed.communication import all_gather_last_dim, all_reduce
from specserve.distributed.parallel_state import TPGroup
from specserve.errors import ConfigError
from specserve.models.arch_config import ArchConfig


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError("tensor_parallel_size", message)


def shard_arch(arch: ArchConfig, tp: TPGroup) -> ArchConfig:
    """The architecture one rank computes: its share of the heads and of the MLP's columns. The vocabulary
    stays whole (the vocabulary-parallel layers split it themselves). Raises ConfigError naming the fix."""
    n = tp.size
    _need(arch.num_heads % n == 0, f"{n} does not divide the model's {arch.num_heads} attention heads; "
          "choose a tensor_parallel_size that does")
    _need(arch.intermediate_size % n == 0, f"{n} does not divide the model's MLP size {arch.intermediate_size}; "
          "choose a tensor_parallel_size that does")
    kv = arch.num_kv_heads
    _need(kv % n == 0 or n % kv == 0, f"{n} neither divides the model's {kv} KV heads nor is a multiple of them; "
          "choose a tensor_parallel_size that does one of these")
    return dataclasses.replace(arch, num_heads=arch.num_heads // n, num_kv_heads=max(1, kv // n),
                               intermediate_size=arch.intermediate_size // n)


def vocab_shard(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    """(first id, count) of the rank's part of the vocabulary padded to a multiple of the group's size."""
    count = -(-vocab_size // tp.size)
    return tp.rank * count, count


def shard_weight(name: str, part: int | None, tensor: torch.Tensor, arch: ArchConfig, tp: TPGroup) -> torch.Tensor:
    """The rank's slice of a checkpoint tensor: `name` is our parameter's, `part` its index in a fused
    parameter (q, k, v; gate, up), arch the whole model's."""
    leaf = name.split(".")[-2] if "." in name else ""
    if name.endswith(".input_scale") or (name.endswith(".weight_scale")
                                         and (tensor.numel() == 1 or leaf in ("o_proj", "down_proj"))):
        # The input's scale, one for a whole tensor, or a row-parallel layer's per-row scales: each rank keeps
        # every output row (and the whole input is scaled alike), so these stay whole. A column-parallel
        # layer's per-row scales split with its rows, below.
        return tensor
    if leaf == "qkv_proj" and part in (1, 2):
        kv, per_rank = arch.num_kv_heads, max(1, arch.num_kv_heads // tp.size)
        first = tp.rank * per_rank if kv >= tp.size else tp.rank // (tp.size // kv)
        return tensor.narrow(0, first * arch.head_dim, per_rank * arch.head_dim)
    if leaf in ("qkv_proj", "gate_up_proj"):
        return tensor.chunk(tp.size, 0)[tp.rank]
    if leaf in ("o_proj", "down_proj"):
        return tensor.chunk(tp.size, 1)[tp.rank]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        first, count = vocab_shard(arch.vocab_size, tp)
        return F.pad(tensor, (0, 0, 0, count * tp.size - arch.vocab_size)).narrow(0, first, count)
    return tensor


class TargetEmbedding(nn.Embedding):
    """The target's token embedding. The loader builds the target on the meta device and fills every weight from
    the checkpoint or its dummy initialisation (models/loader.py), so this one never initialises its own:
    nn.Embedding's normal_ on the meta device imports torch._dynamo, seconds of every engine process's start (a
    server's core, each tensor-parallel rank)."""

    def reset_parameters(self) -> None:
        pass


class VocabParallelEmbedding(TargetEmbedding):
    """The rank's rows of the padded embedding; ids of other ranks look up zeros, and the sum over ranks is
    the whole embedding's."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        self.first, count = vocab_shard(vocab_size, tp)
        super().__init__(count, hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Linear):
    """The rank's rows of the padded lm_head; forward returns every rank's logits, the padding cut off."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup):
        super().__init__(hidden_size, vocab_shard(vocab_size, tp)[1], bias=False)
        self.vocab_size, self.tp_size = vocab_size, tp.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(super().forward(x), self.tp_size)[..., :self.vocab_size]


def head_shard(arch: ArchConfig, tp: TPGroup):
    """load_hf_weights's `shard` for a draft head sharded like the target (arch: the head's whole architecture):
    its decoder layer ("layer.") is cut as the target's layers are; its embedding, fc and lm_head stay whole on
    every rank, so every rank computes the same logits and picks the same drafts. None on one rank."""
    if tp.size == 1:
        return None
    return lambda name, part, tensor: shard_weight(name, part, tensor, arch, tp) if name.startswith("layer.") else tensor
