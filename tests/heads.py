"""Random EAGLE-1 / EAGLE-3 heads and draft models saved in Hugging Face layout, for tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def _layer(prefix: str, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, attn_in: int, g) -> dict:
    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.08

    return {
        f"{prefix}self_attn.q_proj.weight": w(heads * head_dim, attn_in),
        f"{prefix}self_attn.k_proj.weight": w(kv_heads * head_dim, attn_in),
        f"{prefix}self_attn.v_proj.weight": w(kv_heads * head_dim, attn_in),
        f"{prefix}self_attn.o_proj.weight": w(hidden, heads * head_dim),
        f"{prefix}post_attention_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        f"{prefix}mlp.gate_proj.weight": w(inter, hidden),
        f"{prefix}mlp.up_proj.weight": w(inter, hidden),
        f"{prefix}mlp.down_proj.weight": w(hidden, inter),
    }


def save_eagle_head(path: Path, target_cfg, method: str, seed: int = 0, hidden: int | None = None,
                    draft_vocab: int | None = None, intermediate: int | None = None,
                    draft_token_ids: list[int] | None = None) -> Path:
    """A random head for target_cfg (a transformers config) in the layout vLLM loads; its MLP intermediate wide
    (default: the target's). An EAGLE-3 head drafts from draft_vocab target ids chosen at random, or from
    draft_token_ids (a head that drafts only tokens the target is likely to take has its drafts accepted)."""
    g = torch.Generator().manual_seed(seed)
    H = hidden or target_cfg.hidden_size
    heads, kv, hd = target_cfg.num_attention_heads, target_cfg.num_key_value_heads, H // target_cfg.num_attention_heads
    inter, V = intermediate or target_cfg.intermediate_size, target_cfg.vocab_size
    cfg = {"hidden_size": H, "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
           "num_hidden_layers": 1, "vocab_size": V, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": target_cfg.max_position_embeddings, "tie_word_embeddings": False}
    if method == "eagle":
        cfg["architectures"] = ["EagleLlamaForCausalLM"]
        tensors = {"fc.weight": torch.randn(H, 2 * H, generator=g) * 0.08}
        tensors.update(_layer("layers.0.", H, inter, heads, kv, hd, H, g))
    else:
        dv = len(draft_token_ids) if draft_token_ids else draft_vocab or V // 2
        layers = target_cfg.num_hidden_layers
        aux = [min(2, layers - 1), layers // 2, max(layers - 3, 0)]
        cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=dv,
                   eagle_config={"eagle_aux_hidden_state_layer_ids": aux})
        tensors = {"fc.weight": torch.randn(H, 3 * target_cfg.hidden_size, generator=g) * 0.08,
                   "midlayer.input_layernorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
                   "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
                   "norm.weight": torch.ones(H),
                   "lm_head.weight": torch.randn(dv, H, generator=g) * 0.08}
        tensors.update(_layer("midlayer.", H, inter, heads, kv, hd, 2 * H, g))
        # Draft ids map to every other target id: target = draft + d2t[draft].
        chosen = (torch.tensor(sorted(draft_token_ids)) if draft_token_ids
                  else torch.randperm(V, generator=g)[:dv].sort().values)
        tensors["d2t"] = chosen - torch.arange(dv)
        tensors["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, chosen, True)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def save_perturbed_copy(path: Path, model_dir: Path, noise: float = 0.35, seed: int = 3) -> Path:
    """The Hugging Face model at model_dir with every weight moved by noise x its std: a draft model whose
    drafts the target accepts often but not always."""
    import shutil

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(path), safe_serialization=True)
    for f in model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, path / f.name)
    return path
