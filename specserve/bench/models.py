"""What the decode benchmark runs on: model shapes with random weights, the real model from its files,
random EAGLE-3 heads, and the transformers model beside them."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.models.eagle3 import default_aux_layers
from specserve.models.export import write_hf_directory
from specserve.models.loader import hf_named_weights, open_model_source

# Shapes benchmarked with random weights: speed depends on shapes and dtype, not on values.
SHAPES: dict[str, dict] = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
    # SmolLM2-135M's shape, for speed without its GGUF at hand (the real model is `smollm2-135m`).
    "smollm2-shape": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                          rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    # Qwen2.5-32B's shape (qkv bias, as Qwen2's), for tensor parallelism: 64 GB of bf16 weights.
    "qwen2.5-32b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=5120,
                        intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                        vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
    # Four layers: the fewest that leave EAGLE-3's default auxiliary layers (2, L/2, L-3) inside the model.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5,
                 rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
}
# EAGLE-3 heads for Llama 3 predict over the 32000 most frequent target tokens.
DRAFT_VOCAB = 32000
INIT_STD = 0.02


@dataclass
class BenchModel:
    """One model of the benchmark, ready for EngineConfig (model=path, load_format=...)."""

    name: str
    path: str
    load_format: str
    hf_config: dict

    @property
    def random_weights(self) -> bool:
        return self.load_format == "dummy"


def prepare_model(name: str, root: Path, dtype: torch.dtype) -> BenchModel:
    """A shape name becomes a directory with config.json and a tokenizer, no weights (the engine makes
    them with load_format='dummy'); anything else is a model name or path loaded from its files."""
    path = root / name.replace("/", "_")
    if name not in SHAPES:
        source = open_model_source(name)
        if source.is_gguf:
            # Parsing the GGUF costs seconds per engine and the benchmark builds about ten: its weights,
            # dequantized and cast as the engine would, are read once and kept as a Hugging Face directory.
            return BenchModel(name, str(write_hf_directory(source, path, dtype)), "auto", source.hf_config)
        return BenchModel(name, name, "auto", source.hf_config)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPES[name]}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    _save_tokenizer(path, cfg["vocab_size"])
    return BenchModel(name, str(path), "dummy", cfg)


def _save_tokenizer(path: Path, vocab_size: int) -> None:
    # One word per token id, so that every id the random model emits detokenizes, at a cost per token
    # like a real tokenizer's.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(path))


def write_random_eagle3_head(path: Path, target_cfg: dict, dtype: torch.dtype, device: str, seed: int = 0) -> Path:
    """A random EAGLE-3 head of the right shape for target_cfg, in the layout vLLM loads. It carries no
    embedding (the engine shares the target's), which keeps an 8B head near 0.85 GB in bf16."""
    hidden, inter = target_cfg["hidden_size"], target_cfg["intermediate_size"]
    heads = target_cfg["num_attention_heads"]
    kv_heads = target_cfg.get("num_key_value_heads") or heads
    head_dim = target_cfg.get("head_dim") or hidden // heads
    vocab = target_cfg["vocab_size"]
    draft_vocab = min(DRAFT_VOCAB, vocab)
    aux = list(default_aux_layers(target_cfg["num_hidden_layers"]))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "head_dim": head_dim, "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
           "rms_norm_eps": target_cfg.get("rms_norm_eps", 1e-5), "rope_theta": target_cfg.get("rope_theta", 10000.0),
           "max_position_embeddings": target_cfg["max_position_embeddings"], "tie_word_embeddings": False,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}}
    gen = torch.Generator(device=device).manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        # Drawn on the device (fast for a 4096-wide head), saved from the host.
        return torch.empty(rows, cols, dtype=dtype, device=device).normal_(0.0, INIT_STD, generator=gen).cpu()

    q, kv = heads * head_dim, kv_heads * head_dim
    tensors = {
        "fc.weight": matrix(hidden, len(aux) * hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden, dtype=dtype),
        "midlayer.hidden_norm.weight": torch.ones(hidden, dtype=dtype),
        "midlayer.self_attn.q_proj.weight": matrix(q, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": matrix(kv, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": matrix(kv, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": matrix(hidden, q),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden, dtype=dtype),
        "midlayer.mlp.gate_proj.weight": matrix(inter, hidden),
        "midlayer.mlp.up_proj.weight": matrix(inter, hidden),
        "midlayer.mlp.down_proj.weight": matrix(hidden, inter),
        "norm.weight": torch.ones(hidden, dtype=dtype),
        "lm_head.weight": matrix(draft_vocab, hidden),
    }
    # The draft vocabulary is a random subset of the target's: target id = draft id + d2t[draft id].
    chosen = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
    tensors["d2t"] = chosen - torch.arange(draft_vocab)
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, chosen, True)
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def build_hf_model(model: BenchModel, dtype: torch.dtype, device: str):
    """transformers' own implementation of the same model, made on the device: random weights for a
    shape (transformers' initialisation, N(0, 0.02)), else the very weights specserve reads."""
    import transformers

    arch = model.hf_config["architectures"][0]
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise ValueError(f"transformers has no {arch}; the transformers peer cannot run for {model.name}")
    config = cls.config_class(**{k: v for k, v in model.hf_config.items() if k != "architectures"})
    with torch.device(device):
        hf = cls._from_config(config, dtype=dtype)
    if not model.random_weights:
        missing, unexpected = hf.load_state_dict(dict(hf_named_weights(open_model_source(model.path))), strict=False)
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise ValueError(f"transformers' {arch} does not take the weights of {model.name}: "
                             f"missing {sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]}")
    hf.generation_config.eos_token_id = None
    return hf.eval().requires_grad_(False)


def distinct_params(module: torch.nn.Module) -> tuple[int, int]:
    """(count, bytes) of the distinct parameters (a tied embedding counts once); the bytes are the weight
    bytes of the batch-1 floor (docs/design.md, 'Performance: what to measure')."""
    seen: dict[int, torch.nn.Parameter] = {p.data_ptr(): p for p in module.parameters()}
    return sum(p.numel() for p in seen.values()), sum(p.numel() * p.element_size() for p in seen.values())
