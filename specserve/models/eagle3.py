"""EAGLE-3 draft head (the layout vLLM's Eagle3LlamaForCausalLM loads).

The target hands over hidden states from three of its layers; fc maps their
concatenation (3H) to H at draft position 0. The decoder layer attends over
concat(norm(token embedding), norm(hidden)) (2H wide), and the head has its
own final norm and an lm_head over a smaller draft vocabulary; d2t maps a
draft id to a target id (target = draft + d2t[draft]).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from specserve.distributed.communication import all_reduce
from specserve.distributed.parallel_state import TPGroup
from specserve.sample.argmax import greedy_argmax
from specserve.models.arch_config import ArchConfig
from specserve.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, folds_norm, prologue_args, small_m
from specserve.models.llama import SINGLE, Attention
from specserve.models.parallel_layers import head_shard, shard_arch
from specserve.models.weight_loading import load_hf_weights


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """Early, middle and late layers, as EAGLE-3 trains with (inputs of these layers)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: ArchConfig, backend, tp: TPGroup = SINGLE):
        """cfg: the rank's shard of the head's architecture when tp has several ranks."""
        super().__init__()
        # Sharded, attention's and the MLP's outputs are each rank's partial sums, as DecoderLayer's.
        self.sharded = tp.size > 1
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, input_size=2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def attention_input(self, embed: nn.Embedding, input_ids: torch.Tensor, hidden: torch.Tensor,
                        hidden_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(concat(norm(embedding of input_ids), norm(h)) [M, 2H], h): h is hidden, or its rows hidden_rows (a
        tree's drafts read their parents' states); one kernel on the fused path."""
        if self.input_layernorm.fused:
            from specserve.kernels.eagle3_input import eagle3_layer_input

            return eagle3_layer_input(input_ids, embed.weight, hidden, self.input_layernorm.weight,
                                      self.hidden_norm.weight, self.input_layernorm.eps, hidden_rows)
        if hidden_rows is not None:
            hidden = hidden.index_select(0, hidden_rows)
        return torch.cat((self.input_layernorm(embed(input_ids)), self.hidden_norm(hidden)), dim=-1), hidden

    def forward(self, embed, input_ids, hidden, positions, rotary, kv_cache, metadata, hidden_rows=None):
        """(MLP output, residual stream before it), as DecoderLayer; hidden_rows: see attention_input."""
        x, hidden = self.attention_input(embed, input_ids, hidden, hidden_rows)
        x = self.self_attn(x, positions, rotary, kv_cache, metadata)
        if self.sharded:
            x = all_reduce(x)
        x, residual = self.mlp.forward_prenorm(self.post_attention_layernorm, x, hidden)
        return (all_reduce(x) if self.sharded else x), residual


class Eagle3Head(nn.Module):
    def __init__(self, cfg: ArchConfig, backend, draft_vocab_size: int, target_hidden_size: int,
                 aux_hidden_layers: tuple[int, ...], tp: TPGroup = SINGLE):
        """cfg: the head's whole architecture; with tp of several ranks its decoder layer is rank tp.rank's
        shard (heads and MLP columns, as the target's), and the embedding, fc, norms and lm_head are whole."""
        super().__init__()
        self.whole_cfg, self.tp = cfg, tp
        # The rank's architecture: what the layer, weight loading and the head's KV cache are sized by.
        self.cfg = cfg = shard_arch(cfg, tp)
        self.aux_hidden_layers = aux_hidden_layers
        self.draft_vocab_size = draft_vocab_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(len(aux_hidden_layers) * target_hidden_size, cfg.hidden_size, bias=False)
        self.layer = Eagle3Layer(cfg, backend, tp)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        # target id of each draft id (arange + d2t), and whether they ascend (set by load_weights)
        self.register_buffer("target_ids", torch.arange(draft_vocab_size, dtype=torch.int64), persistent=False)
        self.target_ids_ascend = True
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids, positions, hidden, kv_cache, metadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-norm hidden fed back to the next draft step, normed hidden for the logits)."""
        normed, h = self.norm(*self._layer(input_ids, positions, hidden, kv_cache, metadata))
        return h, normed

    def greedy_step(self, input_ids, positions, hidden, kv_cache, metadata,
                    captured: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-norm hidden fed back, greedy_tokens of the normed hidden): forward and greedy_tokens, where
        the small-M path runs the final norm, the lm_head and the argmax as one projection and a pick."""
        out, residual = self._layer(input_ids, positions, hidden, kv_cache, metadata)
        if self.target_ids_ascend and folds_norm(self.norm, self.norm, self.lm_head, out):
            from specserve.kernels.fused_linear import fused_linear_argmax

            tokens, h = fused_linear_argmax(out, self.lm_head.weight, token_map=self.target_ids,
                                            **prologue_args(self.norm, residual))
            return h, tokens
        normed, h = self.norm(out, residual)
        return h, self.greedy_tokens(normed, captured)

    def tree_step(self, input_ids, positions, hidden, hidden_rows, kv_cache, metadata, k: int,
                  scatter) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-norm hidden fed back, scatter's out): the pass over one depth of a tree of drafts
        (tree_drafting.py), each draft reading its parent's state hidden[hidden_rows], then top_tokens of
        its normed hidden sent where scatter says; on the small-M path the final norm runs in the lm_head's
        prologue, as in greedy_step."""
        out, residual = self._layer(input_ids, positions, hidden, kv_cache, metadata, hidden_rows)
        if self.target_ids_ascend and folds_norm(self.norm, self.norm, self.lm_head, out):
            from specserve.kernels.fused_linear import fused_linear_topk

            tokens, h = fused_linear_topk(out, self.lm_head.weight, k, token_map=self.target_ids, scatter=scatter,
                                          **prologue_args(self.norm, residual))
            return h, tokens
        normed, h = self.norm(out, residual)
        return h, self.top_tokens(normed, k, scatter)

    def _layer(self, input_ids, positions, hidden, kv_cache, metadata,
               hidden_rows=None) -> tuple[torch.Tensor, torch.Tensor]:
        if hidden.shape[-1] != self.cfg.hidden_size:
            hidden = self.fc(hidden)  # draft position 0: the target's auxiliary hidden states
        return self.layer(self.embed_tokens, input_ids, hidden, positions, self.rotary, kv_cache, metadata,
                          hidden_rows)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocabulary; tokens outside the draft vocabulary get -inf."""
        draft = self.lm_head(h).float()
        full = torch.full((h.shape[0], self.cfg.vocab_size), float("-inf"), device=h.device)
        return full.index_copy_(1, self.target_ids, draft)

    def greedy_tokens(self, h: torch.Tensor, captured: bool = False) -> torch.Tensor:
        """compute_logits(h).argmax(-1) without the full-vocabulary float32 logits: the argmax over the draft
        vocabulary, mapped to target ids (at small M one projection with the argmax in its epilogue, and a
        pick). Ties go to the lowest target id either way while draft ids map to ascending target ids (as
        train-eagle writes them); otherwise this takes the full logits.
        captured: the call is being recorded into a CUDA graph (see greedy_argmax)."""
        if not self.target_ids_ascend:
            return greedy_argmax(self.compute_logits(h), captured)
        if small_m(self.norm, h):
            from specserve.kernels.fused_linear import fused_linear_argmax

            return fused_linear_argmax(h, self.lm_head.weight, token_map=self.target_ids)[0]
        return self.target_ids.index_select(0, greedy_argmax(self.lm_head(h), captured))

    def top_tokens(self, h: torch.Tensor, k: int, scatter=None) -> torch.Tensor:
        """[n, k] target ids of the k best draft-vocabulary logits, best first: at small M one projection keeping
        each program's best columns, and a pick (torch.topk walks the vocabulary in few programs).
        Ties go to the lowest target id there, as greedy_tokens's do. scatter (kernels/pick_scatter.py): send
        them where it says instead, and return its out."""
        if self.target_ids_ascend and small_m(self.norm, h):
            from specserve.kernels.fused_linear import fused_linear_topk

            return fused_linear_topk(h, self.lm_head.weight, k, token_map=self.target_ids, scatter=scatter)[0]
        top = self.target_ids[self.lm_head(h).topk(k, dim=-1).indices]
        return top if scatter is None else scatter.apply(top)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            name = name.removeprefix("model.")
            if name in ("d2t", "t2d") or "rotary_emb" in name:
                return None
            for prefix in ("midlayer.", "layers.0."):
                if name.startswith(prefix):
                    return "layer." + name[len(prefix):]
            return name

        weights = list(weights)
        d2t = [t for n, t in weights if n == "d2t"]
        if d2t:
            self.d2t.copy_(d2t[0].to(torch.int64))
        self.target_ids.copy_(torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t)
        self.target_ids_ascend = bool((self.target_ids[1:] > self.target_ids[:-1]).all())
        return load_hf_weights(self, weights, self.cfg, rename, optional=("embed_tokens",),
                               shard=head_shard(self.whole_cfg, self.tp))
