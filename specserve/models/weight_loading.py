"""Loading Hugging Face-named weights into our modules, which store q/k/v and gate/up fused."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from specserve.errors import ModelLoadError
from specserve.models.arch_config import ArchConfig
from specserve.quantization.fp8 import FP8_DTYPE

# An FP8 projection's scales (quantization/fp8_linear.py): float32, flattened as they load.
SCALE_SUFFIXES = (".weight_scale", ".input_scale")

# Hugging Face projection name -> (our fused parameter, shard index).
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def load_hf_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    cfg: ArchConfig,
    rename: Callable[[str], str | None] = lambda n: n,
    optional: tuple[str, ...] = (),
    shard: Callable[[str, int | None, torch.Tensor], torch.Tensor] | None = None,
) -> set[str]:
    """Copy weights into module; `rename` maps a checkpoint name to ours (None skips it). `shard(name, part,
    tensor)` cuts a tensor to this rank's slice (models/parallel_layers.py, shard_weight) before its copy;
    `part` indexes the parts of a fused parameter (q, k, v; gate, up), None for others.

    FP8 projections (quantization/fp8_linear.py) also load `weight_scale` (per channel, [N] or [N, 1], or one per
    tensor, which then scales every row of its part) and `input_scale` (one per part).

    Raises ModelLoadError on an unknown name, a wrong shape or dtype, or a missing weight
    (parameters whose name starts with one of `optional` may be missing).
    Returns the names of the parameters that were loaded.
    """
    params = dict(module.named_parameters())
    shard_sizes = {
        "qkv_proj": [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2,
        "gate_up_proj": [cfg.intermediate_size] * 2,
    }
    loaded: set[str] = set()
    for raw_name, tensor in weights:
        name = rename(raw_name)
        if name is None:
            continue
        if name.endswith(".weight_scale_inv"):
            # transformers' name for a per-tensor FP8 weight's scale: the factor that dequantizes, as ours.
            name = name.removesuffix("_inv")
        scale = name.endswith(SCALE_SUFFIXES)
        if scale:
            tensor = tensor.reshape(-1).float()
        parts = name.split(".")
        part = None
        for i, p in enumerate(parts):
            if p in _FUSED:
                fused, part = _FUSED[p]
                name = ".".join(parts[:i] + [fused] + parts[i + 1:])
                break
        if name not in params:
            raise ModelLoadError(f"weight {raw_name!r} does not belong to a {type(module).__name__} "
                                 f"({cfg.architecture}); is the config right?")
        dst = params[name].data
        if part is not None and name.endswith(".input_scale"):
            dst = dst.narrow(0, part, 1)
        elif part is not None:
            sizes = shard_sizes[name.split(".")[-2]]
            dst = dst.narrow(0, sum(sizes[:part]), sizes[part])
        if shard is not None:
            tensor = shard(name, part, tensor)
        if scale and tensor.numel() == 1:
            tensor = tensor.expand(dst.shape)
        if (dst.dtype == FP8_DTYPE) != (tensor.dtype == FP8_DTYPE):
            raise ModelLoadError(f"weight {raw_name!r} is {tensor.dtype} where the model's quantization_config "
                                 f"makes it {dst.dtype}; the checkpoint and its config.json disagree")
        if dst.shape != tensor.shape:
            raise ModelLoadError(f"weight {raw_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        loaded.add(f"{name}#{part}")

    expected = set()
    for pname, _ in module.named_parameters():
        leaf = pname.split(".")[-2] if "." in pname else ""
        if pname.startswith(optional):
            continue
        if leaf in shard_sizes:
            expected.update(f"{pname}#{i}" for i in range(len(shard_sizes[leaf])))
        else:
            expected.add(f"{pname}#None")
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"the checkpoint lacks {len(missing)} weights, e.g. {missing[0].split('#')[0]}; "
                             "the file may be truncated or of another model")
    return {n.split("#")[0] for n in loaded}
