"""Build the speculator a SpeculativeConfig asks for, checking that it fits the target."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from specserve.config import EngineConfig
from specserve.distributed.parallel_state import TPGroup, tp_group
from specserve.errors import ConfigError, ModelLoadError
from specserve.models.arch_config import ArchConfig
from specserve.models.llama import SINGLE
from specserve.models.parallel_layers import shard_arch
from specserve.spec_decode.config import SpeculativeConfig
from specserve.spec_decode.speculator import Speculator

logger = logging.getLogger(__name__)


def _bad(field: str, msg: str) -> ConfigError:
    return ConfigError(f"speculative_config.{field}", msg)


def _head_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise _bad("model", f"{path} has no config.json; an EAGLE head is a Hugging Face directory")
    return json.loads(cfg_file.read_text())


def _head_arch(cfg: dict) -> ArchConfig:
    # Heads name their own architectures (EagleLlamaForCausalLM, LlamaForCausalLMEagle3, ...);
    # their decoder layer is a Llama layer.
    return ArchConfig.from_hf_config({**cfg, "architectures": ["LlamaForCausalLM"]})


def head_mismatch(hidden_size, vocab_size, target: ArchConfig) -> str | None:
    """Why a head of these sizes cannot serve target (training from one shares the check); None if it can."""
    for name, got, want in (("hidden size", hidden_size, target.hidden_size),
                            ("vocabulary size", vocab_size, target.vocab_size)):
        if got != want:
            return f"{name} {got} does not match the target's {want}"
    return None


def _check_fit(head: ArchConfig, target: ArchConfig, what: str) -> None:
    if (why := head_mismatch(head.hidden_size, head.vocab_size, target)) is not None:
        raise _bad("model", f"the {what}'s {why}; use a {what} trained for this target")


def _shared_weight(target_model, engine: EngineConfig | None, name: str) -> torch.nn.Parameter | None:
    """The target's `name` (model.embed_tokens.weight or lm_head.weight), for a head without its own. Under
    tensor parallelism the target holds a shard of it and the head's embedding and lm_head are whole (on rank 0,
    or on every rank beside its sharded layer), so it is read whole from the target's checkpoint; with random
    weights (load_format dummy) there is none, and the head keeps
    its own random one."""
    if engine is None or engine.tensor_parallel_size == 1:
        module = target_model.model.embed_tokens if name == "model.embed_tokens.weight" else target_model.lm_head
        return module.weight
    if engine.load_format == "dummy":
        return None
    from specserve.models.loader import open_model_source, whole_tensors

    embed = "model.embed_tokens.weight"
    found = whole_tensors(open_model_source(engine.model, engine.revision), {name, embed})
    # A target that ties lm_head to its embedding stores the embedding only.
    return torch.nn.Parameter(found.get(name, found[embed]), requires_grad=False)


def _head_group(engine: EngineConfig | None, arch: ArchConfig) -> TPGroup:
    """The group the head is sharded over: the target's where the drafter is sharded like it
    (draft_tensor_parallel_size N), else one rank. Raises ConfigError naming the fix for a head that N does not
    split."""
    if engine is None or not engine.drafter_sharded:
        return SINGLE
    tp = tp_group()
    try:
        shard_arch(arch, tp)
    except ConfigError as e:
        why = str(e).removeprefix(f"{e.field}: ").split(";")[0]
        raise _bad("draft_tensor_parallel_size", f"{tp.size} cannot shard the head: {why}; pass 1 to run the head "
                   "whole on rank 0") from e
    return tp


def load_head(cfg: SpeculativeConfig, target_model, target: ArchConfig, backend, engine: EngineConfig | None = None):
    """cfg's EAGLE or EAGLE-3 head for target_model (of architecture target). engine: the serving engine's config,
    which says whether the head is sharded like the target and where the target's shared weights are whole;
    None (a script beside a whole target) loads one whole head."""
    from specserve.models.eagle import EagleHead
    from specserve.models.eagle3 import Eagle3Head, default_aux_layers
    from specserve.models.loader import safetensors_weights

    path = Path(cfg.model).expanduser()
    raw = _head_config(path)
    arch = _head_arch(raw)
    _check_fit(arch, target, "head")
    tp = _head_group(engine, arch)
    if cfg.method == "eagle":
        head = EagleHead(arch, backend, fc_bias=bool(raw.get("bias", False)), tp=tp)
    else:
        layers = tuple((raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                       or default_aux_layers(target.num_layers))
        if any(not 0 <= i < target.num_layers for i in layers):
            raise _bad("model", f"auxiliary layers {layers} do not exist in a {target.num_layers}-layer target")
        head = Eagle3Head(arch, backend, raw.get("draft_vocab_size") or arch.vocab_size, target.hidden_size, layers,
                          tp=tp)
    loaded = head.load_weights(safetensors_weights(path))
    # Heads usually share the target's embedding (and EAGLE-1 its lm_head): take them when absent.
    missing = ["model.embed_tokens.weight"] if "embed_tokens.weight" not in loaded else []
    if cfg.method == "eagle" and "lm_head.weight" not in loaded:
        missing.append("lm_head.weight")
    for name in missing:
        weight = _shared_weight(target_model, engine, name)
        if weight is not None:
            (head.embed_tokens if name.startswith("model.") else head.lm_head).weight = weight
    return head


def build_speculator(cfg: SpeculativeConfig, runner, backend) -> Speculator:
    from specserve.spec_decode.ngram_speculator import NgramSpeculator

    if cfg.method == "ngram":
        return NgramSpeculator(cfg)
    target = runner.arch
    common = dict(k=cfg.num_speculative_tokens, vocab_size=target.vocab_size, max_num_reqs=runner.config.max_num_seqs,
                  max_num_tokens=runner.config.max_num_batched_tokens, block_size=runner.block_size,
                  max_position=target.max_position_embeddings, device=runner.device,
                  generator=runner.sampler.default_generator, target_input_ids=runner.buffers.input_ids,
                  target_positions=runner.buffers.positions)
    if cfg.method == "draft_model":
        from specserve.models.loader import build_model, open_model_source
        from specserve.spec_decode.draft_model import DraftModelSpeculator

        try:
            model, arch = build_model(open_model_source(cfg.model), runner.dtype, str(runner.device), backend,
                                      quantization=cfg.quantization, kv_cache_dtype=runner.config.kv_cache_dtype)
        except ModelLoadError as e:
            raise _bad("model", str(e)) from e
        if arch.vocab_size != target.vocab_size:
            raise _bad("model", f"the draft model's vocabulary size {arch.vocab_size} does not match the target's "
                       f"{target.vocab_size}; it must share the target's tokenizer")
        logger.info("Draft model: %d layers, hidden %d", arch.num_layers, arch.hidden_size)
        return DraftModelSpeculator(model, arch, **common)
    from specserve.spec_decode.eagle.speculator import EagleSpeculator

    head = load_head(cfg, runner.model, target, backend, runner.config).to(device=runner.device, dtype=runner.dtype)
    head = head.eval().requires_grad_(False)
    if cfg.quantization == "fp8":
        from specserve.quantization.fp8_model import quantize_projections

        quantize_projections(head)
    logger.info("%s head loaded from %s", cfg.method.upper(), cfg.model)
    return EagleSpeculator(head, dtype=runner.dtype, tree_tables=runner.tree_tables, **common)
