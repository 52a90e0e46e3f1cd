"""Any model the engine loads, written as a complete Hugging Face directory (`specserve export MODEL OUT_DIR`).

The directory is what transformers' from_pretrained, vLLM and this engine load: config.json (with model_type,
architectures and torch_dtype), the weights as safetensors (a GGUF's dequantized, all cast to one dtype), the
tokenizer (tokenizer.json, tokenizer_config.json holding the chat template, special_tokens_map.json) and
generation_config.json. The decode benchmark's copies of a GGUF are written here too, and trained EAGLE heads
(train/export.py) through write_safetensors.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.config import DTYPES
from specserve.errors import ConfigError
from specserve.models.arch_config import SUPPORTED_ARCHITECTURES, ArchConfig
from specserve.models.loader import ModelSource, hf_named_weights, load_tokenizer, open_model_source

# As transformers' save_pretrained: a model of up to 5 GB is one model.safetensors.
MAX_SHARD_BYTES = 5 * 10**9
# Written by transformers 5 as the class of a fast tokenizer; older versions (as vLLM may run) know it by
# this name, which transformers 5 reads as the same class.
_FAST_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


@dataclass
class ExportConfig:
    """What `specserve export` writes. dtype None: the model's own (torch_dtype of a Hugging Face directory),
    float32 for a GGUF, whose dequantized weights it holds exactly."""

    model: str
    out_dir: Path
    dtype: str | None = None
    revision: str | None = None
    max_shard_bytes: int = MAX_SHARD_BYTES

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir).expanduser()
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError("dtype", f"must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.max_shard_bytes < 1:
            raise ConfigError("max_shard_bytes", f"must be >= 1, got {self.max_shard_bytes}")
        if self.out_dir.is_file():
            raise ConfigError("out_dir", f"{self.out_dir} is a file; give a directory to write the model into")


def export(cfg: ExportConfig) -> Path:
    """Write cfg.model as a Hugging Face directory at cfg.out_dir; returns it."""
    source = open_model_source(cfg.model, cfg.revision)
    dtype = cfg.dtype or source_dtype(source)
    return write_hf_directory(source, cfg.out_dir, DTYPES[dtype], cfg.max_shard_bytes)


def source_dtype(source: ModelSource) -> str:
    name = source.hf_config.get("torch_dtype") or source.hf_config.get("dtype")
    return name if not source.is_gguf and name in DTYPES else "float32"


def write_hf_directory(source: ModelSource, out: Path, dtype: torch.dtype,
                       max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out, {n: t.to(dtype).contiguous() for n, t in hf_named_weights(source)}, max_shard_bytes)
    config = hf_config(source, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(source, out, config["max_position_embeddings"])
    _write_generation_config(source, out, config)
    return out


def hf_config(source: ModelSource, dtype: torch.dtype) -> dict:
    """The source's config as transformers and vLLM read it: model_type (which they dispatch on) and
    architectures named, and torch_dtype the weights'."""
    arch = ArchConfig.from_hf_config(source.hf_config)
    return {**source.hf_config, "architectures": [arch.architecture],
            "model_type": source.hf_config.get("model_type") or SUPPORTED_ARCHITECTURES[arch.architecture],
            "hidden_act": source.hf_config.get("hidden_act", "silu"),
            "torch_dtype": str(dtype).removeprefix("torch.")}


def _write_tokenizer(source: ModelSource, out: Path, max_length: int) -> None:
    tok = load_tokenizer(source)
    # The chat template inside tokenizer_config.json, where every transformers version looks for it.
    tok.save_pretrained(str(out), save_jinja_files=False)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):  # how this copy was loaded, not what the tokenizer is
        config.pop(key, None)
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = _FAST_TOKENIZER_CLASS
    if isinstance(tok.chat_template, str):
        config["chat_template"] = tok.chat_template
    config["model_max_length"] = min(config.get("model_max_length", max_length), max_length)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(tok.special_tokens_map, indent=2, ensure_ascii=False))


def _write_generation_config(source: ModelSource, out: Path, config: dict) -> None:
    own = source.path / "generation_config.json"
    if not source.is_gguf and own.is_file():
        shutil.copyfile(own, out / "generation_config.json")
        return
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(ids, indent=2))


def shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Names per shard, in name order, each shard's tensors adding up to at most max_bytes
    (a tensor larger than that alone in its shard)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(tensors):
        size = tensors[name].numel() * tensors[name].element_size()
        if used + size > max_bytes and shards[-1]:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_safetensors(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[Path]:
    """Write tensors into out as model.safetensors, or as shards of at most max_shard_bytes with an index;
    returns the files."""
    from safetensors.torch import save_file

    names = shard(tensors, max_shard_bytes)
    # Weights of an earlier export with another shard count would be read too.
    for stale in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    if len(names) == 1:
        files = [out / "model.safetensors"]
    else:
        files = [out / f"model-{i + 1:05d}-of-{len(names):05d}.safetensors" for i in range(len(names))]
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {n: f.name for f, group in zip(files, names) for n in group}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for f, group in zip(files, names):
        save_file({n: tensors[n] for n in group}, str(f), metadata={"format": "pt"})
    return files
