"""The FP8 scheme of a checkpoint, read from its config.json's `quantization_config`.

Two layouts are read (docs/design.md, 'FP8 weights'):

- quant_method "fp8" (vLLM's and transformers' FP8 format): per-tensor weight scales (`weight_scale`, or
  `weight_scale_inv` as transformers names it), `activation_scheme` "static" (an `input_scale` per layer) or
  "dynamic". Block-wise scales (`weight_block_size`) are refused.
- quant_method "compressed-tensors" (llm-compressor's): one config group of 8-bit float weights with
  strategy "tensor" or "channel" (`weight_scale` [1] or [N, 1]) and input activations that are null (weight
  only), static per tensor (`input_scale`), or dynamic. Dynamic scales are computed per token whatever the
  strategy: finer than one per tensor, and a row's result then never depends on its batch. A kv_cache_scheme
  (static 8-bit float scales per tensor, symmetric: the one vLLM loads) means the checkpoint holds KV-cache
  scales (kv_cache_scales.py); with it, the config groups may be none (the weights unquantized).

Either way every projection of the decoder layers is FP8 and nothing else is (the `ignore` list may name
lm_head only); anything else is refused with a ModelLoadError naming the fix.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from specserve.errors import ModelLoadError
from specserve.quantization.fp8_linear import Fp8Activation

_FIX = "use a per-tensor or per-channel FP8 checkpoint, or the bfloat16 one with quantization='fp8'"


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's projections are FP8: the activations' quantization, and the weights' layout: a float32
    scale per output channel (Fp8Linear), or with block_type (a GGML type of gguf_blocks.HELD_TYPES) the GGUF's
    own codes with their block scales (BlockFp8Linear, whose input stays unquantized)."""

    activation: Fp8Activation
    block_type: str | None = None

    def __post_init__(self):
        if self.block_type is not None and self.activation is not Fp8Activation.NONE:
            raise ValueError(f"block codes take an unquantized input, not {self.activation.value}")


def _refuse(what: str) -> ModelLoadError:
    return ModelLoadError(f"this checkpoint's quantization_config {what}, which specserve does not load; {_FIX}")


def checkpoint_fp8_scheme(hf_config: dict) -> Fp8Scheme | None:
    """The checkpoint's FP8 scheme, None for an unquantized checkpoint; raises ModelLoadError for a
    quantization it cannot load."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_method(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise _refuse(f"has quant_method {method!r} (supported: 'fp8', 'compressed-tensors')")


def _fp8_method(qc: dict) -> Fp8Scheme:
    if qc.get("weight_block_size"):
        raise _refuse(f"has block-wise weight scales (weight_block_size {qc['weight_block_size']})")
    _check_ignored(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or [])
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("static", "dynamic"):
        raise _refuse(f"has activation_scheme {scheme!r} (supported: 'static', 'dynamic')")
    return Fp8Scheme(Fp8Activation(scheme))


def _compressed_tensors(qc: dict) -> Fp8Scheme | None:
    kv_scheme = qc.get("kv_cache_scheme")
    if kv_scheme:
        _check_kv_cache_scheme(kv_scheme)
    groups = list((qc.get("config_groups") or {}).values())
    if not groups and kv_scheme:
        return None  # KV-cache scales alone: the weights are stored unquantized, whatever the format says
    fmt = qc.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(f"has format {fmt!r} (supported: 'float-quantized', 'naive-quantized')")
    if len(groups) != 1:
        raise _refuse(f"has {len(groups)} config groups (one, covering every Linear, is supported)")
    group = groups[0]
    if not set(group.get("targets") or []) & {"Linear", "re:.*"}:
        raise _refuse(f"targets {group.get('targets')!r} (every Linear is supported)")
    weights = group.get("weights") or {}
    if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
        raise _refuse(f"quantizes weights to {weights.get('num_bits')}-bit {weights.get('type')} (8-bit float is "
                      "supported)")
    if weights.get("strategy") not in ("tensor", "channel") or weights.get("dynamic"):
        raise _refuse(f"has weight strategy {weights.get('strategy')!r} (static 'tensor' or 'channel' supported)")
    _check_ignored(qc.get("ignore") or [])
    acts = group.get("input_activations")
    if acts is None:
        return Fp8Scheme(Fp8Activation.NONE)
    if (acts.get("num_bits"), acts.get("type")) != (8, "float"):
        raise _refuse(f"quantizes activations to {acts.get('num_bits')}-bit {acts.get('type')} (8-bit float or none "
                      "is supported)")
    if acts.get("dynamic"):
        return Fp8Scheme(Fp8Activation.DYNAMIC)
    if acts.get("strategy") != "tensor":
        raise _refuse(f"has static activation strategy {acts.get('strategy')!r} ('tensor' is supported)")
    return Fp8Scheme(Fp8Activation.STATIC)


def _check_kv_cache_scheme(scheme: dict) -> None:
    what = None
    if (scheme.get("num_bits"), scheme.get("type")) != (8, "float"):
        what = f"quantizes the KV cache to {scheme.get('num_bits')}-bit {scheme.get('type')} (8-bit float is supported)"
    elif scheme.get("strategy") != "tensor":
        what = f"has KV-cache strategy {scheme.get('strategy')!r} (one scale per tensor, 'tensor', is supported)"
    elif scheme.get("dynamic"):
        what = "has dynamic KV-cache scales (static ones, held by the checkpoint, are supported)"
    elif not scheme.get("symmetric", True):
        what = "has asymmetric KV-cache scales (symmetric ones are supported)"
    if what is not None:
        raise ModelLoadError(f"this checkpoint's quantization_config {what}, which specserve does not load; use a "
                             "checkpoint without kv_cache_scheme or with static 8-bit float scales per tensor")


def declares_kv_cache_scales(hf_config: dict) -> bool:
    """Whether the checkpoint's config says it holds KV-cache scales (compressed-tensors' kv_cache_scheme)."""
    qc = hf_config.get("quantization_config") or {}
    return qc.get("quant_method") == "compressed-tensors" and bool(qc.get("kv_cache_scheme"))


def _check_ignored(ignored: list[str]) -> None:
    """Only lm_head may stay unquantized: every decoder projection is FP8 in the models specserve builds."""
    others = [name for name in ignored if not re.fullmatch(r"(re:)?(\.\*)?(model\.)?lm_head", name)]
    if others:
        raise _refuse(f"leaves {others[0]!r} unquantized (only lm_head may be)")


def model_fp8_scheme(hf_config: dict, quantization: str | None,
                     gguf_block_type: str | None = None) -> tuple[Fp8Scheme | None, bool]:
    """(the model's FP8 scheme or None, whether its weights are quantized per channel as they load): a
    checkpoint already in FP8 loads as it is; with quantization 'fp8', a GGUF whose projections are all of
    gguf_block_type (gguf_file.projection_block_type) loads their codes as they are, exactly, and any other
    unquantized checkpoint is quantized per channel, its inputs per token. Raises ModelLoadError for a checkpoint
    quantization that cannot load."""
    scheme = checkpoint_fp8_scheme(hf_config)
    if scheme is not None or quantization is None:
        return scheme, False
    if gguf_block_type is not None:
        return Fp8Scheme(Fp8Activation.NONE, gguf_block_type), False
    return Fp8Scheme(Fp8Activation.DYNAMIC), True
