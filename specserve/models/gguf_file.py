"""Reading GGUF files: config, tokenizer source and weights under Hugging Face names (dequantized, or a
projection's FP8 block codes: quantization/gguf_blocks.py)."""
from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from specserve.errors import ModelLoadError
from specserve.models.arch_config import SUPPORTED_ARCHITECTURES

# GGUF's general.architecture is the Hugging Face model_type.
_ARCH_TO_HF = {model_type: arch for arch, model_type in SUPPORTED_ARCHITECTURES.items()}
# llama.cpp's converter interleaves the rotary halves of q and k for these; we undo it.
_PERMUTED_QK = {"llama", "mistral"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def open_gguf(path: Path):
    """The file's reader, shared by every caller in this process while the file is unchanged: the reader parses
    all metadata up front (a tokenizer's tens of thousands of strings one by one, seconds), and a load reads
    the config and then the weights. The reader maps the file read-only, so sharing it is safe."""
    stat = path.stat()
    return _read_gguf(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _read_gguf(path: str, size: int, mtime_ns: int):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors on damaged files
        raise ModelLoadError(
            f"cannot read GGUF file {path}: {type(e).__name__}: {e}. The file is corrupt or truncated; download it again"
        ) from e


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_hf_config(reader, path: Path) -> dict:
    """A Hugging Face style config dict built from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCH_TO_HF:
        raise ModelLoadError(
            f"GGUF file {path} holds a {arch!r} model; specserve reads GGUF files of {', '.join(sorted(_ARCH_TO_HF))}"
        )
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ModelLoadError(f"GGUF file {path} uses per-frequency rope factors (rope_freqs), which are not supported; "
                             "load the Hugging Face directory of this model instead")

    def get(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    vocab = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    rope = None
    if get("rope.scaling.type") == "linear":
        rope = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    return {
        "architectures": [_ARCH_TO_HF[arch]],
        "model_type": arch,
        "hidden_act": "silu",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": get("attention.head_count_kv", num_heads),
        "head_dim": get("attention.key_length", hidden // num_heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "rope_scaling": rope,
        "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "attention_bias": any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "use_sliding_window": False,
    }


def _hf_name(name: str) -> str:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ModelLoadError(f"unexpected tensor {name!r} in GGUF file")


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _is_projection(name: str) -> bool:
    return re.fullmatch(r"blk\.\d+\.(attn_[qkv]|attn_output|ffn_gate|ffn_up|ffn_down)\.weight", name) is not None


def projection_block_type(reader) -> str | None:
    """The GGML type every decoder projection weight of the file has, where it is one whose codes FP8 holds
    exactly (quantization/gguf_blocks.py, HELD_TYPES); None otherwise (mixed or other types)."""
    from specserve.quantization.gguf_blocks import HELD_TYPES

    types = {t.tensor_type.name for t in reader.tensors if _is_projection(t.name)}
    return types.pop() if len(types) == 1 and types <= set(HELD_TYPES) else None


def gguf_weight_count(reader, block_codes: bool = False) -> int:
    """How many tensors gguf_weights(reader, ..., block_codes) yields."""
    from specserve.quantization.gguf_blocks import has_offset

    return sum(2 + has_offset(t.tensor_type.name) if block_codes and _is_projection(t.name) else 1
               for t in reader.tensors)


def gguf_weights(reader, config: dict, block_codes: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors under Hugging Face names, dequantized to float32; with block_codes the projection
    weights as their FP8 codes (`weight`), block scales (`block_scale`) and offsets (`block_offset`, where the
    type has them) instead, for BlockFp8Linear layers (projection_block_type must name the file's type)."""
    from gguf.quants import dequantize

    from specserve.quantization.gguf_blocks import decode_blocks

    arch = _field(reader, "general.architecture")
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        name = _hf_name(t.name)
        if block_codes and _is_projection(t.name):
            b = decode_blocks(t.data, t.tensor_type.name, shape)
            base = name.removesuffix("weight")
            parts = {name: b.codes, base + "block_scale": b.scale, base + "block_offset": b.offset}
        else:
            # A copy: unquantized tensors come back as read-only views of the memory-mapped file.
            parts = {name: torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
                                            .reshape(shape))}
        for part_name, w in parts.items():
            if w is None:
                continue
            # llama.cpp permuted q's and k's rows (each row's codes, scales and offsets alike).
            if arch in _PERMUTED_QK and t.name.endswith("attn_q.weight"):
                w = _unpermute(w, config["num_attention_heads"])
            elif arch in _PERMUTED_QK and t.name.endswith("attn_k.weight"):
                w = _unpermute(w, config["num_key_value_heads"])
            yield part_name, w.contiguous()
