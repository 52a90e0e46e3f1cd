"""EAGLE-1 draft head (vLLM's EagleLlamaForCausalLM layout).

fc maps concat(token embedding, target hidden state) to the hidden size, then
one Llama decoder layer whose input norm is omitted. Embedding and lm_head
are the target's unless the checkpoint carries its own.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from specserve.distributed.parallel_state import TPGroup
from specserve.models.arch_config import ArchConfig
from specserve.models.layers import RotaryEmbedding
from specserve.models.llama import SINGLE, DecoderLayer
from specserve.models.parallel_layers import head_shard, shard_arch
from specserve.models.weight_loading import load_hf_weights


class EagleHead(nn.Module):
    # Hidden states of the target that the head reads: its final (normed) output.
    aux_hidden_layers: tuple[int, ...] = ()

    def __init__(self, cfg: ArchConfig, backend, fc_bias: bool = False, tp: TPGroup = SINGLE):
        """cfg: the head's whole architecture; with tp of several ranks its decoder layer is rank tp.rank's
        shard, as the target's layers are, and the embedding, fc and lm_head are whole."""
        super().__init__()
        self.whole_cfg, self.tp = cfg, tp
        # The rank's architecture: what the layer, weight loading and the head's KV cache are sized by.
        self.cfg = cfg = shard_arch(cfg, tp)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layer = DecoderLayer(cfg, backend, tp)
        self.layer.input_layernorm = nn.Identity()
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids, positions, hidden, kv_cache, metadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden state fed back to the next draft step, hidden state for the logits)."""
        x = self.fc(torch.cat((self.embed_tokens(input_ids), hidden), dim=-1))
        out, residual = self.layer(x, positions, self.rotary, kv_cache, metadata)
        h = out + residual
        return h, h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                return None
            return name.replace("layers.0.", "layer.", 1) if name.startswith("layers.0.") else name

        return load_hf_weights(self, weights, self.cfg, rename, optional=("embed_tokens", "lm_head"),
                               shard=head_shard(self.whole_cfg, self.tp))
