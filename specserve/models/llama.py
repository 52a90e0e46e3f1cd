"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) over a paged KV cache.

Parameter names follow Hugging Face's, except that q/k/v and gate/up are
stored fused; `load_weights` takes Hugging Face names and does the fusing.

Layers follow vLLM's form: the residual stream travels beside each layer's
output and the next norm adds them, so that on the GPU the add and the norm
are one kernel.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from specserve.attention.backend import AttentionBackend
from specserve.attention.kv_quant import KVScales
from specserve.attention.metadata import AttentionMetadata
from specserve.distributed.communication import all_reduce
from specserve.distributed.parallel_state import TPGroup
from specserve.sample.argmax import greedy_argmax
from specserve.sample.token_bitmask import TokenMask
from specserve.models.arch_config import ArchConfig
from specserve.models.layers import (FusableModule, GatedMLP, RMSNorm, RotaryEmbedding, add_and_norm, folds_fp8_norm,
                                     folds_norm, fuses_neighbours, output_projection, prologue_args)
from specserve.models.parallel_layers import (ParallelLMHead, TargetEmbedding, VocabParallelEmbedding, shard_arch,
                                             shard_weight)
from specserve.models.weight_loading import load_hf_weights

SINGLE = TPGroup(0, 1)


class Attention(FusableModule):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, input_size: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(input_size or cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.backend = backend
        self.scale = self.head_dim**-0.5
        # What an FP8 KV cache stores keys and values divided by (docs/design.md, 'FP8 KV cache').
        self.kv_scales = KVScales()

    def forward_prenorm(self, norm: nn.Module, x, residual, positions, rotary: RotaryEmbedding, kv_cache,
                        metadata: AttentionMetadata):
        """(self(norm(x + residual), ...), x + residual), as add_and_norm. At small M the norm folds into one
        kernel with the qkv projection, its bias, rotary and the KV-cache write (not with a per-head q/k norm);
        before an FP8 qkv projection it writes the projection's quantized input (folds_fp8_norm)."""
        if not self.qk_norm and folds_norm(self, norm, self.qkv_proj, x):
            out, total = self._qkv_kernel_and_attend(x, positions, rotary, kv_cache, metadata,
                                                     **prologue_args(norm, residual))
            return out, x if total is None else total
        if folds_fp8_norm(norm, self.qkv_proj):
            rows, residual = norm.forward_fp8_rows(x, residual)
            return self._attend_projected(self.qkv_proj.forward_rows(rows), positions, rotary, kv_cache,
                                          metadata), residual
        x, residual = add_and_norm(norm, x, residual)
        return self(x, positions, rotary, kv_cache, metadata), residual

    def _qkv_kernel_and_attend(self, x, positions, rotary: RotaryEmbedding, kv_cache, metadata: AttentionMetadata,
                               **kernel_args):
        """(attention output, x + residual or None): the small-M qkv kernel (with prologue's norm, see
        prologue_args) writes the cache, then _attend_cached."""
        from specserve.kernels.qkv_rotary_cache import qkv_rotary_cache

        q, total = qkv_rotary_cache(x, self.qkv_proj.weight, positions, rotary.cos, rotary.sin, kv_cache,
                                    metadata.slot_mapping, self.num_heads, bias=self.qkv_proj.bias,
                                    scales=self.kv_scales, **kernel_args)
        return self._attend_cached(q, kv_cache, metadata), total

    def _attend_cached(self, q, kv_cache, metadata: AttentionMetadata):
        """The fused path after the KV-cache write: attention of q over the cache, then o_proj."""
        out = self.backend.attend(q, kv_cache, metadata, self.scale, self.kv_scales)
        return output_projection(self, self.o_proj, out.reshape(-1, self.q_size))

    def forward(self, x, positions, rotary: RotaryEmbedding, kv_cache, metadata: AttentionMetadata):
        if not self.qk_norm and fuses_neighbours(self, self.qkv_proj, x):
            # An input normed already (an EAGLE head's layer): the qkv kernel without its prologue.
            return self._qkv_kernel_and_attend(x, positions, rotary, kv_cache, metadata)[0]
        return self._attend_projected(self.qkv_proj(x), positions, rotary, kv_cache, metadata)

    def _attend_projected(self, qkv, positions, rotary: RotaryEmbedding, kv_cache, metadata: AttentionMetadata):
        """Attention over the qkv projection's output, then o_proj."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.fused:
            rotary.rotate_and_cache(positions, q, k, v, kv_cache, metadata.slot_mapping, self.kv_scales)
            return self._attend_cached(q, kv_cache, metadata)
        q, k = rotary(positions, q, k)
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.scale, self.kv_scales)
        return self.o_proj(out.reshape(-1, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, tp: TPGroup = SINGLE):
        super().__init__()
        # Sharded, attention's and the MLP's outputs are each rank's partial sums (models/parallel_layers.py).
        self.sharded = tp.size > 1
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, positions, rotary, kv_cache, metadata, residual=None):
        """(MLP output, residual stream before it): their sum is the layer's output.

        x is the layer's input, or with residual given, the previous layer's MLP output. Each norm (with
        the residual add) runs in the sublayer's forward_prenorm, which folds it into the projection after
        it where that pays.
        """
        x, residual = self.self_attn.forward_prenorm(self.input_layernorm, x, residual, positions, rotary,
                                                     kv_cache, metadata)
        if self.sharded:
            x = all_reduce(x)
        x, residual = self.mlp.forward_prenorm(self.post_attention_layernorm, x, residual)
        return (all_reduce(x) if self.sharded else x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, tp: TPGroup = SINGLE):
        """cfg: the rank's shard of the architecture (shard_arch) when tp has several ranks."""
        super().__init__()
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp) if tp.size > 1
                             else TargetEmbedding(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, aux_hidden_layers: tuple[int, ...] = (),
                 tp: TPGroup = SINGLE):
        """cfg: the whole model's architecture; with tp of several ranks this module is rank tp.rank's shard."""
        super().__init__()
        self.tp = tp
        self.whole_cfg = cfg
        # The rank's architecture: what its modules, weight loading and KV cache are sized by.
        self.cfg = cfg = shard_arch(cfg, tp)
        self.model = LlamaModel(cfg, backend, tp)
        self.lm_head = (ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp) if tp.size > 1
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
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
        x, residual = self.model.embed_tokens(input_ids), None
        saved = {}
        for i, layer in enumerate(self.model.layers):
            if i in self.aux_hidden_layers:
                # The layer's input, as a tensor of its own: the layer's fused norm writes over x.
                saved[i] = x if residual is None else x + residual
            x, residual = layer(x, positions, self.model.rotary, kv_caches[i], metadata, residual)
        # Added apart, not fused into the final norm, which so keeps returning one tensor (tests hook
        # model.norm); the cost is one small add a forward.
        return self.model.norm(x + residual), [saved[i] for i in self.aux_hidden_layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor, captured: bool = False,
                      mask: TokenMask | None = None) -> torch.Tensor:
        """compute_logits(hidden).argmax(-1) without the float32 copy (the conversion keeps the order), over the
        tokens mask allows (a grammar's). captured: the call is being recorded into a CUDA graph."""
        logits = self.lm_head(hidden)
        if mask is not None:
            mask.apply(logits)
        return greedy_argmax(logits, captured)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                return None
            return name

        whole, tp = self.whole_cfg, self.tp
        shard = (lambda name, part, t: shard_weight(name, part, t, whole, tp)) if tp.size > 1 else None
        load_hf_weights(self, weights, self.cfg, rename, shard=shard)
