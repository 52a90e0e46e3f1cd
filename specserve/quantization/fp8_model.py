"""Which layers of a model are FP8, and making them so (docs/design.md, 'FP8 weights').

Every projection of the decoder layers is: the fused qkv, o_proj, the fused gate/up and down_proj, of the
target and of an EAGLE head's layer. Embeddings, lm_head, an EAGLE head's fc and the norms stay in the
model's dtype, as vLLM keeps them.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from specserve.quantization.block_fp8_linear import BlockFp8Linear
from specserve.quantization.checkpoint import Fp8Scheme
from specserve.quantization.fp8 import quantize_per_channel
from specserve.quantization.fp8_linear import Fp8Linear
from specserve.quantization.gguf_blocks import block_codes_of, has_offset

# Our projection -> how many checkpoint projections it fuses (q, k, v; gate, up).
FP8_PROJECTIONS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
# The checkpoint's (Hugging Face) names of their weights.
_CHECKPOINT_WEIGHT = re.compile(r".*\.(q|k|v|o|gate|up|down)_proj\.weight")


def _projections(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Linear]]:
    for module in list(model.modules()):
        for name in FP8_PROJECTIONS:
            linear = getattr(module, name, None)
            if isinstance(linear, nn.Linear):
                yield module, name, linear


def use_fp8_projections(model: nn.Module, scheme: Fp8Scheme) -> None:
    """Replace model's projections by empty FP8 layers of the same shapes (on the device their weights are on,
    meta while a model is built) for an FP8 checkpoint to load into: Fp8Linear, or BlockFp8Linear for a GGUF's
    block codes (scheme.block_type)."""
    for parent, name, linear in _projections(model):
        with torch.device(linear.weight.device):
            if scheme.block_type is not None:
                layer = BlockFp8Linear(linear.in_features, linear.out_features, linear.bias is not None,
                                       has_offset(scheme.block_type))
            else:
                layer = Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None,
                                  scheme.activation, FP8_PROJECTIONS[name])
        setattr(parent, name, layer)


def quantize_projections(model: nn.Module, block_type: str | None = None) -> None:
    """Quantize model's loaded projections in place, where they are: per-channel weights and per-token inputs, or
    with block_type (a GGML type of gguf_blocks.HELD_TYPES) into its block codes (gguf_blocks.block_codes_of)."""
    for parent, name, linear in _projections(model):
        if block_type is None:
            setattr(parent, name, Fp8Linear.quantize(linear))
            continue
        codes = block_codes_of(linear.weight, block_type)
        with torch.device(linear.weight.device):
            layer = BlockFp8Linear(linear.in_features, linear.out_features, linear.bias is not None,
                                   codes.offset is not None)
        for param, value in ((layer.weight, codes.codes), (layer.block_scale, codes.scale),
                             (layer.block_offset, codes.offset), (layer.bias, linear.bias)):
            if param is not None:
                param.data.copy_(value)
        layer.fused = linear.weight.is_cuda
        setattr(parent, name, layer)


def quantized_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors with each projection weight quantized as it passes, whole (before a
    tensor-parallel rank takes its slice, so a row-parallel layer's scales cover its whole rows): the weight
    as FP8 and its per-channel `weight_scale`, the layout of an FP8 checkpoint."""
    for name, tensor in weights:
        if _CHECKPOINT_WEIGHT.fullmatch(name):
            q, scale = quantize_per_channel(tensor)
            yield name, q
            yield name + "_scale", scale
        else:
            yield name, tensor
