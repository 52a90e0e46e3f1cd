"""FP8 checkpoints written by hand in the layouts of the Hugging Face hub's FP8 models, from an unquantized
tiny model: vLLM's / transformers' quant_method "fp8" (per-tensor weight scales as 0-d tensors, static input
scales) and compressed-tensors' (weight_scale [N, 1] per channel or [1] per tensor, input_scale [1]).
Beside each, the same weights dequantized in float32 (an unquantized checkpoint), the reference it must equal."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTION = re.compile(r".*\.(q|k|v|o|gate|up|down)_proj\.weight")


def _quantize(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale [N, 1] or [1]) with scale = amax / 448, written out here from the definition."""
    w = w.double()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    scale = (amax / 448.0).float()
    q = (w / scale.double().reshape(-1, 1)).clamp(-448, 448).float().to(torch.float8_e4m3fn)
    return q, scale


def _static_input_scale(name: str) -> torch.Tensor:
    """A static input scale per projection, different for q, k and v so that loading must take their largest."""
    return torch.tensor([{"q": 0.03, "k": 0.05, "v": 0.04}.get(name.split(".")[-2][0], 0.06)], dtype=torch.float32)


def write_fp8_checkpoint(src: Path, dst: Path, method: str, per_channel: bool, activations: str | None) -> Path:
    """An FP8 copy of the unquantized checkpoint src at dst, and its dequantized float32 twin at dst + "-deq".
    method: "fp8" or "compressed-tensors"; activations: None (weight only), "static" or "dynamic"."""
    weights = load_file(str(src / "model.safetensors"))
    fp8, deq = {}, {}
    for name, w in weights.items():
        if not PROJECTION.fullmatch(name):
            fp8[name] = deq[name] = w
            continue
        q, scale = _quantize(w, per_channel)
        fp8[name] = q
        prefix = name.removesuffix(".weight")
        fp8[prefix + ".weight_scale"] = scale.reshape(()) if method == "fp8" else scale
        if activations == "static":
            s = _static_input_scale(name)
            fp8[prefix + ".input_scale"] = s.reshape(()) if method == "fp8" else s
        deq[name] = (q.float() * scale.reshape(-1, 1)).float()
    config = json.loads((src / "config.json").read_text())
    if method == "fp8":
        quant = {"quant_method": "fp8", "activation_scheme": activations or "dynamic"}
    else:
        acts = None if activations is None else {"num_bits": 8, "type": "float", "symmetric": True,
                                                 "dynamic": activations == "dynamic",
                                                 "strategy": "token" if activations == "dynamic" else "tensor"}
        quant = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                 "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts,
                                               "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                           "dynamic": False,
                                                           "strategy": "channel" if per_channel else "tensor"}}}}
    for path, tensors, cfg in ((dst, fp8, {**config, "quantization_config": quant}),
                               (Path(f"{dst}-deq"), deq, {**config, "torch_dtype": "float32"})):
        path.mkdir(parents=True)
        for f in src.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                shutil.copy(f, path / f.name)
        save_file(tensors, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(cfg))
    return dst


# Layouts of KV-cache scales on the hub (the names after "model.layers.<i>.self_attn."): the key's, the value's
# (None: one scale for both), and the shape of the tensor each quantizer writes.
KV_SCALE_LAYOUTS = {
    "fp8": ("k_scale", "v_scale", ()),
    "kv_scale": ("kv_scale", None, ()),
    "vllm": ("attn.k_scale", "attn.v_scale", ()),
    "modelopt": ("k_proj.k_scale", "v_proj.v_scale", ()),
    "compressed-tensors": ("k_proj.output_scale", "v_proj.output_scale", (1,)),
}
# compressed-tensors' declaration of static FP8 KV-cache scales per tensor.
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def add_kv_scales(ckpt: Path, layout: str, scales: list[tuple[float, float]]) -> Path:
    """ckpt with each layer's (k_scale, v_scale) added in `layout` (KV_SCALE_LAYOUTS; "kv_scale" writes only the
    k of each pair); a compressed-tensors layout declares its kv_cache_scheme, in the checkpoint's own
    quantization_config or, for an unquantized checkpoint, one with no weight groups."""
    k_name, v_name, shape = KV_SCALE_LAYOUTS[layout]
    weights = load_file(str(ckpt / "model.safetensors"))
    for i, (k, v) in enumerate(scales):
        prefix = f"model.layers.{i}.self_attn."
        weights[prefix + k_name] = torch.tensor(k, dtype=torch.float32).reshape(shape)
        if v_name is not None:
            weights[prefix + v_name] = torch.tensor(v, dtype=torch.float32).reshape(shape)
    save_file(weights, str(ckpt / "model.safetensors"))
    if layout == "compressed-tensors":
        config = json.loads((ckpt / "config.json").read_text())
        quant = config.get("quantization_config") or {"quant_method": "compressed-tensors", "format": "dense"}
        config["quantization_config"] = {**quant, "kv_cache_scheme": KV_CACHE_SCHEME}
        (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt
