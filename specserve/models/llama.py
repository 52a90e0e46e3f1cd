"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) over a paged KV cache.

Parameter names follow Hugging Face's, except that q/k/v and gate/up are
stored fused; `load_weights` takes Hugging Face names and does the fusing.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from specserve.attention.backend import AttentionBackend
from specserve.attention.metadata import AttentionMetadata
from specserve.errors import ModelLoadError
from specserve.models.arch_config import ArchConfig
from specserve.models.layers import GatedMLP, RMSNorm, RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.backend = backend
        self.scale = self.head_dim**-0.5

    def forward(self, x, positions, rotary: RotaryEmbedding, kv_cache, metadata: AttentionMetadata):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, positions, rotary, kv_cache, metadata):
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, kv_cache, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)


class LlamaForCausalLM(nn.Module):
    # Hugging Face names that are stored as a slice of one of our fused parameters.
    _FUSED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, aux_hidden_layers: tuple[int, ...] = ()):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, backend)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        # Layers whose input hidden states a speculator (EAGLE-3) reads from the same forward pass.
        self.aux_hidden_layers = aux_hidden_layers

    def tie_weights(self) -> None:
        """Share the embedding with lm_head; again after any move that makes new parameters (to_empty)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final-norm hidden states [num_tokens, hidden] and the auxiliary hidden states asked for."""
        x = self.model.embed_tokens(input_ids)
        aux = []
        for i, layer in enumerate(self.model.layers):
            if i in self.aux_hidden_layers:
                aux.append(x)
            x = layer(x, positions, self.model.rotary, kv_caches[i], metadata)
        return self.model.norm(x), aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        shard_sizes = {
            "qkv_proj": [self.cfg.num_heads * self.cfg.head_dim] + [self.cfg.num_kv_heads * self.cfg.head_dim] * 2,
            "gate_up_proj": [self.cfg.intermediate_size] * 2,
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            parts = name.split(".")
            target = name
            shard = None
            for i, p in enumerate(parts):
                if p in self._FUSED:
                    fused, shard = self._FUSED[p]
                    target = ".".join(parts[:i] + [fused] + parts[i + 1:])
                    break
            if target not in params:
                raise ModelLoadError(f"weight {name!r} does not belong to a {self.cfg.architecture}; is the config right?")
            param = params[target]
            if shard is None:
                dst = param.data
            else:
                sizes = shard_sizes[target.split(".")[-2]]
                offset = sum(sizes[:shard])
                dst = param.data.narrow(0, offset, sizes[shard])
            if dst.shape != tensor.shape:
                raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(f"{target}#{shard}")
        expected = set()
        for pname, _ in self.named_parameters():
            leaf = pname.split(".")[-2] if pname.count(".") else ""
            if leaf in shard_sizes:
                expected.update(f"{pname}#{i}" for i in range(len(shard_sizes[leaf])))
            else:
                expected.add(f"{pname}#None")
        missing = sorted(expected - loaded)
        if missing:
            raise ModelLoadError(
                f"the checkpoint lacks {len(missing)} weights, e.g. {missing[0].split('#')[0]}; the file may be "
                "truncated or of another model"
            )
