"""Writing a trained head as a Hugging Face directory that our loader and vLLM's EAGLE-3 loader read.

Layout (LlamaForCausalLMEagle3): config.json with draft_vocab_size,
target_hidden_size and eagle_config.eagle_aux_hidden_state_layer_ids;
weights fc.weight, midlayer.* (unfused q/k/v and gate/up projections, as in
Hugging Face Llama), norm.weight, lm_head.weight, d2t and t2d. The token
embedding is left out: both loaders then share the target's, and the head
stays small enough to ship in a repository, in shards of a bounded size
(TrainConfig.max_shard_mb: 15 MB of tensors keeps every file under 16 MB).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specserve.errors import ConfigError
from specserve.models.arch_config import ArchConfig
from specserve.models.eagle3 import Eagle3Head
from specserve.models.export import write_safetensors
from specserve.train.vocab import DraftVocab

EXPORT_DTYPE = torch.bfloat16


def head_config(target: ArchConfig, draft_vocab_size: int, aux_layers: tuple[int, ...],
                intermediate_size: int | None = None) -> dict:
    """config.json of a one-layer EAGLE-3 head with the target's shape (its MLP intermediate_size wide, or as
    wide as the target's)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "target_hidden_size": target.hidden_size,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "rope_scaling": None if target.rope_scaling.get("rope_type", "default") == "default" else target.rope_scaling,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": target.bos_token_id,
        "eos_token_id": target.eos_token_ids[0] if len(target.eos_token_ids) == 1 else target.eos_token_ids,
        "torch_dtype": str(EXPORT_DTYPE).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers), "use_aux_hidden_state": True},
    }


def head_arch(config: dict) -> ArchConfig:
    """The head's decoder shape, read from its config.json as spec_decode/factory.py reads it (a Llama layer)."""
    return ArchConfig.from_hf_config({**config, "architectures": ["LlamaForCausalLM"]})


def check_exportable(config: dict, aux_layers: tuple[int, ...], max_shard_bytes: int) -> None:
    """Shards hold whole tensors, so each of the head's must fit in one: checked before any work is done."""
    with torch.device("meta"):
        head = Eagle3Head(head_arch(config), None, config["draft_vocab_size"], config["target_hidden_size"],
                          aux_layers)
    for name, p in head.named_parameters():
        size = p.numel() * EXPORT_DTYPE.itemsize
        if not name.startswith("embed_tokens.") and size > max_shard_bytes:
            hint = " or lower --draft-vocab-size" if name.startswith("lm_head.") else ""
            raise ConfigError("max_shard_mb", f"the head's {name} takes {size / 1e6:.1f} MB, more than a shard may "
                              f"hold ({max_shard_bytes / 1e6:.1f} MB); raise --max-shard-mb{hint}")


def hf_tensors(head: torch.nn.Module, vocab: DraftVocab) -> dict[str, torch.Tensor]:
    """The head's weights under Hugging Face names, without the (shared) token embedding."""
    cfg = head.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    splits = {"qkv_proj": (("q_proj", "k_proj", "v_proj"), [q, kv, kv]),
              "gate_up_proj": (("gate_proj", "up_proj"), [cfg.intermediate_size] * 2)}
    out = {}
    for name, p in head.named_parameters():
        if name.startswith("embed_tokens."):
            continue
        name = name.replace("layer.", "midlayer.", 1) if name.startswith("layer.") else name
        fused = name.split(".")[-2]
        if fused in splits:
            parts, sizes = splits[fused]
            for part, t in zip(parts, p.detach().split(sizes, dim=0)):
                out[name.replace(fused, part)] = t
        else:
            out[name] = p.detach()
    out = {k: v.to("cpu", EXPORT_DTYPE).contiguous() for k, v in out.items()}
    out["d2t"] = vocab.d2t
    out["t2d"] = vocab.t2d
    return out


def export_head(out: Path, head: torch.nn.Module, vocab: DraftVocab, config: dict, max_shard_bytes: int) -> list[Path]:
    """Write config.json and the safetensors shards (an index when there are several); returns the shard paths."""
    out.mkdir(parents=True, exist_ok=True)
    files = write_safetensors(out, hf_tensors(head, vocab), max_shard_bytes)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return files
