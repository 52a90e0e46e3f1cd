"""KV-cache scales held by a checkpoint (docs/design.md, 'FP8 KV cache').

A checkpoint calibrated for an FP8 KV cache holds one float32 scale for the keys and one for the values of each
attention layer, under the names the hub's quantizers write (vLLM's loaders read the same ones):

- `<layer>.self_attn.k_scale`, `.v_scale`: quant_method "fp8" checkpoints and llm-compressor's newer ones;
- `<layer>.self_attn.kv_scale`: one scale for both (AutoFP8's older layout);
- `<layer>.self_attn.k_proj.k_scale`, `.v_proj.v_scale`: NVIDIA ModelOpt's;
- `<layer>.self_attn.k_proj.output_scale`, `.v_proj.output_scale`: compressed-tensors' kv_cache_scheme;
- `<layer>.self_attn.attn.k_scale`, `.v_scale`: vLLM's own parameter names.

They are taken out of the tensors as these stream to the model, checked (one positive, finite value each; every
attention layer has both or none has), and set on each layer's KVScales when the cache is FP8. A cache in the
model's dtype stores keys and values as they are, so with kv_cache_dtype "auto" they are left unused, as vLLM
does. A scale is per tensor, so every tensor-parallel rank uses the same one.
"""
from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from specserve.errors import ModelLoadError

logger = logging.getLogger(__name__)

_SCALE_NAME = re.compile(
    r"(?P<attention>.+\.self_attn)\."
    r"(?:(?:attn\.)?(?P<own>k|v|kv)_scale|(?P<proj>k|v)_proj\.(?:(?P=proj)_scale|output_scale))")


@dataclass(frozen=True)
class KVScaleTarget:
    """Where a checkpoint tensor's scale goes: an attention module's path and which of its scales it is."""

    attention: str  # e.g. "model.layers.3.self_attn"
    kind: str  # "k", "v", or "kv" (one scale for both)


def kv_scale_target(name: str) -> KVScaleTarget | None:
    """The target of a checkpoint tensor named `name`, None unless it is a KV-cache scale."""
    match = _SCALE_NAME.fullmatch(name)
    if match is None:
        return None
    return KVScaleTarget(match["attention"], match["own"] or match["proj"])


def _scale_value(name: str, tensor: torch.Tensor) -> float:
    """The one positive finite value of a checkpoint scale tensor; ModelLoadError naming it otherwise."""
    if tensor.numel() != 1:
        raise ModelLoadError(f"KV-cache scale {name!r} has shape {tuple(tensor.shape)}; specserve takes one scale "
                             "per tensor (a 0-d or [1] tensor), as vLLM does. Use a checkpoint calibrated per tensor")
    if not tensor.is_floating_point():
        raise ModelLoadError(f"KV-cache scale {name!r} is {tensor.dtype}, not a float; the file is not a KV-cache "
                             "scale of a supported quantizer")
    value = float(tensor.float().item())
    if not (math.isfinite(value) and value > 0):
        raise ModelLoadError(f"KV-cache scale {name!r} is {value:g}; a scale must be positive and finite. The "
                             "checkpoint's calibration is broken: recalibrate it, or use one without KV-cache scales")
    return value


class CheckpointKVScales:
    """Collects the KV-cache scales among a checkpoint's tensors as they stream past, then sets them on the model.

    declared: the checkpoint's config declares static KV-cache scales (compressed-tensors' kv_cache_scheme), so a
    checkpoint without them is incomplete.
    """

    def __init__(self, declared: bool = False):
        self.declared = declared
        # attention path -> {"k": value, "v": value}, and (path, "k" or "v") -> the checkpoint name it came from.
        self.scales: dict[str, dict[str, float]] = {}
        self.names: dict[tuple[str, str], str] = {}

    def take(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """weights without their KV-cache scales, which are kept here."""
        for name, tensor in weights:
            target = kv_scale_target(name)
            if target is None:
                yield name, tensor
                continue
            value = _scale_value(name, tensor)
            layer = self.scales.setdefault(target.attention, {})
            for kind in ("k", "v") if target.kind == "kv" else (target.kind,):
                if kind in layer:
                    raise ModelLoadError(f"the checkpoint holds two {kind}_scale tensors for {target.attention} "
                                         f"({self.names[target.attention, kind]!r} and {name!r}); keep one")
                layer[kind] = value
                self.names[target.attention, kind] = name

    def apply(self, model: nn.Module, kv_cache_dtype: str) -> None:
        """Set the collected scales on model's attention layers (their `kv_scales`) for an FP8 cache.

        Raises ModelLoadError for scales of a layer the model lacks, for a layer holding only one of its two
        scales or none where others hold theirs, and for a declared scheme without scales."""
        layers = {name: m for name, m in model.named_modules() if hasattr(m, "kv_scales")}
        if not self.scales:
            if self.declared:
                raise ModelLoadError("the checkpoint's quantization_config declares a kv_cache_scheme but the "
                                     "checkpoint holds no k_scale/v_scale tensors; the file may be truncated")
            return
        for path, layer in self.scales.items():
            present = next(iter(layer))  # "k" or "v": a layer in self.scales holds one at least
            name = self.names[path, present]
            if path not in layers:
                raise ModelLoadError(f"KV-cache scale {name!r} does not belong to an attention layer of a "
                                     f"{type(model).__name__}; is the config right?")
            if len(layer) != 2:
                missing = "v_scale" if present == "k" else "k_scale"
                raise ModelLoadError(f"the checkpoint holds {name!r} but no {missing} for {path}; the file may be "
                                     "truncated")
        lacking = sorted(set(layers) - set(self.scales))
        if lacking:
            raise ModelLoadError(f"the checkpoint holds KV-cache scales for {len(self.scales)} of {len(layers)} "
                                 f"attention layers (none for {lacking[0]}); the file may be truncated")
        if kv_cache_dtype == "auto":  # the model's dtype: keys and values are stored unscaled
            logger.info("The checkpoint holds KV-cache scales; a KV cache in the model's dtype does not use them "
                        "(kv_cache_dtype=%r). Pass kv_cache_dtype='fp8' to store keys and values in FP8 with them",
                        kv_cache_dtype)
            return
        for path, layer in self.scales.items():
            layers[path].kv_scales.set(layer["k"], layer["v"])
        logger.info("FP8 KV cache: the checkpoint's k and v scales are set on %d attention layers", len(self.scales))
